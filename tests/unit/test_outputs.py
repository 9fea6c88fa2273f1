"""What a killed writer leaves beside a run directory (issue 22, item 6): the run a killed --overwrite
moved aside comes back, or stays while the run replacing it is incomplete, and goes once that one is complete."""
from __future__ import annotations

import subprocess
import sys

from lmbatch.rundir.place import clean_stale


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _run_dir(path, text):
    path.mkdir()
    (path / "summary.json").write_text(text)


def test_a_kill_between_the_renames_gets_the_previous_run_back(tmp_path):
    final, pid = tmp_path / "run", _dead_pid()
    _run_dir(tmp_path / f".run.old-{pid}", "previous")          # moved aside, the new one never landed
    assert len(clean_stale(final)) == 1
    assert (final / "summary.json").read_text() == "previous"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_stale_copies_go_and_a_live_writers_stay(tmp_path):
    final, pid = tmp_path / "run", _dead_pid()
    _run_dir(final, "current")
    _run_dir(tmp_path / f".run.old-{pid}", "older")
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        _run_dir(tmp_path / f".run.old-{live.pid}", "being replaced")
        assert len(clean_stale(final)) == 1
        assert sorted(p.name for p in tmp_path.iterdir()) == [f".run.old-{live.pid}", "run"]
    finally:
        live.kill()


def test_the_replaced_run_stays_while_its_replacement_is_incomplete(tmp_path):
    final, pid = tmp_path / "run", _dead_pid()
    final.mkdir()
    (final / "INCOMPLETE").write_text("")
    _run_dir(tmp_path / f".run.old-{pid}", "previous")
    assert clean_stale(final) == []
    assert (tmp_path / f".run.old-{pid}" / "summary.json").read_text() == "previous"


def test_a_kill_while_a_run_was_moved_aside_puts_it_back(tmp_path):
    """--overwrite moves a complete run's files aside (summary.json first) into .NAME.old-PID, the run
    directory itself staying (its lock file is in it): a kill midway leaves files on both sides, and
    the next run puts them back before it looks."""
    final, pid = tmp_path / "run", _dead_pid()
    _run_dir(tmp_path / f".run.old-{pid}", "previous")              # moved aside first
    final.mkdir()
    (final / "instances.parquet").write_text("rows")                  # not moved yet
    (final / ".lock").write_text("")
    assert len(clean_stale(final)) == 1
    assert sorted(p.name for p in final.iterdir()) == [".lock", "instances.parquet", "summary.json"]
    assert (final / "summary.json").read_text() == "previous"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
