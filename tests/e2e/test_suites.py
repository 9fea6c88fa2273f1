"""Suites (issue 39): several tasks in one run, the model loaded once and every task's requests one batch
over one radix tree. A suite must give each task what the task gives alone (per-task metrics and
logprobs, to float32 batching noise) and reach the optimum of the union; its dry run, resume after a
kill, two data-parallel workers, the workload cache and report work on it as on one task."""
from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from conftest import make_tiny_with_tokenizer
from typer.testing import CliRunner

from lmbatch.cli import app
from lmbatch.options import RunOptions
from lmbatch.run.run import run
from lmbatch.rundir import rundir as rd

# the rc format with unconditional requests, WinoGrande's contexts that differ per option, and the mc
# format's one-token letters after one context (merged into one request)
SUITE = ["arc_challenge:rc", "winogrande:rc", "csqa:mc"]
# on the tiny model: OLMES tasks beside MMLU, --shots applying to MMLU alone
TINY_SUITE = "arc_easy:mc,winogrande:rc,mmlu"
TINY = dict(limit=2, shots=1, subjects=["anatomy", "virology"])


def _summary(d):
    return json.loads((d / "summary.json").read_text())


def _rows(d):
    return pq.read_table(d / "instances.parquet").to_pylist()


def _same_rows(got, want):
    assert [(r["task"], r["id"]) for r in got] == [(r["task"], r["id"]) for r in want]
    for a, b in zip(got, want):
        assert (a["prediction"], a["correct"], a["error"], dict(a["metrics"])) == \
            (b["prediction"], b["correct"], b["error"], dict(b["metrics"])), (a["task"], a["id"])
        assert a["logprobs"] == pytest.approx(b["logprobs"], abs=1e-4), (a["task"], a["id"])


def test_a_suite_gives_each_task_what_it_gives_alone(tmp_path):
    """Three OLMES tasks, 2 docs each, on the embedded model (float32): one run of the three and a run of
    each alone. Each task's block in the suite's summary holds the metrics (and tokens) of its run alone,
    the instances are the same with the same logprobs, and the suite reaches the optimum of the union,
    which its dry run printed."""
    common = dict(limit=2, out=tmp_path, device="cpu", quiet=True)
    dry = run(RunOptions.of(task=",".join(SUITE), dry_run=True, workload_cache=False, **common))
    suite = run(RunOptions.of(task=",".join(SUITE), run_id="suite", **common))
    s = _summary(suite)
    assert s["hit_rate"] == pytest.approx(s["optimal_hit_rate"], abs=1e-12)
    assert (dry["optimal_hit_rate"], dry["prompt_tokens"]) == (pytest.approx(s["optimal_hit_rate"], abs=1e-12),
                                                               s["tokens"]["prompt"])
    assert dry["tasks"] == dict.fromkeys(SUITE, 2) and s["shots"] == dry["shots"] == 5
    assert list(s["tasks"]) == SUITE
    rows = _rows(suite)
    for task in SUITE:
        alone = run(RunOptions.of(task=task, run_id=task.replace(":", "-"), **common))
        a, t = _summary(alone), s["tasks"][task]
        assert list(a["tasks"]) == [task] and a["tasks"][task]["metrics"] == a["metrics"]
        assert t["metrics"] == a["metrics"], task
        assert (t["n"], t["failed"], t["primary_metric"]) == (2, 0, a["tasks"][task]["primary_metric"])
        assert t["prompt_tokens"] == a["tokens"]["prompt"]
        assert t["optimal_hit_rate"] == pytest.approx(a["optimal_hit_rate"], abs=1e-12)
        assert t["hit_rate"] >= t["optimal_hit_rate"] - 1e-12     # prefixes shared with another task cost less
        _same_rows([r for r in rows if r["task"] == task], _rows(alone))
    assert sum(t["prompt_tokens"] for t in s["tasks"].values()) == s["tokens"]["prompt"]
    assert s["tokens"]["computed"] == s["tokens"]["unique"] == sum(t["computed_tokens"] for t in s["tasks"].values())
    assert s["tasks"]["arc_challenge:rc"]["primary_metric"] == "acc_per_char"
    assert {"acc_uncond", "acc_uncond_stderr"} <= set(s["tasks"]["arc_challenge:rc"]["metrics"])
    assert "acc_uncond" not in s["tasks"]["winogrande:rc"]["metrics"]
    reqs = pq.read_table(suite / "requests.parquet").to_pylist()
    assert {r["task"] for r in reqs} == set(SUITE)
    report = CliRunner().invoke(app, ["report", str(suite), "--format", "json"])
    assert report.exit_code == 0, report.output
    assert json.loads(report.output)[0]["task"] == ",".join(SUITE)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_with_tokenizer(tmp_path_factory.mktemp("tiny"), 8192)


def _tiny_run(tiny, out, run_id, **kw):
    return run(RunOptions.of(task=TINY_SUITE, model=str(tiny), out=out, run_id=run_id, device="cpu", quiet=True,
                          checkpoint_s=1e-6, max_tokens_per_batch=256, **{**TINY, **kw}))


class _Kill(BaseException):
    """Leaves the run directory as a kill at that moment would."""


def test_a_suite_resumes_runs_on_two_workers_and_is_cached_whole(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("LMBATCH_CACHE", str(tmp_path / "cache"))
    ref = _tiny_run(tiny, tmp_path, "ref")
    s = _summary(ref)
    assert list(s["tasks"]) == TINY_SUITE.split(",") and s["shots"] is None
    assert [r["task"] for r in _rows(ref)] == ["arc_easy:mc"] * 2 + ["winogrande:rc"] * 2 + ["mmlu"] * 4
    assert s["hit_rate"] == pytest.approx(s["optimal_hit_rate"], abs=1e-12)
    assert s["tasks"]["mmlu"]["primary_metric"] == "acc" and s["tasks"]["winogrande:rc"]["primary_metric"] == \
        "acc_raw"
    # the workload cache keys on the whole suite: a repeat reads it, another list of tasks is another entry
    again = _tiny_run(tiny, tmp_path, "again")
    assert _summary(again)["workload"] == "cache"
    _same_rows(_rows(again), _rows(ref))
    entries = set((tmp_path / "cache" / "workloads").glob("*.pkl"))
    run(RunOptions.of(task="arc_easy:mc,winogrande:rc", model=str(tiny), out=tmp_path, run_id="two", device="cpu",
                   quiet=True, limit=2))
    assert len(set((tmp_path / "cache" / "workloads").glob("*.pkl")) - entries) == 1
    # killed after its second part, then the same command: every instance once, as the uninterrupted run
    parts = []

    def kill(step):
        parts.append(step)
        if parts.count("part instances") == 2:
            raise _Kill(step)
    rd.fault = kill
    try:
        with pytest.raises(_Kill):
            _tiny_run(tiny, tmp_path, "killed")
    finally:
        rd.fault = None
    resumed = _tiny_run(tiny, tmp_path, "killed")
    assert _summary(resumed)["counts"]["resumed_instances"] >= 1
    _same_rows(_rows(resumed), _rows(ref))
    assert {k: v["metrics"] for k, v in _summary(resumed)["tasks"].items()} == \
        {k: v["metrics"] for k, v in s["tasks"].items()}
    # two workers, each running whole subtrees of the union's tree
    two = _tiny_run(tiny, tmp_path, "two-workers", data_parallel="2")
    _same_rows(_rows(two), _rows(ref))
    assert _summary(two)["tokens"]["prompt"] == s["tokens"]["prompt"]
    assert _summary(two)["data_parallel"]["workers"] == 2


def _error(*args):
    r = CliRunner().invoke(app, [str(a) for a in args])
    assert r.exit_code == 2, r.output
    return r.stderr.strip()


def test_suite_options_are_checked_before_any_work(tmp_path):
    assert "leave --shots out" in _error("run", "olmes", "--shots", 3, "--out", tmp_path)
    assert "leave --shots out" in _error("run", "arc_easy:rc", "--shots", 2, "--out", tmp_path)
    assert "names 'mmlu' twice" in _error("run", "olmes,mmlu", "--out", tmp_path)
    assert "empty name" in _error("run", "mmlu,", "--out", tmp_path)
    assert "unknown task 'arc:rc'" in _error("run", "mmlu,arc:rc", "--out", tmp_path)
    assert "--apply-chat-template" in _error("run", "mmlu,piqa:mc", "--apply-chat-template", "--out", tmp_path)
    assert "--subjects applies to mmlu only" in _error("run", "olmes:rc", "--subjects", "anatomy", "--out", tmp_path)
    assert "unknown MMLU subject" in _error("run", "piqa:rc,mmlu", "--subjects", "astrology", "--out", tmp_path)
