"""Nothing lost (issue 22): a run writes its finished instances as parts while it executes, and
re-running the same command resumes an incomplete run; kills (SIGKILL, at any file operation),
Ctrl-C, a full disk, a damaged part and changed settings each leave whole parts and one line.

The references are uninterrupted runs of the same command; a resumed run must give every instance
exactly once, with the same predictions, logprobs and generated text."""
from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time

import pyarrow.parquet as pq
import pytest
from conftest import make_tiny_with_tokenizer, scale_in_place, wide_tiny
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmbatch.errors import UserError
from lmbatch.options import RunOptions
from lmbatch.run.run import run
from lmbatch.rundir import rundir as rd

# two stages: a sampled gen (its seed is the instance's, not its place in a resumed batch), then a select
PROGRAM = '''from lmbatch.frontend import gen, select

def instances():
    return [{"id": f"q{k}", "n": k} for k in range(12)]

def program(s, n):
    s += f"Question {n}: what comes after {n}?"
    s += gen("thought", max_tokens=6, temperature=0.9)
    s += " So the answer is" + select("answer", [" one", " two", " three"])
'''


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_with_tokenizer(tmp_path_factory.mktemp("tiny"), 2048)


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    path = tmp_path_factory.mktemp("prog") / "two_stage.py"
    path.write_text(PROGRAM)
    return path


def _options(task, model, out, run_id, **kw):
    base = dict(model=str(model), out=out, run_id=run_id, device="cpu", quiet=True, checkpoint_s=1e-6,
                max_tokens_per_batch=64)
    if task == "mmlu":
        base.update(shots=1, limit=2, subjects=["anatomy", "virology", "astronomy"])
    return RunOptions.of(task=str(task), **{**base, **kw})


def _instances(d):
    return pq.read_table(d / "instances.parquet").to_pylist()


def _same_results(got, want):
    assert [r["id"] for r in got] == [r["id"] for r in want]          # each instance once, in task order
    for a, b in zip(got, want):
        assert (a["prediction"], a["error"]) == (b["prediction"], b["error"]), a["id"]
        assert json.loads(a["outputs"]) == json.loads(b["outputs"]), a["id"]
        assert a["logprobs"] == pytest.approx(b["logprobs"], abs=1e-4), a["id"]


@pytest.fixture(scope="module")
def reference(tiny, program, tmp_path_factory):
    """Uninterrupted runs, and the file operations each made (the points a kill can hit)."""
    out = tmp_path_factory.mktemp("ref")
    refs = {}
    for name, task in (("mmlu", "mmlu"), ("program", program)):
        steps: list[str] = []
        rd.fault = steps.append
        try:
            d = run(_options(task, tiny, out, name))
        finally:
            rd.fault = None
        summary = json.loads((d / "summary.json").read_text())
        assert steps.count("part instances") >= 3, steps          # several parts
        refs[name] = (task, _instances(d), summary, steps)
    return refs


class _Kill(BaseException):
    """Leaves the directory as a kill at that moment would (no cleanup runs for it)."""


def _killed(options, when):
    """Run `options`, killed at the first file operation for which `when(steps so far)` holds; the steps."""
    calls: list[str] = []

    def kill(step):
        calls.append(step)
        if when(calls):
            raise _Kill(step)
    rd.fault = kill
    try:
        with pytest.raises(_Kill):
            run(options)
    finally:
        rd.fault = None
    return calls


@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_a_kill_at_any_file_operation_then_resume(reference, tiny, tmp_path_factory, data):
    name = data.draw(st.sampled_from(["mmlu", "program"]))
    task, want, want_summary, steps = reference[name]
    at = data.draw(st.integers(0, len(steps) - 1))
    out = tmp_path_factory.mktemp("kill")
    _killed(_options(task, tiny, out, "r"), lambda calls: len(calls) > at)
    if steps[at] == "cleanup":      # complete (summary.json written): what it no longer needs goes
        with pytest.raises(UserError, match="exists; pass --overwrite"):
            run(_options(task, tiny, out, "r"))
        d = out / "r"
    else:
        d = run(_options(task, tiny, out, "r"))
    got = json.loads((d / "summary.json").read_text())
    _same_results(_instances(d), want)
    whole_parts = steps[:at].count("part instances")       # renamed into place before the kill
    resumed = got["counts"]["resumed_instances"]
    assert (resumed > 0) == (whole_parts > 0 and steps[at] != "cleanup"), (at, steps[at], resumed)
    assert got["counts"]["instances"] == want_summary["counts"]["instances"]
    assert got["accuracy"] == pytest.approx(want_summary["accuracy"])
    assert sorted(p.name for p in d.iterdir()) == ["instances.parquet", "requests.parquet", "summary.json"]
    assert [p.name for p in out.iterdir()] == ["r"]                # nothing beside it either
    reqs = pq.read_table(d / "requests.parquet").to_pylist()
    assert {r["instance_id"] for r in reqs} == {r["id"] for r in want}
    assert sum(r["prompt_tokens"] for r in reqs) >= got["tokens"]["prompt"]


def _cli(*args, **kw):
    return subprocess.Popen([sys.executable, "-c", "from lmbatch.cli import main; main()", *map(str, args)],
                            stderr=subprocess.PIPE, text=True, **kw)


HOOKED = ("import sys, time\nfrom lmbatch.rundir import rundir\nn = [0]\n"
          "def hook(step):\n"
          "    if step == 'run.json':\n"
          "        n[0] += 1\n"
          "        if n[0] == 2:\n"
          "            time.sleep(1000)          # killed here: part 2 whole, run.json not told\n"
          "rundir.fault = hook\n"
          "from lmbatch.cli import main\nsys.argv = ['lmbatch'] + sys.argv[1:]\nmain()\n")


def _wait_for_parts(d, n, proc, timeout=120):
    t = time.time()
    while len(list((d / "parts").glob("*.instances.parquet"))) < n if (d / "parts").is_dir() else True:
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        assert time.time() - t < timeout
        time.sleep(0.05)


def test_sigkill_then_the_same_command_resumes(reference, tiny, tmp_path):
    task, want, _, _ = reference["mmlu"]
    args = ["run", "mmlu", "--shots", 1, "--limit", 2, "--subjects", "anatomy", "--subjects", "virology",
            "--subjects", "astronomy", "--model", tiny, "--out", tmp_path, "--run-id", "k", "--device", "cpu",
            "--quiet", "--checkpoint-s", 1e-6, "--max-tokens-per-batch", 64]
    proc = subprocess.Popen([sys.executable, "-c", HOOKED, *map(str, args)], stderr=subprocess.PIPE, text=True)
    d = tmp_path / "k"
    _wait_for_parts(d, 2, proc)
    time.sleep(0.2)
    proc.kill()
    proc.wait()
    assert (d / "INCOMPLETE").is_file() and not (d / "summary.json").exists()
    r = _cli(*args)
    _, err = r.communicate(timeout=300)
    assert r.returncode == 0, err
    s = json.loads((d / "summary.json").read_text())
    _same_results(_instances(d), want)
    assert s["counts"]["resumed_instances"] >= 2 and len(s["attempts"]) == 2
    assert s["attempts"][0]["instances"] + s["attempts"][1]["instances"] == s["counts"]["instances"] or \
        s["attempts"][0]["instances"] < s["counts"]["resumed_instances"]      # part 2 was not in run.json yet


def test_sigint_keeps_the_finished_instances_and_says_so(reference, tiny, tmp_path):
    """The first Ctrl-C stops at the next handover: one line, exit 130, the finished instances in whole
    parts; the same command then finishes the run with the same results."""
    _, want, _, _ = reference["mmlu"]
    args = ["run", "mmlu", "--shots", 1, "--limit", 2, "--subjects", "anatomy", "--subjects", "virology",
            "--subjects", "astronomy", "--model", tiny, "--out", tmp_path, "--run-id", "i", "--device", "cpu",
            "--quiet", "--checkpoint-s", 1e-6, "--max-tokens-per-batch", 64]
    slow = ("import sys, time\nfrom lmbatch.rundir import rundir\n"
            "rundir.fault = lambda step: time.sleep(0.5) if step == 'part requests' else None\n"
            "from lmbatch.cli import main\nsys.argv = ['lmbatch'] + sys.argv[1:]\nmain()\n")
    proc = subprocess.Popen([sys.executable, "-c", slow, *map(str, args)], stderr=subprocess.PIPE, text=True)
    d = tmp_path / "i"
    _wait_for_parts(d, 1, proc)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("interrupted: ") and "of 6 instances kept; re-run the same command to resume" in last
    kept = int(last.split()[1])
    assert 1 <= kept < 6
    assert sum(pq.ParquetFile(f).metadata.num_rows for f in (d / "parts").glob("*.instances.parquet")) == kept
    r = _cli(*args)
    _, err = r.communicate(timeout=300)
    assert r.returncode == 0, err
    _same_results(_instances(d), want)
    assert json.loads((d / "summary.json").read_text())["counts"]["resumed_instances"] == kept


def _incomplete(tiny, out, run_id="x", task="mmlu", **kw):
    """An incomplete run directory: killed after its second part."""
    _killed(_options(task, tiny, out, run_id, **kw), lambda calls: calls.count("run.json") == 2)
    return out / run_id


def _listing(d):
    return {p.relative_to(d): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def _edit_config(d):
    cfg = json.loads((d / "config.json").read_text())
    cfg["rms_norm_eps"] = cfg.get("rms_norm_eps", 1e-6) * 2
    (d / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("change,needle", [
    (dict(shots=0), "shots"),
    (dict(limit=1), "limit"),
    (dict(seed=1), "seed"),
    ("model", "model.config.json"),
    (dict(dtype="bfloat16"), "--dtype float32"),
])
def test_other_settings_are_refused_and_touch_nothing(tiny, tmp_path, change, needle):
    d = _incomplete(tiny, tmp_path)
    before = _listing(d)
    model = tiny
    if change == "model":
        model = tmp_path / "model"
        shutil.copytree(tiny, model)
        _edit_config(model)
        change = {}
    with pytest.raises(UserError, match="cannot resume|other settings|ran in") as e:
        run(_options("mmlu", model, tmp_path, "x", **change))
    assert needle in str(e.value) and "\n" not in str(e.value)
    assert _listing(d) == before
    # --overwrite starts it over (settings differ); the same settings resume even with --overwrite
    d2 = run(_options("mmlu", model, tmp_path, "x", overwrite=True, **change))
    assert json.loads((d2 / "summary.json").read_text())["counts"]["resumed_instances"] == 0


@pytest.mark.parametrize("restore_mtime", [False, True])
def test_weights_changed_in_place_refuse_a_resume(tiny, tmp_path, restore_mtime):
    """Issue 47: one tensor scaled in place (same size, in the middle of the file, so that neither end's
    MiB changes; with the modification time put back or not) after 2 parts: the resume is refused in one
    line naming the weight file, and touches nothing; a resume of the unchanged model is still accepted."""
    model = wide_tiny(tiny, tmp_path / "model")
    weights = model / "model.safetensors"
    assert weights.stat().st_size > 3 << 20
    d = _incomplete(model, tmp_path)
    before, original = _listing(d), weights.read_bytes()
    scale_in_place(weights, restore_mtime=restore_mtime)
    with pytest.raises(UserError, match="other settings") as e:
        run(_options("mmlu", model, tmp_path, "x"))
    assert "model.model.safetensors" in str(e.value) and "\n" not in str(e.value)
    assert _listing(d) == before
    with open(weights, "r+b") as fh:        # the same bytes again, in place: resumes
        fh.write(original)
    d = run(_options("mmlu", model, tmp_path, "x"))
    assert json.loads((d / "summary.json").read_text())["counts"]["resumed_instances"] > 0


def test_overwrite_with_the_same_settings_resumes(tiny, tmp_path):
    d = _incomplete(tiny, tmp_path)
    run(_options("mmlu", tiny, tmp_path, "x", overwrite=True))
    assert json.loads((d / "summary.json").read_text())["counts"]["resumed_instances"] > 0


@pytest.mark.parametrize("damage", ["truncate", "delete", "swap"])
def test_a_damaged_or_missing_part_is_one_line(tiny, tmp_path, damage):
    d = _incomplete(tiny, tmp_path)
    first = d / "parts" / "000001.instances.parquet"
    if damage == "truncate":
        first.write_bytes(first.read_bytes()[:100])
    elif damage == "delete":
        first.unlink()
    else:       # another part's file in its place: whole, but not the one run.json recorded
        shutil.copy(d / "parts" / "000002.instances.parquet", first)
    before = _listing(d)
    with pytest.raises(UserError) as e:
        run(_options("mmlu", tiny, tmp_path, "x"))
    msg = str(e.value)
    assert "parts/000001.instances.parquet" in msg and ("missing" if damage == "delete" else "damaged") in msg
    assert "\n" not in msg and _listing(d) == before


def test_a_full_disk_keeps_whole_parts_and_resumes(tiny, tmp_path, reference, monkeypatch):
    import errno

    _, want, _, _ = reference["mmlu"]
    real = pq.write_table
    n = []

    def full(table, where, **kw):       # the second part's requests file fills the disk part-way
        n.append(where)
        if len(n) == 3:
            open(where, "wb").write(b"PAR1 half")
            raise OSError(errno.ENOSPC, "No space left on device")
        real(table, where, **kw)
    monkeypatch.setattr(pq, "write_table", full)
    with pytest.raises(UserError, match="No space left on device") as e:
        run(_options("mmlu", tiny, tmp_path, "x"))
    assert "of 6 instances are kept in whole parts" in str(e.value)
    parts = sorted(p.name for p in (tmp_path / "x" / "parts").iterdir())
    assert parts == ["000001.instances.parquet", "000001.requests.parquet"]     # no temporary file left
    monkeypatch.setattr(pq, "write_table", real)
    d = run(_options("mmlu", tiny, tmp_path, "x"))
    _same_results(_instances(d), want)


def test_a_complete_run_still_needs_overwrite(tiny, tmp_path):
    d = run(_options("mmlu", tiny, tmp_path, "x"))
    with pytest.raises(UserError, match="exists; pass --overwrite"):
        run(_options("mmlu", tiny, tmp_path, "x"))
    assert (d / "summary.json").is_file()


def test_a_killed_overwrite_keeps_the_replaced_run_until_it_completes(tiny, tmp_path):
    d = run(_options("mmlu", tiny, tmp_path, "x", seed=3))
    old = (d / "summary.json").read_text()
    _incomplete(tiny, tmp_path, overwrite=True)             # other settings: replaces, killed midway
    aside = [p for p in tmp_path.iterdir() if p.name.startswith(".x.old-")]
    assert len(aside) == 1 and (aside[0] / "summary.json").read_text() == old
    run(_options("mmlu", tiny, tmp_path, "x"))              # the same command as the killed one resumes
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x"]


def test_how_to_resume_names_the_run_id_a_command_did_not(tmp_path):
    """A default run id has a timestamp: re-running the same command would start another run."""
    assert rd.RunDir(tmp_path / "mmlu-5shot-m-20261123-120000", {}, False, named=False).rerun == \
        "re-run the same command with --run-id mmlu-5shot-m-20261123-120000"
    assert rd.RunDir(tmp_path / "x", {}, False).rerun == "re-run the same command"


def test_an_interrupted_run_names_the_folder_to_resume(tmp_path):
    """Issue 36: the line a stopped run ends with names its folder, and the run id where the command
    gave none (the default run id has a timestamp); the marker file says the same."""
    from lmbatch.run.parts import Stop

    stop = Stop()
    stop.rundir = rd.RunDir(tmp_path / "mmlu-0shot-m-20261125-120000", {}, False, named=False)
    stop.rundir.saved, stop.rundir.total = {0: "a"}, 3
    assert stop.kept() == (f"1 of 3 instances kept; re-run the same command with --run-id mmlu-0shot-m-20261125-120000 "
                           f"to resume {tmp_path / 'mmlu-0shot-m-20261125-120000'}")
    stop.rundir.write_part([], [])          # nothing to write: no folder yet
    assert not stop.rundir.path.exists()
    stop.rundir._materialize()
    assert "--run-id mmlu-0shot-m-20261125-120000" in (stop.rundir.path / rd.MARKER).read_text()


def test_an_empty_run_id_is_refused_before_any_work(tmp_path):
    """`--run-id ""` used to get a timestamped folder whose interruption advised re-running the same
    command, which then started over elsewhere."""
    from lmbatch.options import check
    from lmbatch.programs.registry import get_workload

    with pytest.raises(UserError, match="--run-id '' is empty"):
        check(RunOptions.of(task="mmlu", run_id=""), get_workload("mmlu"))


def test_a_handover_with_nothing_finished_is_not_due_again_at_once():
    """Multi-stage programs finish only in their last wave: a handover that found none finished must
    wait checkpoint_s like any other (it was due at every step after the first: on a GPU, tot-gsm8k
    ran 5x slower and its batches, hence its bf16 outputs, changed). A stop makes it due at once."""
    from lmbatch.run.parts import Every, Stop

    stop = Stop()
    due = Every(60, stop)
    assert not due()
    due.next = 0.0
    assert due()
    assert not due()
    stop.asked = True
    assert due() and due()


def test_throughput_after_a_resume_is_the_whole_runs(reference, tiny, tmp_path):
    """A resumed run's throughput counts every instance's tokens over every attempt's seconds of execution
    (an attempt cut short up to its last part, as its instances are): it was this attempt's seconds over
    all instances' programs, so a resume after most of the work reported a rate many times too high."""
    task, want, _, steps = reference["mmlu"]
    # two parts whole, killed writing the third
    _killed(_options(task, tiny, tmp_path, "t"), lambda calls: calls.count("part instances") == 3)
    d = run(_options(task, tiny, tmp_path, "t"))
    s = json.loads((d / "summary.json").read_text())
    rows = _instances(d)
    _same_results(rows, want)
    attempts = s["attempts"]
    assert len(attempts) == 2 and s["counts"]["resumed_instances"] == attempts[0]["instances"] > 0
    assert all(a["execute_s"] > 0 for a in attempts)
    seconds = sum(a["execute_s"] for a in attempts)
    t = s["throughput"]
    assert t["programs_per_s"] == pytest.approx(len(rows) / seconds)
    for kind in ("prompt", "computed", "decode"):
        assert t[f"{kind}_tokens_per_s"] == pytest.approx(sum(r[f"{kind}_tokens"] for r in rows) / seconds)
    # this attempt alone ran the instances the first did not keep: fewer programs than the run has
    assert attempts[1]["instances"] == len(rows) - attempts[0]["instances"]
