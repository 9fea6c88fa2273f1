"""CPU threads on a busy machine (issue 57, engine/threads.py): each forward batch gets the cores other processes
leave free (one for a batch of few tokens, `--threads N` fixed), the process's own setting comes back after a
run, OpenMP's wait policy is set before torch loads, and the thread count changes no bit of a result."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from conftest import random_requests

from lmbatch.engine import Engine
from lmbatch.engine import threads as th
from lmbatch.requests import GenerateRequest, SamplingParams


class Clock:
    """/proc/stat's busy seconds, this process's CPU seconds and the monotonic clock, made up."""

    def __init__(self, monkeypatch):
        self.busy, self.own, self.now = 100.0, 10.0, 1000.0
        monkeypatch.setattr(th, "_busy_s", lambda: self.busy)
        monkeypatch.setattr(th.time, "process_time", lambda: self.own)
        monkeypatch.setattr(th.time, "monotonic", lambda: self.now)
        monkeypatch.setattr(th.os, "cpu_count", lambda: 4)

    def tick(self, seconds: float, others: float, own: float) -> None:
        """`seconds` pass with `others` cores busy elsewhere and `own` of this process's."""
        self.now += seconds
        self.own += own * seconds
        self.busy += (others + own) * seconds


def test_free_cores_are_the_machines_less_what_others_use(monkeypatch):
    clock = Clock(monkeypatch)
    free = th.FreeCores()
    assert free.get() == 4                          # nothing measured yet: every core
    clock.tick(1.0, others=2.5, own=1.0)            # this process's own time is not another's
    assert free.get() == pytest.approx(1.5)
    clock.tick(0.2, others=4.0, own=0.0)            # under SAMPLE_S: the last figure stands
    assert free.get() == pytest.approx(1.5)
    clock.tick(0.4, others=4.0, own=0.0)
    assert free.get() == pytest.approx(4 - (0.2 * 4 + 0.4 * 4) / 0.6)
    monkeypatch.setattr(th, "_busy_s", lambda: None)  # no /proc/stat: the last figure
    clock.tick(1.0, others=0.0, own=0.0)
    assert free.get() == pytest.approx(0.0)


def test_each_batch_gets_the_free_cores_and_a_small_one_one(monkeypatch):
    clock = Clock(monkeypatch)
    own = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        policy = th.CpuThreads()
        policy.apply(4096)
        assert torch.get_num_threads() == 4                 # idle: the process's own setting
        clock.tick(1.0, others=0.2, own=1.0)                # a machine's own background
        policy.apply(th.SMALL_TOKENS - 1)
        assert torch.get_num_threads() == 4                 # every core free: a decode step of few rows too
        clock.tick(1.0, others=2.0, own=1.0)
        policy.apply(4096)
        assert torch.get_num_threads() == 2                 # two cores taken by another job
        policy.apply(th.SMALL_TOKENS - 1)
        assert torch.get_num_threads() == 1                 # a decode step of few rows: one
        clock.tick(1.0, others=6.0, own=0.0)
        policy.apply(4096)
        assert torch.get_num_threads() == 1                 # more busy than cores: still one
        policy.restore()
        assert torch.get_num_threads() == 4 and policy.describe()["batches_by_threads"] == {"1": 2, "2": 1, "4": 2}
        torch.set_num_threads(3)                            # another hand's setting becomes the process's
        clock.tick(1.0, others=0.0, own=0.0)
        policy.apply(4096)
        policy.restore()
        assert policy.most == 3 and torch.get_num_threads() == 3
        fixed = th.CpuThreads(fixed=2)
        fixed.apply(1)
        assert torch.get_num_threads() == 2 and fixed.describe()["policy"] == "fixed (--threads)"
        fixed.restore()
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(own)


def test_an_engine_puts_the_process_setting_back_and_the_count_changes_no_bit(tiny_model):
    """Every score and token the same bits with one thread a batch and with two (MKL splits a GEMM's rows and
    columns, torch its reductions' rows), and the process's threads as they were after each run."""
    _, path, _ = tiny_model
    import random

    reqs = random_requests(random.Random(0), 12)
    reqs += [GenerateRequest([5, 6, 7, k], SamplingParams(max_new_tokens=6, temperature=0.8, seed=k, ignore_eos=True))
             for k in range(20)]
    own = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = {}
        for n in (1, 2):
            engine = Engine.from_pretrained(path, kv_cache_tokens=2048, max_tokens_per_batch=64, threads=n)
            got[n], _ = engine.run(reqs)
            assert torch.get_num_threads() == 2
            assert set(engine.model_runner.threads.used) == {n}
    finally:
        torch.set_num_threads(own)
    for a, b in zip(got[1], got[2]):
        if hasattr(a, "logprob"):
            assert (a.logprob, a.is_greedy) == (b.logprob, b.is_greedy)
        else:
            assert a.token_ids == b.token_ids


def test_the_wait_policy_is_set_before_torch_loads():
    """`lmbatch run` and `lmbatch lm-eval` set OpenMP's wait policy and MKL's strict reproducible mode before
    anything imports torch; a user's own setting wins."""
    code = """
import os, sys
os.environ.pop("OMP_WAIT_POLICY", None)
os.environ.pop("MKL_CBWR", None)
os.environ["KMP_BLOCKTIME"] = "7"
import lmbatch.cli, lmbatch.run.run, lmbatch.lm_eval.engine
seen = []
def look(*args, **kwargs):
    seen.append((os.environ.get("OMP_WAIT_POLICY"), os.environ.get("KMP_BLOCKTIME"), os.environ.get("MKL_CBWR"),
                 "torch" in sys.modules))
    raise SystemExit(0)
lmbatch.run.run.run = look
lmbatch.lm_eval.engine.start_early = look
for args in (["run", "mmlu"], ["lm-eval", "--tasks", "x"]):
    try:
        lmbatch.cli.app(args)
    except SystemExit:
        pass
print(seen)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == str([("PASSIVE", "7", "AUTO,STRICT", False)] * 2), out.stdout + out.stderr
