"""The run directory's tables (docs/outputs.md) and what a killed `--overwrite` left beside it;
the run directory itself: lmbatch/rundir/rundir.py."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pyarrow as pa


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:     # someone else's process
        return True
    return True


def clean_stale(final: Path) -> list[Path]:
    """What a killed `--overwrite` of `final` left beside it (its process is gone): a `.NAME.old-PID`
    holds the previous complete run, put back into place if the kill came while it was moved aside
    (`final` holds no run: neither summary.json nor INCOMPLETE), kept while the run replacing it is
    incomplete, else removed. Returns what it removed/restored."""
    touched = []
    for p in sorted(final.parent.glob(f".{final.name}.old-*")):
        pid = p.name.rsplit("-", 1)[-1]
        if not pid.isdigit() or int(pid) == os.getpid() or _alive(int(pid)):
            continue
        if not final.exists():
            p.rename(final)
        elif not (final / "summary.json").is_file() and not (final / "INCOMPLETE").is_file():
            for f in sorted(p.iterdir()):
                if not (final / f.name).exists():
                    f.rename(final / f.name)
            shutil.rmtree(p, ignore_errors=True)
        elif (final / "INCOMPLETE").is_file():
            continue            # the run a killed --overwrite replaces: kept until that one completes
        else:
            shutil.rmtree(p, ignore_errors=True)
        touched.append(p)
    return touched


INSTANCE_SCHEMA = pa.schema([
    ("task", pa.string()), ("subject", pa.string()), ("id", pa.string()),
    ("prediction", pa.string()), ("gold", pa.string()), ("correct", pa.bool_()),
    ("logprobs", pa.list_(pa.float64())), ("is_greedy", pa.list_(pa.bool_())),
    ("metrics", pa.map_(pa.string(), pa.float64())), ("outputs", pa.string()), ("error", pa.string()),
    ("prompt_tokens", pa.int64()), ("cached_tokens", pa.int64()), ("computed_tokens", pa.int64()),
    ("decode_tokens", pa.int64()), ("inputs", pa.string()),
])


def request_schema(with_tokens: bool) -> pa.Schema:
    fields = [("order", pa.int64()), ("wave", pa.int32()), ("instance_id", pa.string()), ("task", pa.string()),
              ("stage", pa.int32()), ("call", pa.string()), ("kind", pa.string()), ("choices", pa.list_(pa.int32())),
              ("prompt_tokens", pa.int64()), ("cached_tokens", pa.int64()), ("computed_tokens", pa.int64()),
              ("decode_tokens", pa.int64())]
    if with_tokens:
        fields.append(("token_ids", pa.list_(pa.int32())))
    return pa.schema(fields)


def sha256(path: Path, spans: list[tuple[int, int]] | None = None) -> str:
    """SHA-256 of a file, or of its byte spans (start, length) in order."""
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for start, n in spans or [(0, -1)]:
            fh.seek(start)
            if n >= 0:
                h.update(fh.read(n))
                continue
            while block := fh.read(1 << 20):
                h.update(block)
    return h.hexdigest()


def file_record(path: Path, rows: int) -> dict:
    """What summary.json and run.json record of a file they vouch for: rows, size and SHA-256."""
    return {"rows": rows, "bytes": path.stat().st_size, "sha256": sha256(path)}
