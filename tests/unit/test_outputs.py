"""The run directory's atomic write and what a killed writer leaves behind (issue 22, item 6)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from lmbatch.outputs import atomic_dir, clean_stale


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
    _run_dir(tmp_path / f".run.partial-{pid}", "half")
    assert len(clean_stale(final)) == 2
    assert (final / "summary.json").read_text() == "previous"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_stale_copies_go_and_a_live_writers_stay(tmp_path):
    final, pid = tmp_path / "run", _dead_pid()
    _run_dir(final, "current")
    _run_dir(tmp_path / f".run.old-{pid}", "older")
    _run_dir(tmp_path / f".run.partial-{pid}", "half")
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        _run_dir(tmp_path / f".run.partial-{live.pid}", "being written")
        with atomic_dir(final, overwrite=True) as tmp:
            (tmp / "summary.json").write_text("new")
        assert (final / "summary.json").read_text() == "new"
        assert sorted(p.name for p in tmp_path.iterdir()) == [f".run.partial-{live.pid}", "run"]
    finally:
        live.kill()


def test_a_failed_write_leaves_the_previous_run(tmp_path):
    final = tmp_path / "run"
    _run_dir(final, "current")
    with pytest.raises(RuntimeError):
        with atomic_dir(final, overwrite=True) as tmp:
            (tmp / "summary.json").write_text("new")
            raise RuntimeError("disk full")
    assert (final / "summary.json").read_text() == "current"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
