"""Write a run directory atomically: built beside its final name, renamed into place when complete."""
from __future__ import annotations

import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:     # someone else's process
        return True
    return True


def clean_stale(final: Path) -> list[Path]:
    """What a killed writer of `final` left beside it (its process is gone): a half-written
    `.NAME.partial-PID` is removed; a `.NAME.old-PID` is the previous complete run, renamed back into
    place if the kill came between the two renames, else removed. Returns what it removed/restored."""
    touched = []
    for kind in ("old", "partial"):
        for p in sorted(final.parent.glob(f".{final.name}.{kind}-*")):
            pid = p.name.rsplit("-", 1)[-1]
            if not pid.isdigit() or int(pid) == os.getpid() or _alive(int(pid)):
                continue
            if kind == "old" and not final.exists():
                p.rename(final)
            else:
                shutil.rmtree(p, ignore_errors=True)
            touched.append(p)
    return touched


def _fsync_files(folder: Path) -> None:
    for f in folder.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())


@contextmanager
def atomic_dir(final: Path, overwrite: bool):
    """Yields a temporary directory; on success it replaces `final`, on any error it vanishes. What an
    earlier killed writer left beside `final` is cleaned up first (`clean_stale`)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    clean_stale(final)
    tmp = final.parent / f".{final.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        _fsync_files(tmp)           # the files are on disk before the rename makes them the run
        if final.exists() and overwrite:
            old = final.parent / f".{final.name}.old-{os.getpid()}"
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old)
        else:
            tmp.rename(final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_parquet(path: Path, rows: list[dict], schema: pa.Schema) -> None:
    table = pa.Table.from_pylist(rows, schema=schema)
    pq.write_table(table, path)


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


INSTANCE_SCHEMA = pa.schema([
    ("task", pa.string()), ("subject", pa.string()), ("id", pa.string()),
    ("prediction", pa.string()), ("gold", pa.string()), ("correct", pa.bool_()),
    ("logprobs", pa.list_(pa.float64())), ("is_greedy", pa.list_(pa.bool_())),
    ("metrics", pa.map_(pa.string(), pa.float64())), ("outputs", pa.string()), ("error", pa.string()),
    ("prompt_tokens", pa.int64()), ("cached_tokens", pa.int64()), ("computed_tokens", pa.int64()),
    ("decode_tokens", pa.int64()), ("inputs", pa.string()),
])


def request_schema(with_tokens: bool) -> pa.Schema:
    fields = [("order", pa.int64()), ("wave", pa.int32()), ("instance_id", pa.string()), ("stage", pa.int32()),
              ("call", pa.string()), ("kind", pa.string()), ("choices", pa.list_(pa.int32())),
              ("prompt_tokens", pa.int64()), ("cached_tokens", pa.int64()), ("computed_tokens", pa.int64()),
              ("decode_tokens", pa.int64())]
    if with_tokens:
        fields.append(("token_ids", pa.list_(pa.int32())))
    return pa.schema(fields)
