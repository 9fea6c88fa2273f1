"""Programs without barriers (issue 56): on one engine a program's next call joins the running batch once its
results are back and the batch has room (the engine's open stream), where before it waited for the wave of every
other program's calls (`LMBATCH_BARRIERS=1` keeps that). Tree of thought, a sampled program of uneven stages, JSON
after thinking and a suite of JSON and MMLU give the same results either way: bit for bit with
`--deterministic`, the same text and scores to float32 batching noise without; on one engine and on two
workers (each running its programs whole, with an open stream of its own)."""
from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from conftest import make_tiny_with_tokenizer
from transformers import AutoTokenizer

from lmbatch.options import RunOptions
from lmbatch.run.run import run

# calls of uneven length: a program whose gens end early goes on to its select while others still decode
PROGRAM = '''from lmbatch.frontend import gen, select

def instances():
    return [{"id": f"q{k}", "n": k} for k in range(8)]

def program(s, n):
    s += f"Question {n}: what comes after {n}? " * (1 + n % 3)
    s += gen("thought", max_tokens=1 + 4 * (n % 4), temperature=0.9)
    s += " So the answer is" + select("answer", [" one", " two", " three"])
    s += gen("why", max_tokens=2 + 3 * (n % 3), temperature=0.9)
    s += " Sure?" + select("sure", [" yes", " no"])
'''
CASES = {
    "tot": dict(task="tot-gsm8k", limit=1),
    "program": dict(task="PROGRAM"),
    "json-thinking": dict(task="json", limit=3, think_budget=6),
    "suite": dict(task="json,mmlu", limit=2, subjects=["anatomy"], think_budget=4),
}


@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    """A tiny model whose chat template names </think> (a thinking model's marker)."""
    model = make_tiny_with_tokenizer(tmp_path_factory.mktemp("thinker") / "m", 2048)
    tok = AutoTokenizer.from_pretrained(str(model))
    tok.chat_template += "{# a thinking model closes its thoughts with </think> #}"
    tok.save_pretrained(model)
    return model


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    path = tmp_path_factory.mktemp("prog") / "uneven.py"
    path.write_text(PROGRAM)
    return path


def _run(monkeypatch, out, run_id, case, thinker, program, *, barriers: bool, **kw):
    monkeypatch.setenv("LMBATCH_BARRIERS", "1" if barriers else "0")     # worker processes inherit it
    o = dict(CASES[case])
    if o["task"] == "PROGRAM":
        o["task"] = str(program)
    d = run(RunOptions.of(**o, model=str(thinker), out=out, run_id=run_id, device="cpu", quiet=True,
                          checkpoint_s=1e-6, **kw))
    rows = [(r.get("task"), r["id"], r["prediction"], r["error"], json.loads(r["outputs"]), r["logprobs"])
            for r in pq.read_table(d / "instances.parquet").to_pylist()]
    return rows, json.loads((d / "summary.json").read_text()), pq.read_table(d / "requests.parquet").to_pylist()


def _stages_overlap(requests: list[dict]) -> bool:
    """Whether some program's later call finished before another program's earlier call (no barrier between)."""
    stages = [r["stage"] for r in sorted(requests, key=lambda r: r["order"])]
    return any(later < earlier for earlier, later in zip(stages, stages[1:]))


@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "default"])
@pytest.mark.parametrize("case", list(CASES))
def test_programs_give_the_same_results_with_and_without_barriers(case, deterministic, thinker, program, tmp_path,
                                                                  monkeypatch):
    kw = dict(deterministic=deterministic, data_parallel="1")
    ref, s_ref, r_ref = _run(monkeypatch, tmp_path, "waves", case, thinker, program, barriers=True, **kw)
    got, s_got, r_got = _run(monkeypatch, tmp_path, "open", case, thinker, program, barriers=False, **kw)
    assert ref and all(r[3] is None for r in ref), ref
    if "think_budget" in CASES[case]:       # the gens thought first (the model's template names the marker)
        assert s_ref["tokens"]["thinking"] > 0 and s_got["tokens"]["thinking"] == s_ref["tokens"]["thinking"]
    if deterministic:
        assert got == ref
    else:
        assert [r[:5] for r in got] == [r[:5] for r in ref]
        for a, b in zip(got, ref):
            assert a[5] == pytest.approx(b[5], abs=1e-4), a[1]
    assert s_got["accuracy"] == s_ref["accuracy"]
    for key in ("calls", "requests", "executed_requests"):
        assert s_got["counts"][key] == s_ref["counts"][key], key
    # the same prompts executed: the same optimum, and the cache reaches as much of it
    assert s_got["tokens"]["prompt"] == s_ref["tokens"]["prompt"]
    assert s_got["optimal_hit_rate"] == s_ref["optimal_hit_rate"]
    assert s_got["tokens"]["computed"] == s_ref["tokens"]["computed"]
    assert s_got["hit_rate"] <= s_got["optimal_hit_rate"] + 1e-12
    assert not _stages_overlap(r_ref)       # waves: every call of a stage before any of the next
    if case == "program":                   # the short programs' later calls ran beside the long ones' gens
        assert _stages_overlap(r_got)
        assert s_got["counts"]["waves"] > s_ref["counts"]["waves"]
    if case in ("tot", "program"):          # two workers, each running its programs whole on an open stream
        two, s_two, _ = _run(monkeypatch, tmp_path, "open2", case, thinker, program, barriers=False,
                             deterministic=deterministic, data_parallel="2")
        if deterministic:
            assert two == ref
        else:
            assert [r[:5] for r in two] == [r[:5] for r in ref]
        # each worker its share of the programs, whole (one question of tree of thought: one worker's)
        chunks = [w["chunks"] for w in s_two["data_parallel"]["workers_load"]]
        assert chunks == ([1, 1] if case == "program" else [1, 0])

