"""A run directory's place and lock (lmbatch/rundir/place.py, issue 36): one folder directly inside --out,
written by one run at a time, replaced only if it is a run directory."""
from __future__ import annotations

import fcntl
import os
import subprocess
import sys

import pytest

from lmbatch.errors import UserError
from lmbatch.options import RUN_ID_MAX, run_id_problem
from lmbatch.rundir.place import LOCK, RunLock, clear, found, move_aside, refuse_foreign, run_path


@pytest.mark.parametrize("name,problem", [
    ("", "is empty"), (" ", "is empty"), (".", "a place"), ("..", "a place"), ("../x", "climbs out"),
    ("a/..", "climbs out"), ("a/b", "path separator"), ("a\\b", "path separator"), ("/abs", "absolute"),
    ("\\\\server\\share", "absolute"), ("C:x", "absolute"), ("a\tb", "control character"),
    ("a\u200bb", "control character"), (".x", "starts with '.'"), ("x" * (RUN_ID_MAX + 1), "bytes long"),
    ("é" * 101, "202 bytes long"),
])
def test_run_id_rules(name, problem):
    assert problem in (run_id_problem(name) or "")


@pytest.mark.parametrize("name", ["mmlu-5shot-SmolLM2-135M-Instruct-20261125-120000", "a.b", "run 1", "ü",
                                  "x" * RUN_ID_MAX, "-x"])
def test_fit_run_ids(name):
    assert run_id_problem(name) is None


def test_the_lock_refuses_a_second_holder_and_goes_with_the_run(tmp_path):
    d = tmp_path / "run"
    first = RunLock(d).acquire()
    assert (d / LOCK).read_text() == f"{os.getpid()}\n"
    with pytest.raises(UserError, match=f"run directory {d} is in use by another run \\(process {os.getpid()}\\)"):
        RunLock(d).acquire()
    first.release()
    assert not d.exists()               # made by the lock, nothing written into it: it goes
    d.mkdir()
    (d / "kept").write_text("x")
    again = RunLock(d).acquire()
    again.release()
    assert sorted(p.name for p in d.iterdir()) == ["kept"]


def test_a_killed_holders_lock_is_free(tmp_path):
    d = tmp_path / "run"
    code = ("import sys, os\nfrom pathlib import Path\nfrom lmbatch.rundir.place import RunLock\n"
            "RunLock(Path(sys.argv[1])).acquire()\nos._exit(9)\n")
    subprocess.run([sys.executable, "-c", code, str(d)], check=False)
    assert (d / LOCK).is_file()         # left behind by the kill, but no longer held
    RunLock(d).acquire().release()


def test_a_lock_file_replaced_meanwhile_is_not_a_lock(tmp_path):
    """A run ending removes its lock file while still holding it: a run that opened the old file then
    takes the lock on a file that is gone, and must take the new one instead."""
    d = tmp_path / "run"
    d.mkdir()
    old = os.open(d / LOCK, os.O_RDWR | os.O_CREAT)
    (d / LOCK).unlink()
    lock = RunLock(d)
    assert lock._take(old) is None      # closed: it was not the file at the path
    lock.acquire()
    other = os.open(d / LOCK, os.O_RDWR)
    with pytest.raises(BlockingIOError):
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.close(other)
    lock.release()


def test_run_path_refuses_links_and_files(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "link").symlink_to(tmp_path)
    with pytest.raises(UserError, match="symbolic link"):
        run_path(out, "link")
    (out / "f").write_text("")
    with pytest.raises(UserError, match="is a file"):
        run_path(out, "f")
    assert run_path(out, "new") == out / "new" and not (out / "new").exists()


def test_only_a_run_directory_is_replaced(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    (d / LOCK).write_text("")
    assert found(d).empty
    (d / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="is not an lmbatch run directory"):
        refuse_foreign(d, found(d), overwrite=True)
    (d / "summary.json").write_text('{"run_id": "d", "task": "mmlu"}')
    assert found(d).complete
    refuse_foreign(d, found(d), overwrite=False)        # resumed or refused as it is: nothing replaced
    with pytest.raises(UserError, match="holds notes.txt, which no lmbatch run writes"):
        refuse_foreign(d, found(d), overwrite=True, replacing=True)
    (d / "INCOMPLETE").write_text("")
    clear(d)                                            # what no run writes is never removed
    assert sorted(p.name for p in d.iterdir()) == [LOCK, "notes.txt"]
    (d / "notes.txt").unlink()
    (d / "summary.json").write_text('{"not": "a summary"}')
    assert not found(d).is_run
    (d / "summary.json").write_text('{"run_id": "d", "task": "mmlu"}')
    (d / ".instances.parquet.tmp").write_text("")      # a killed write's leftover is the run's
    refuse_foreign(d, found(d), overwrite=True, replacing=True)
    aside = move_aside(d)
    assert sorted(p.name for p in d.iterdir()) == [LOCK]
    assert sorted(p.name for p in aside.iterdir()) == [".instances.parquet.tmp", "summary.json"]
