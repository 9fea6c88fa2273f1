"""What identifies a model folder wherever results depend on it (a resumed run, the lm-eval score cache):
the content of each of its files, so that weights changed in place (same size, the modification time put
back) are another model.

A file's hash is SHA-256 (one core's throughput: BENCHMARKS.md) over segments of SEGMENT bytes, hashed in parallel
threads (hashlib releases the GIL), then of the segments' digests: `sha256-seg256m:<hex>`. It is kept in
`~/.cache/lmbatch/file-hashes/` under the file's real path, device, inode, size, modification time and
change time (st_ctime_ns): a repeat reads no weights. The change time is what makes the shortcut safe:
every write to a file sets it to now, and, unlike the modification time, `touch`/`os.utime` cannot put it
back; a file rewritten in place is hashed again whatever its size and modification time say. A file that
changes while it is hashed is not kept, nor, as git treats a "racy" index entry, one changed less than
RACY_NS before it was hashed: the kernel's clock for file times ticks coarsely (a few ms), so a write
within the same tick as the hash could leave every time as it was.
"""
from __future__ import annotations

import hashlib
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from lmbatch.cache import atomic_write, cache_dir

SEGMENT = 256 << 20     # bytes of a file one thread hashes
BLOCK = 16 << 20        # bytes read at a time
KIND = "sha256-seg256m"
RACY_NS = 2_000_000_000
KEEP = 1024             # kept hashes (a few bytes each); the least recently written go
# the names of a model folder's weight files, whatever their format: what a key of the folder's other
# files (its tokenizer's, a workload's) leaves out, the weights being large and deciding neither
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".ckpt")


def _stamp(st: os.stat_result) -> tuple[int, ...]:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _entry(path: Path, st: os.stat_result) -> Path:
    key = repr((str(path), *_stamp(st), KIND))
    return cache_dir() / "file-hashes" / hashlib.sha256(key.encode()).hexdigest()[:40]


def _cached(entry: Path) -> str | None:
    try:
        text = entry.read_text().strip()
    except (OSError, ValueError):
        return None
    return text if text.startswith(KIND + ":") else None


def _keep(entry: Path, digest: str) -> None:
    """Writes the entry (atomically; a cache that cannot be written only costs the hash again)."""
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(entry, digest + "\n")
        entries = sorted(entry.parent.iterdir(), key=lambda f: f.stat().st_mtime_ns)
        for old in entries[:-KEEP]:
            old.unlink(missing_ok=True)
    except OSError:
        pass


def _segment(path: Path, start: int, size: int) -> bytes:
    h = hashlib.sha256()
    buf = bytearray(min(BLOCK, max(size, 1)))
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as fh:
        fh.seek(start)
        left = size
        while left > 0:
            n = fh.readinto(view[:min(left, BLOCK)])
            if not n:
                break           # shorter than it was: the stamp check below will not keep this hash
            h.update(view[:n])
            left -= n
    return h.digest()


def hash_files(files: list[Path]) -> dict[Path, str]:
    """Each file's content hash (links followed), from the hash cache where its stamp is there, else
    computed: every segment of every file in one pool of threads."""
    out: dict[Path, str] = {}
    todo: list[tuple[Path, os.stat_result, Path]] = []
    for f in files:
        real = f.resolve()
        st = real.stat()
        entry = _entry(real, st)
        digest = _cached(entry)
        if digest is None:
            todo.append((f, st, entry))
        else:
            out[f] = digest
    jobs = [(f, start, min(SEGMENT, st.st_size - start)) for f, st, _ in todo
            for start in range(0, max(st.st_size, 1), SEGMENT)]
    if not jobs:
        return out
    with ThreadPoolExecutor(max_workers=min(len(jobs), os.cpu_count() or 1, 16)) as pool:
        digests = list(pool.map(lambda job: _segment(*job), jobs))
    for f, st, entry in todo:
        parts = [d for (g, _, _), d in zip(jobs, digests) if g == f]
        total = hashlib.sha256(st.st_size.to_bytes(8, "little") + b"".join(parts))
        out[f] = f"{KIND}:{total.hexdigest()}"
        settled = max(st.st_mtime_ns, st.st_ctime_ns) < time.time_ns() - RACY_NS
        if settled and _stamp(f.resolve().stat()) == _stamp(st):     # and unchanged while it was read
            _keep(entry, out[f])
    return out


def model_identity(model_dir: Path) -> dict[str, Any]:
    """Every file of the model folder (links followed; hidden files aside) by name: its content hash."""
    files = [f for f in sorted(model_dir.iterdir()) if f.is_file() and not f.name.startswith(".")]
    hashes = hash_files(files)
    return {f.name: hashes[f] for f in files}
