"""`--deterministic` (issue 50): a score is a property of the model and the task, not of how the run was
executed. MMLU, a suite with MMLU inside, a program that samples and tree of thought, each run with other
batch budgets, another pool, two data-parallel workers, another schedule, killed at half and resumed,
give every logprob and every token bit for bit the same (CPU, float32: what CI can check; the GPU suite
runs the same on CUDA)."""
from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from conftest import make_tiny_with_tokenizer

from lmbatch.options import RunOptions
from lmbatch.run.run import run
from lmbatch.rundir import rundir as rd

# a sampled gen (its seed the instance's), then a select over the text it wrote
PROGRAM = '''from lmbatch.frontend import gen, select

def instances():
    return [{"id": f"q{k}", "n": k} for k in range(8)]

def program(s, n):
    s += f"Question {n}: what comes after {n}? " * (1 + n % 3)
    s += gen("thought", max_tokens=5, temperature=0.9)
    s += " So the answer is" + select("answer", [" one", " two", " three"])
'''
MMLU = dict(shots=1, limit=2, subjects=["anatomy", "virology", "astronomy"])
ON = dict(device="cpu")      # where the runs go: tests/gpu/test_gpu.py runs these tests in bf16 on CUDA
VARIANTS = {"budget": dict(max_tokens_per_batch=37), "pool": dict(kv_cache_tokens=1100, max_tokens_per_batch=100),
            "fcfs": dict(schedule="fcfs"), "workers": dict(data_parallel="2")}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_with_tokenizer(tmp_path_factory.mktemp("tiny"), 2048)


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    path = tmp_path_factory.mktemp("prog") / "sampled.py"
    path.write_text(PROGRAM)
    return path


def _run(tiny, out, run_id, task, **kw):
    base = dict(model=str(tiny), out=out, run_id=run_id, quiet=True, deterministic=True, checkpoint_s=1e-6,
                max_tokens_per_batch=4096, **ON)
    if "mmlu" in task:
        base.update(MMLU)
    return run(RunOptions.of(task=task, **{**base, **kw}))


def _bits(d):
    """Each instance's id, task, prediction, generated outputs and logprobs, as written."""
    rows = pq.read_table(d / "instances.parquet").to_pylist()
    return [(r.get("task"), r["id"], r["prediction"], r["error"], json.loads(r["outputs"]), r["logprobs"])
            for r in rows]


def _same(got, ref, name: str) -> None:
    """The rows equal, bit for bit; else how many differ and the first (a failure says where to look)."""
    if got == ref:
        return
    diff = [(g, r) for g, r in zip(got, ref) if g != r]
    raise AssertionError(f"{name}: {len(diff)} of {len(ref)} rows differ ({len(got)} rows given); first: "
                         f"{diff[0] if diff else 'row counts differ'}")


class _Kill(BaseException):
    pass


def _killed_at_part(parts, tiny, out, run_id, task, **kw):
    """The run killed (as SIGKILL would leave it) once it has written `parts` result parts."""
    seen = []

    def kill(step):
        seen.append(step)
        if seen.count("part instances") == parts:
            raise _Kill(step)
    rd.fault = kill
    try:
        with pytest.raises(_Kill):
            _run(tiny, out, run_id, task, **kw)
    finally:
        rd.fault = None


def _killed_then_resumed(tiny, out, task, **kw):
    _killed_at_part(2, tiny, out, "resumed", task, **kw)
    d = _run(tiny, out, "resumed", task, max_tokens_per_batch=53)    # the rest in other batches
    assert json.loads((d / "summary.json").read_text())["counts"]["resumed_instances"] >= 1
    return d


@pytest.mark.parametrize("task", ["mmlu", "program", "arc_easy:mc,mmlu"])
def test_every_bit_the_same_however_the_run_executes(tiny, program, tmp_path, task):
    task = str(program) if task == "program" else task
    d = _run(tiny, tmp_path, "ref", task)
    ref = _bits(d)
    assert ref and all(r[3] is None for r in ref)
    said = json.loads((d / "summary.json").read_text())["deterministic"]
    assert "data_parallel" in said["same_bits_across"] and said["given"]["tensor_parallel"] == 1
    for name, kw in VARIANTS.items():
        _same(_bits(_run(tiny, tmp_path, name, task, **kw)), ref, name)
    _same(_bits(_killed_then_resumed(tiny, tmp_path, task, checkpoint_s=1e-6)), ref, "killed and resumed")
    if task == str(program):    # two workers, each running its programs whole, killed mid-run and resumed by two
        _killed_at_part(2, tiny, tmp_path, "workers-resumed", task, data_parallel="2")
        d = _run(tiny, tmp_path, "workers-resumed", task, data_parallel="2")
        s = json.loads((d / "summary.json").read_text())
        assert s["counts"]["resumed_instances"] >= 1 and [w["chunks"] for w in s["data_parallel"]["workers_load"]] \
            == [1, 1]
        _same(_bits(d), ref, "two workers killed and resumed")
    if task == "arc_easy:mc,mmlu":        # a task inside a suite: its rows as the task alone gives them
        alone = _bits(_run(tiny, tmp_path, "alone", "mmlu"))
        assert [r[1:] for r in ref if r[0] == "mmlu"] == [r[1:] for r in alone]


def test_tree_of_thought_tokens_do_not_depend_on_the_batch(tiny, tmp_path):
    ref = _bits(_run(tiny, tmp_path, "ref", "tot-gsm8k", limit=1))
    _same(_bits(_run(tiny, tmp_path, "small", "tot-gsm8k", limit=1, max_tokens_per_batch=61, kv_cache_tokens=3000)),
          ref, "small batches and pool")


def test_a_resume_does_not_mix_deterministic_and_default_numerics(tiny, tmp_path):
    """The fingerprint holds the mode: the other mode on an incomplete run is refused, as changed settings are."""
    from lmbatch.errors import UserError

    _killed_at_part(1, tiny, tmp_path, "mixed", "mmlu")
    with pytest.raises(UserError, match="deterministic"):
        _run(tiny, tmp_path, "mixed", "mmlu", deterministic=False)
