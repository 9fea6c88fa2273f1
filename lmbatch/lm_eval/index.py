"""lm-eval's task index ({name: Entry} from every task file of its folders, `TaskIndex.build`), kept in
lmbatch's cache per folder and, for lm-eval's own folder, made ahead in a process of its own.

Building the index parses every task file (14k for lm-eval's own folder: 6-7 s of one core on a GPU
host or this project's CPU, more where lm-eval's modules compile from source), and lm-eval builds it
on the main thread before anything else of a run. `lmbatch lm-eval` keeps each folder's part
(`stored_index`) under what decides it, and when lm-eval's own folder has no entry yet, the command
line starts a process that builds it (`build_ahead`) before lmbatch imports anything heavy; the run
waits for that process where it needs the index, after its own imports.

An index over several folders is the folders' parts merged in order, a later folder's entry replacing
an earlier one's (with lm-eval's warning), as `TaskIndex.build` merges them: a folder's part depends
on that folder's files only.

    python -m lmbatch.lm_eval.index FOLDER      # the part of one folder into the cache (as `build_ahead`)
"""
from __future__ import annotations

import atexit
import hashlib
import logging
import pickle
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, Callable

from lmbatch.cache import atomic_write, cache_dir

_INCLUDE = re.compile(r"^include:\s*['\"]?([^'\"#\n]+?)['\"]?\s*$", re.M)
_AHEAD: dict[Path, subprocess.Popen[bytes]] = {}    # entry -> the process building it
KEEP = 8                                            # entries kept; the least recently written go


def _own_tasks() -> Path:
    import lm_eval

    return Path(lm_eval.__file__).parent / "tasks"


def entry_path(root: Path, resolve_includes: bool) -> Path:
    """The cache entry of one folder's part: named by lm-eval's version (its own folder is part of the
    installed package) and, for any other folder, every task file's path, size and modification time,
    and those of the files they include from elsewhere."""
    import lm_eval

    own_tasks = _own_tasks().resolve()
    h = hashlib.sha256(f"{lm_eval.__version__}\0{resolve_includes}\0root {root}".encode())
    if root.resolve() != own_tasks:
        for f in sorted(root.glob("**/*.yaml")):
            st = f.stat()
            h.update(f"\0{f}:{st.st_size}:{st.st_mtime_ns}".encode())
            for inc in _INCLUDE.findall(f.read_text(errors="replace")):
                target = (f.parent / inc.strip()).resolve()
                if target.is_file() and own_tasks not in target.parents:
                    t = target.stat()
                    h.update(f"\0{target}:{t.st_size}:{t.st_mtime_ns}".encode())
    return cache_dir() / "lm_eval" / f"index-{h.hexdigest()[:32]}.pkl"


def build_ahead() -> bool:
    """Starts a process that builds lm-eval's own folder's part into the cache, unless the cache has it
    (or lm-eval is not there). Returns whether one was started. The process is ended with this one
    if it is still at work then."""
    try:
        root = _own_tasks()
        path = entry_path(root, True)
    except Exception:  # noqa: BLE001  lm-eval missing or unreadable: lm-eval's own run says what is wrong
        return False
    if path.is_file() or path in _AHEAD:
        return False
    proc = subprocess.Popen([sys.executable, "-m", "lmbatch.lm_eval.index", str(root)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _AHEAD[path] = proc
    atexit.register(_end, proc)
    return True


def _end(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
        with suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)


def end_ahead() -> None:
    """Ends what `build_ahead` started and no run waited for (the command is over: an error before
    lm-eval needed its index), so that nothing goes on working after the command that started it."""
    for path in list(_AHEAD):
        _end(_AHEAD.pop(path))


def building() -> bool:
    """A process started by `build_ahead` is still at work."""
    return any(p.poll() is None for p in _AHEAD.values())


def stored_index(root: Path, resolve_includes: bool, build: Callable[[], Any]) -> Any:
    """One folder's part: the cache's entry (waiting for the process building it, if one is), else
    `build()`, kept there. An entry that cannot be read back whole is built again."""
    path = entry_path(root, resolve_includes)
    proc = _AHEAD.pop(path, None)
    if proc is not None:
        proc.wait()
    try:
        with open(path, "rb") as fh:
            return pickle.load(fh)
    except Exception:  # noqa: BLE001  absent, or not whole: built again
        pass
    index = build()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda tmp: _pickle_to(tmp, index))
        for old in sorted(path.parent.glob("index-*.pkl"), key=lambda f: f.stat().st_mtime)[:-KEEP]:
            old.unlink(missing_ok=True)
        for stale in path.parent.glob(".index-*.tmp"):     # a build ended while it wrote (`end_ahead`)
            if time.time() - stale.stat().st_mtime > 3600:
                stale.unlink(missing_ok=True)
    except (OSError, pickle.PicklingError, TypeError, AttributeError):     # not writable, or not picklable
        pass
    return index


def _pickle_to(path: Path, obj: Any) -> None:
    with open(path, "wb") as fh:
        pickle.dump(obj, fh, protocol=pickle.HIGHEST_PROTOCOL)


@contextmanager
def index_built_once() -> Iterator[Callable[[], None]]:
    """While in the context, lm-eval's `TaskIndex.build` merges the folders' parts (`stored_index`); and
    the index is made once for lmbatch's checks and lm-eval both: an index built until the context's
    value is called is kept, and the next build over the same folders takes it instead of reading them
    again (once: lm-eval's own later use is left to itself)."""
    from lm_eval.tasks._index import TaskIndex
    from lm_eval.tasks._index import log as lm_eval_log

    own = TaskIndex.__dict__["build"]
    kept: dict[tuple[tuple[str, ...], bool], Any] = {}
    recording = [True]

    def build(roots: Any, *, resolve_includes: bool = True) -> Any:
        roots = [Path(r) for r in roots]
        key = (tuple(str(r) for r in roots), resolve_includes)
        if not recording[0] and key in kept:
            return kept.pop(key)
        index: dict[str, Any] = {}
        for root in roots:
            part = stored_index(root, resolve_includes,
                                lambda: own.__func__([root], resolve_includes=resolve_includes))
            for name, entry in part.items():       # as TaskIndex.build merges its folders
                if name in index:
                    lm_eval_log.warning("Task '%s' from %s overrides existing task from %s", name,
                                        entry.yaml_path, index[name].yaml_path)
                index[name] = entry
        if recording[0]:
            kept[key] = index
        return index

    TaskIndex.build = staticmethod(build)
    try:
        yield lambda: recording.__setitem__(0, False)
    finally:
        TaskIndex.build = own


if __name__ == "__main__":
    logging.disable(logging.CRITICAL)
    from lm_eval.tasks._index import TaskIndex

    folder = Path(sys.argv[1])
    stored_index(folder, True, lambda: TaskIndex.build([folder], resolve_includes=True))
