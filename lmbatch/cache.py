"""Where lmbatch keeps what it can make again: converted models, workloads, lm-eval's task index, and
the bytecode of the modules a command imports where Python is told not to write any beside them.
Imports nothing beyond the standard library: the command line calls `keep_bytecode` before its imports."""
from __future__ import annotations

import os
import sys
from pathlib import Path


def cache_dir() -> Path:
    """$LMBATCH_CACHE, else $XDG_CACHE_HOME/lmbatch, else ~/.cache/lmbatch."""
    if os.environ.get("LMBATCH_CACHE"):
        return Path(os.environ["LMBATCH_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "lmbatch"


def keep_bytecode() -> str | None:
    """Where Python writes no bytecode (PYTHONDONTWRITEBYTECODE=1 or -B, as in many container images) and
    no other place is set for it (PYTHONPYCACHEPREFIX), every process compiles each module it imports
    from source again: torch, transformers and lm-eval's about 8 s of a command (H100 host, 2026-11-26).
    There the command keeps that bytecode in lmbatch's cache instead (`pycache/`, a tree beside nothing
    the user installed), and processes it starts read it too. LMBATCH_PYCACHE=0 leaves Python as it is.
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
    os.environ["PYTHONPYCACHEPREFIX"] = str(folder)     # workers read it (they write none: still told not to)
    return str(folder)
