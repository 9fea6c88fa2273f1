"""Tensor parallelism (issue 23) over gloo on CPU: a model split over two ranks (heads, KV heads, MLP
and expert slices, vocabulary) scores and generates as the whole model does in one process, to 1e-5
in float32, for each family's deltas (biases, q/k norms, routed experts, soft-caps and sliding
windows, fused checkpoint tensors, a vocabulary that does not divide evenly); DP x TP too."""
from __future__ import annotations

import random

import pytest
import torch
from conftest import make_tiny_hf, random_requests

from lmbatch.engine import Engine, EngineOptions
from lmbatch.engine.options import EngineSpec
from lmbatch.engine.parallel import ParallelEngine
from lmbatch.errors import WorkerFailed
from lmbatch.model.config import ModelConfig
from lmbatch.model.tensor_parallel import shard_config
from lmbatch.requests import GenerateRequest, SamplingParams

OPTIONS = dict(kv_cache_tokens=2048, max_tokens_per_batch=96)


def _requests(vocab: int, seed: int = 0):
    rng = random.Random(seed)
    scores = random_requests(rng, 24, vocab)
    gens = [GenerateRequest([rng.randrange(vocab) for _ in range(rng.randint(3, 20))],
                            SamplingParams(max_new_tokens=8, temperature=t, seed=k, ignore_eos=True))
            for k, t in enumerate([0.0] * 4 + [0.7] * 2)]
    return scores + gens


def _compare(got, want):
    for a, b in zip(got, want):
        if hasattr(b, "logprob"):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-5) and a.is_greedy == b.is_greedy
        else:
            assert a.token_ids == b.token_ids


@pytest.mark.parametrize("kind,overrides", [("llama", {}), ("llama", {"vocab_size": 127}), ("qwen2", {}),
                                            ("qwen3", {}), ("qwen3_moe", {}), ("mixtral", {}), ("gemma2", {}),
                                            ("phi3", {}), ("olmo3", {}),
                                            ("glm4_moe", {}), ("gpt_oss", {}), ("deepseek_v3", {})])
def test_two_ranks_equal_one(kind, overrides, tmp_path):
    make_tiny_hf(kind, tmp_path, **overrides)
    cfg = ModelConfig.from_dir(tmp_path)
    reqs = _requests(cfg.vocab_size)
    want, _ = Engine.from_pretrained(tmp_path, EngineOptions(**OPTIONS)).run(reqs)
    spec = EngineSpec(str(tmp_path), "cpu", "float32", EngineOptions(**OPTIONS), threads=1, tensor_parallel=2)
    engine = ParallelEngine(spec, cfg)
    try:
        got, stats = engine.run(reqs)
        assert engine.kv_slots >= OPTIONS["kv_cache_tokens"]
    finally:
        engine.close()
    _compare(got, want)
    assert stats.requests == len(reqs) and stats.computed_tokens + stats.cached_tokens == stats.prompt_tokens


def test_data_parallel_times_tensor_parallel(tmp_path):
    """Two workers of two ranks each (four processes): the same results, each batch split in two."""
    make_tiny_hf("llama", tmp_path)
    cfg = ModelConfig.from_dir(tmp_path)
    reqs = _requests(cfg.vocab_size, seed=1)
    want, _ = Engine.from_pretrained(tmp_path, EngineOptions(**OPTIONS)).run(reqs)
    spec = EngineSpec(str(tmp_path), "cpu", "float32", EngineOptions(**OPTIONS), data_parallel=2, threads=1,
                      tensor_parallel=2, relay_s=0.0)
    engine = ParallelEngine(spec, cfg)
    try:
        got, _ = engine.run(reqs)
        again, _ = engine.run(reqs)            # a second batch finds its prefixes in the workers' caches
    finally:
        engine.close()
    _compare(got, want)
    _compare(again, want)


def test_models_that_do_not_split(tmp_path):
    make_tiny_hf("llama", tmp_path / "l")
    with pytest.raises(ValueError, match=r"3 ranks do not divide the model's num_heads \(4\)"):
        shard_config(ModelConfig.from_dir(tmp_path / "l"), 3)


def test_a_worker_that_fails_is_named(tmp_path):
    """A rank that cannot build its model (here: no checkpoint) stops the start with its message."""
    (tmp_path / "config.json").write_text((lambda p: (make_tiny_hf("llama", p), (p / "config.json").read_text())[1])
                                          (tmp_path / "src"))
    spec = EngineSpec(str(tmp_path), "cpu", "float32", EngineOptions(kv_cache_tokens=512, max_tokens_per_batch=64),
                      threads=1, tensor_parallel=2)
    with pytest.raises(WorkerFailed, match=r"data-parallel worker 0 \(tensor-parallel rank [01]\): .*safetensors"):
        ParallelEngine(spec, ModelConfig.from_dir(tmp_path))


torch.set_num_threads(1)


def test_the_closing_line_names_a_ranks_device():
    """`--tensor-parallel 3 --device cpu` runs three gloo processes on the CPU: the run's closing line says so,
    never "3 GPUs" (issue 57)."""
    from lmbatch.run.summary import _workers
    from lmbatch.rundir.records import DataParallel, WorkerLoad

    def load(busy: float, idle: float) -> WorkerLoad:
        return WorkerLoad(busy_s=busy, idle_s=idle, computed_tokens=0, chunks=1, chunks_taken=0)

    dp = DataParallel(workers=1, tensor_parallel=3, workers_load=[load(1.0, 0.0)])
    assert _workers(dp, "cpu") == "  1 worker x 3 CPU processes busy 100%-100%"
    assert _workers(dp, "cuda") == "  1 worker x 3 GPUs busy 100%-100%"
    two = DataParallel(workers=2, tensor_parallel=1, workers_load=[load(1.0, 1.0), load(3.0, 1.0)])
    assert _workers(two, "cuda") == "  2 workers busy 50%-75%"
