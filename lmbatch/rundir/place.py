"""Where a run directory is, who writes it, and what it may replace (docs/outputs.md): `claim` takes it for
a run (its place checked, locked, a killed writer's leftovers cleaned, what it holds read).

A run directory is `--out/RUN_ID`, one folder name (options.run_id_problem), and never anything but that
folder: its path is checked to resolve directly under --out before anything is created. A run holds an
exclusive lock on it (`RunLock`, flock on `RUN/.lock`) from before it looks at what is there to its end,
so a second run on the same directory is refused in one line instead of racing the first. `--overwrite`
replaces only an lmbatch run directory (`Found`): its own files, nothing else.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from lmbatch.errors import UserError
from lmbatch.rundir.layout import LOCK, MARKER, PARTS, RUN_FILES, RUN_JSON, SUMMARY, aside, asides, is_temporary
from lmbatch.rundir.records import names_a_run


def check_out(out: Path) -> None:
    """The parent of run directories can take one, before any work: the results are written last."""
    import tempfile

    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file, not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".lmbatch-probe-"):
            pass
    except OSError as e:
        raise UserError(f"--out {out} is not writable: {e.strerror or e}") from None


def run_path(out: Path, name: str) -> Path:
    """`out / name`, checked to be a folder of its own directly inside --out (`name` is one folder name
    already): not a symbolic link to elsewhere; then --out is made if need be."""
    base = out.resolve()
    path = out / name
    if path.is_symlink() or (base / name).resolve().parent != base:
        raise UserError(f"run directory {path} is a symbolic link (to {os.readlink(path)}): lmbatch writes only "
                        "a folder of its own inside --out; pass another --run-id")
    if path.exists() and not path.is_dir():
        raise UserError(f"run directory {path} is a file, not a folder: pass another --run-id")
    check_out(out)
    return path


class RunLock:
    """An exclusive lock on a run directory (flock on its `.lock`), taken before the run looks at what
    the directory holds and held to the run's end. A second run is refused at once, in one line (its
    directory is another run's while that one writes it). The file goes when the lock is released (a
    killed run leaves it: the kernel releases the lock, and the next run takes it); a folder this lock
    made goes too if nothing else was written into it."""

    def __init__(self, path: Path):
        self.path, self.file = path, path / LOCK
        self.created = False
        self.fd: int | None = None

    def acquire(self) -> RunLock:
        while self.fd is None:
            try:
                self.path.mkdir()
                self.created = True
            except FileExistsError:
                pass
            except OSError as e:
                raise UserError(f"cannot make the run directory {self.path}: {e.strerror or e}") from None
            try:
                fd = os.open(self.file, os.O_RDWR | os.O_CREAT, 0o644)
            except FileNotFoundError:       # the folder went meanwhile (a run that wrote nothing ended)
                continue
            except OSError as e:
                raise UserError(f"cannot write in the run directory {self.path}: {e.strerror or e}") from None
            self.fd = self._take(fd)
        os.ftruncate(self.fd, 0)
        os.write(self.fd, f"{os.getpid()}\n".encode())
        return self

    def _take(self, fd: int) -> int | None:
        """fd, locked; None if the file was replaced before the lock came (its holder ended and removed
        it): then the one now at the path is tried."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            raise UserError(f"run directory {self.path} is in use by another run"
                            + (f" (process {holder})" if holder.isdigit() else "")
                            + ": wait for it to end, or pass another --run-id") from None
        mine = os.fstat(fd)
        try:
            there = os.stat(self.file)
        except FileNotFoundError:
            there = None
        if there is None or (there.st_dev, there.st_ino) != (mine.st_dev, mine.st_ino):
            os.close(fd)
            return None
        return fd

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            self.file.unlink(missing_ok=True)       # while still held: a waiting run then takes a new file
            if self.created:
                self.path.rmdir()                   # only if this run wrote nothing into it
        except OSError:
            pass
        os.close(self.fd)
        self.fd = None


@dataclass
class Found:
    """What an existing run directory holds: nothing, an incomplete run, a complete one, or something
    that is not lmbatch's (`foreign`: the entries no run writes)."""
    empty: bool
    incomplete: bool        # the INCOMPLETE marker or run.json: a run that has not completed
    complete: bool          # summary.json of a run (with its run_id and task)
    foreign: list[str]

    @property
    def is_run(self) -> bool:
        return self.incomplete or self.complete


def _is_summary(f: Path) -> bool:
    try:
        data = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return names_a_run(data)


def _runs(name: str) -> bool:
    """Whether a run writes an entry of this name into its directory."""
    return name in RUN_FILES or is_temporary(name)


def found(path: Path) -> Found:
    """What `path` holds, its lock file aside."""
    names = sorted(p.name for p in path.iterdir()) if path.is_dir() else []
    names = [n for n in names if n != LOCK]
    foreign = [n for n in names if not _runs(n)]
    return Found(not names, (path / MARKER).is_file() or (path / RUN_JSON).is_file(),
                 (path / SUMMARY).is_file() and _is_summary(path / SUMMARY), foreign)


def refuse_foreign(path: Path, there: Found, overwrite: bool, replacing: bool = False) -> None:
    """A run goes only into an empty folder or a run directory; one it replaces (`replacing`) holds
    nothing but a run's files."""
    if there.empty:
        return
    if not there.is_run:
        shown = ", ".join(there.foreign[:3]) + (", ..." if len(there.foreign) > 3 else "")
        raise UserError(f"output directory {path} exists and is not an lmbatch run directory (it holds {shown}; no "
                        f"summary.json of a run, no {MARKER}): " + ("--overwrite replaces only run directories; "
                                                                    if overwrite else "")
                        + "pass another --run-id")
    if replacing and there.foreign:
        raise UserError(f"run directory {path} holds {there.foreign[0]}, which no lmbatch run writes: move it out "
                        "before the run is replaced, or pass another --run-id")


def clear(path: Path) -> None:
    """Remove a run's files from its directory (an incomplete run replaced), its lock file aside; what
    no run writes stays."""
    for p in path.iterdir():
        if p.name == LOCK or not _runs(p.name):
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()


def move_aside(path: Path) -> Path:
    """Move a complete run's files into `.NAME.old-PID` beside it, summary.json first (a run directory
    without it is no complete run: a kill midway is undone by `clean_stale`), its lock file and
    what no run writes aside; kept until the run replacing it completes."""
    kept = aside(path, os.getpid())
    kept.mkdir(exist_ok=True)
    names = sorted((p.name for p in path.iterdir() if p.name != LOCK and _runs(p.name)),
                   key=lambda n: n != SUMMARY)
    for name in names:
        (path / name).rename(kept / name)
    return kept


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
    for p, pid in asides(final):
        if pid is None or pid == os.getpid() or _alive(pid):
            continue
        if not final.exists():
            p.rename(final)
        elif not (final / SUMMARY).is_file() and not (final / MARKER).is_file():
            for f in sorted(p.iterdir()):
                if not (final / f.name).exists():
                    f.rename(final / f.name)
            shutil.rmtree(p, ignore_errors=True)
        elif (final / MARKER).is_file():
            continue            # the run a killed --overwrite replaces: kept until that one completes
        else:
            shutil.rmtree(p, ignore_errors=True)
        touched.append(p)
    return touched


def clean_up(path: Path) -> None:
    """What a complete run no longer needs: its parts, run.json, the marker, and the run it replaced."""
    shutil.rmtree(path / PARTS, ignore_errors=True)
    (path / RUN_JSON).unlink(missing_ok=True)
    (path / MARKER).unlink(missing_ok=True)
    for old, _ in asides(path):
        shutil.rmtree(old, ignore_errors=True)


@dataclass
class Claim:
    """A run directory taken for a run: its path, the lock held on it, and what it held then."""
    path: Path
    lock: RunLock
    there: Found

    def release(self) -> None:
        self.lock.release()


def claim(out: Path, name: str, overwrite: bool) -> Claim:
    """`out/name` for a run: its place checked (`run_path`), locked (`RunLock`), what a killed
    `--overwrite` left beside it cleaned (`clean_stale`) and what it holds read (`found`): a folder that is
    no run directory is refused, and so is a complete run without `--overwrite`."""
    path = run_path(out, name)
    lock = RunLock(path).acquire()
    try:
        clean_stale(path)
        there = found(path)
        refuse_foreign(path, there, overwrite)
        if not there.empty and not there.incomplete and not overwrite:
            raise UserError(f"output directory {path} exists; pass --overwrite to replace it or --run-id to name "
                            "another")
    except BaseException:
        lock.release()
        raise
    return Claim(path, lock, there)
