"""Where lmbatch keeps what it can make again: converted models, workloads, lm-eval's task index, and
the bytecode of the modules a command imports where Python is told not to write any beside them; and
how lmbatch writes a file that a reader sees whole or not at all, in its caches and run directories alike
(`atomic_write`; durable: `write_json`, `write_table`, `fsync_dir`).
Imports nothing beyond the standard library (pyarrow when a table is written): the command line calls
`keep_bytecode` before its imports."""
from __future__ import annotations

import _imp
import importlib.machinery
import importlib.util
import json
import marshal
import os
import sys
from pathlib import Path
from types import CodeType
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    import pyarrow as pa

CHILDREN = "LMBATCH_KEEP_BYTECODE"      # set by `keep_bytecode`, for the processes the command starts


def cache_dir() -> Path:
    """$LMBATCH_CACHE, else $XDG_CACHE_HOME/lmbatch, else ~/.cache/lmbatch."""
    if os.environ.get("LMBATCH_CACHE"):
        return Path(os.environ["LMBATCH_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "lmbatch"


def temporary_name(path: Path) -> Path:
    """Where `atomic_write` writes `path` first: `.NAME.PID.tmp` beside it. Whoever cleans up what a killed
    writer left matches `.NAME.*.tmp` (a run directory: any `.*.tmp`)."""
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def atomic_write(path: Path, content: bytes | str | Callable[[Path], None], sync: bool = False) -> None:
    """`content` (bytes, text as UTF-8, or `content(tmp)` writing the file itself) written to
    `temporary_name(path)`, fsynced if `sync`, then renamed over `path`: a reader sees the whole file or
    none. On an error (a full disk, a folder that cannot be written) the temporary file goes and the
    error is raised; a kill leaves it, for its owner's cleanup."""
    tmp = temporary_name(path)
    try:
        if callable(content):
            content(tmp)
        else:
            tmp.write_bytes(content.encode() if isinstance(content, str) else content)
        if sync:
            with open(tmp, "rb") as fh:
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:         # its folder does not exist (LMBATCH_CACHE under a file, say)
            pass
        raise


def fsync_dir(path: Path) -> None:
    """The folder's entries (a rename into it) on disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: Path, data: dict[str, Any]) -> None:
    """`data` as indented JSON, written atomically and fsynced."""
    atomic_write(path, json.dumps(data, indent=2) + "\n", sync=True)


def write_table(path: Path, table: pa.Table) -> None:
    """A Parquet file, written atomically and fsynced."""
    import pyarrow.parquet as pq

    atomic_write(path, lambda tmp: pq.write_table(table, tmp), sync=True)


def keep_bytecode() -> str | None:
    """Where Python writes no bytecode (PYTHONDONTWRITEBYTECODE=1 or -B, as in many container images) and
    no other place is set for it (PYTHONPYCACHEPREFIX), every process compiles each module it imports
    that has no bytecode beside it (torch, numpy and datasets on the GPU host) from source again. There the
    command keeps that bytecode in lmbatch's cache (`pycache/`, a tree beside nothing the user installed),
    and processes it starts read it too; bytecode that is installed beside its source is still read there
    (`_InstalledFirst`), where a bare prefix would hide it. Importing torch, transformers, pandas, datasets
    and lm-eval's evaluator (H100 host, 2026-11-26): 6.8-7.9 s as Python is, 3.8-4.7 s so (7.2 s while
    the cache is new); with a bare prefix 5.0-5.3 s, 11.8 s new. LMBATCH_PYCACHE=0 leaves Python as it is.
    Returns the folder used, or None."""
    if not sys.dont_write_bytecode or sys.pycache_prefix or os.environ.get("LMBATCH_PYCACHE", "1") == "0":
        return None
    folder = cache_dir() / "pycache"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:         # a read-only home: Python goes on as it was told
        return None
    if not os.access(folder, os.W_OK):
        return None
    sys.pycache_prefix = str(folder)
    sys.dont_write_bytecode = False
    _read_installed_bytecode_first()
    # the processes the command starts (data-parallel workers, lm-eval's index builder) do the same as
    # soon as they import lmbatch (lmbatch/__init__.py); PYTHONPYCACHEPREFIX would hide their installed bytecode
    os.environ[CHILDREN] = "1"
    return str(folder)


class _InstalledFirst(importlib.machinery.SourceFileLoader):
    """A source file's loader that takes the bytecode beside it (`__pycache__/`, as installers write it)
    where that is current, and otherwise reads and writes it where Python's prefix says (lmbatch's cache).
    A prefix alone would hide the installed bytecode: every module compiled again on a new cache."""

    def get_code(self, fullname: str) -> CodeType | None:
        source = self.get_filename(fullname)
        code = _installed_bytecode(source)
        return code if code is not None else super().get_code(fullname)


def _installed_bytecode(source: str) -> CodeType | None:
    """The code in `source`'s installed bytecode file, if it is there and current as Python checks it (a
    timestamp file's source modification time and size; a checked hash file's source hash), else None."""
    head, tail = os.path.split(source)
    stem, ext = os.path.splitext(tail)
    if ext != ".py" or sys.implementation.cache_tag is None:
        return None
    try:
        with open(os.path.join(head, "__pycache__", f"{stem}.{sys.implementation.cache_tag}.pyc"), "rb") as f:
            data = f.read()
        if len(data) < 16 or data[:4] != importlib.util.MAGIC_NUMBER:
            return None
        flags = int.from_bytes(data[4:8], "little")
        if flags & ~0b11:
            return None
        if flags & 0b01:        # hash-based: checked ones against the source, unchecked ones trusted
            if flags & 0b10:
                with open(source, "rb") as f:
                    if importlib.util.source_hash(f.read()) != data[8:16]:
                        return None
        else:
            st = os.stat(source)
            if int.from_bytes(data[8:12], "little") != int(st.st_mtime) & 0xFFFFFFFF or \
                    int.from_bytes(data[12:16], "little") != st.st_size & 0xFFFFFFFF:
                return None
        code = marshal.loads(memoryview(data)[16:])
    except (OSError, ValueError, EOFError, TypeError):
        return None
    if not isinstance(code, CodeType):
        return None
    fix = getattr(_imp, "_fix_co_filename", None)      # as Python's own loader does: tracebacks name this file
    if fix is not None:
        fix(code, source)
    return code


def _read_installed_bytecode_first() -> None:
    """Source files on sys.path load through `_InstalledFirst` from here on (the path hook that makes file
    finders is replaced by one that makes them with it; finders already made are dropped)."""
    loaders = [(importlib.machinery.ExtensionFileLoader, importlib.machinery.EXTENSION_SUFFIXES),
               (_InstalledFirst, importlib.machinery.SOURCE_SUFFIXES),
               (importlib.machinery.SourcelessFileLoader, importlib.machinery.BYTECODE_SUFFIXES)]
    for i, hook in enumerate(sys.path_hooks):
        if "FileFinder" in getattr(hook, "__qualname__", ""):
            sys.path_hooks[i] = importlib.machinery.FileFinder.path_hook(*loaders)
            sys.path_importer_cache.clear()
            return
