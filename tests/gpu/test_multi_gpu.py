"""Two GPUs or more (a machine of 2 or 4: `python -m pytest -m gpu2`; a one-GPU machine runs
`-m "gpu and not gpu2"`): data-parallel workers on their own GPUs and a tensor-parallel group over
NCCL give what one GPU gives, in float32 (the torch attention backend) and in bf16 with FlashInfer /
Triton and decode graphs (near-ties aside); left to auto, a run takes every GPU."""
import json
import random

import pyarrow.parquet as pq
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.gpu2]

from conftest import make_tiny_hf, make_tiny_with_tokenizer, random_requests, tot_on_workers  # noqa: E402

from lmbatch.engine import Engine, EngineOptions  # noqa: E402
from lmbatch.engine.options import EngineSpec  # noqa: E402
from lmbatch.engine.parallel import ParallelEngine  # noqa: E402
from lmbatch.model.config import ModelConfig  # noqa: E402
from lmbatch.options import RunOptions  # noqa: E402
from lmbatch.requests import GenerateRequest, SamplingParams  # noqa: E402
from lmbatch.run.run import run  # noqa: E402


@pytest.fixture(autouse=True)
def two_gpus():
    assert torch.cuda.device_count() >= 2, "gpu2 tests need two GPUs (nvidia-h200-x2)"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_data_parallel_run_on_two_gpus(tmp_path, dtype):
    model = make_tiny_with_tokenizer(tmp_path / "tiny", 16384)
    rows = {}
    for dp in ("1", "2"):
        d = run(RunOptions.of(task="mmlu", shots=2, limit=3, model=str(model), out=tmp_path, run_id=f"dp{dp}",
                           device="cuda", dtype=dtype, data_parallel=dp, quiet=True))
        rows[dp] = pq.read_table(d / "instances.parquet").to_pylist()
        summary = json.loads((d / "summary.json").read_text())
        assert summary["data_parallel"]["workers"] == int(dp)
        assert summary["hit_rate"] == pytest.approx(summary["data_parallel"]["optimal_hit_rate"], abs=1e-12)
    same = sum(a["prediction"] == b["prediction"] for a, b in zip(rows["1"], rows["2"]))
    assert same >= len(rows["1"]) - (0 if dtype == "float32" else len(rows["1"]) // 50)


def test_programs_run_whole_on_each_gpu(tmp_path):
    """Tree of thought on two GPUs: each worker runs its programs end to end (run/spread.py), with the
    generated text, answers and counts of one engine (float32, greedy where the program is)."""
    got = tot_on_workers(tmp_path, make_tiny_with_tokenizer(tmp_path / "tiny", 16384))
    (one, s1), (two, s2) = got["1"], got["2"]
    assert [w["chunks"] for w in s2["data_parallel"]["workers_load"]] == [1, 1]
    assert [(r["id"], r["prediction"], r["outputs"]) for r in two] == [(r["id"], r["prediction"], r["outputs"])
                                                                       for r in one]
    assert s2["tokens"]["decode"] == s1["tokens"]["decode"] and s2["optimal_hit_rate"] == s1["optimal_hit_rate"]


def test_auto_takes_every_gpu(tmp_path, monkeypatch):
    """The default (`--data-parallel auto`) on a machine of several GPUs: a worker on each, every one given
    chunks, and the predictions of one engine (float32); a job known to be small (its cached workload's
    figures) on one engine."""
    monkeypatch.setenv("LMBATCH_CACHE", str(tmp_path / "cache"))
    n = torch.cuda.device_count()
    model = make_tiny_with_tokenizer(tmp_path / "tiny", 16384)
    kw = dict(task="mmlu", shots=2, limit=2, model=str(model), out=tmp_path, device="cuda", dtype="float32",
              quiet=True)
    auto = run(RunOptions.of(**kw, run_id="auto"))          # nothing cached: the job's size is not known
    one = run(RunOptions.of(**kw, run_id="one", data_parallel="1"))
    small = json.loads((run(RunOptions.of(**kw, run_id="small")) / "summary.json").read_text())["data_parallel"]
    assert small["workers"] == 1 and small["why"].endswith("1 worker: a small job (0 TFLOP of model work)")
    s = json.loads((auto / "summary.json").read_text())
    dp = s["data_parallel"]
    assert (s["options"]["data_parallel"], dp["workers"], dp["tensor_parallel"]) == ("auto", n, 1)
    assert dp["why"].startswith("the model fits one GPU (") and dp["why"].endswith(f"; {n} workers: {n} GPUs visible")
    assert len(dp["workers_load"]) == n and all(w["chunks"] >= 1 and w["computed_tokens"] > 0
                                                for w in dp["workers_load"])
    rows = [pq.read_table(d / "instances.parquet").to_pylist() for d in (one, auto)]
    assert [(r["id"], r["prediction"]) for r in rows[1]] == [(r["id"], r["prediction"]) for r in rows[0]]
    assert s["hit_rate"] == pytest.approx(dp["optimal_hit_rate"], abs=1e-12)


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe", "gemma2"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tensor_parallel_over_nccl(tmp_path, kind, dtype):
    make_tiny_hf(kind, tmp_path, hidden_size=256, head_dim=64)
    cfg = ModelConfig.from_dir(tmp_path)
    rng = random.Random(0)
    reqs = random_requests(rng, 32, cfg.vocab_size) + [
        GenerateRequest([rng.randrange(cfg.vocab_size) for _ in range(12)],
                        SamplingParams(max_new_tokens=10, ignore_eos=True)) for _ in range(6)]
    want, _ = Engine.from_pretrained(tmp_path, EngineOptions(kv_cache_tokens=4096), device="cuda",
                                     dtype=getattr(torch, dtype)).run(reqs)
    spec = EngineSpec(str(tmp_path), "cuda", dtype, EngineOptions(kv_cache_tokens=4096, max_tokens_per_batch=256),
                      tensor_parallel=2)
    engine = ParallelEngine(spec, cfg, gpus=["0", "1"])
    try:
        got, _ = engine.run(reqs)
    finally:
        engine.close()
    tol = 1e-4 if dtype == "float32" else 0.1
    for a, b in zip(got, want):
        if hasattr(b, "logprob"):
            assert a.logprob == pytest.approx(b.logprob, abs=tol * max(1, b.num_tokens))
    gens = [(a.token_ids, b.token_ids) for a, b in zip(got, want) if not hasattr(b, "logprob")]
    assert sum(x == y for x, y in gens) >= (len(gens) if dtype == "float32" else len(gens) - 2)


def test_deterministic_run_is_the_same_bits_on_one_and_two_gpus(tmp_path):
    """--deterministic in bf16 on CUDA: one GPU, two data-parallel workers, another batch budget: every
    logprob and generated token the same bits (a sampling program beside MMLU: a suite)."""
    model = make_tiny_with_tokenizer(tmp_path / "tiny", 16384)
    prog = tmp_path / "sampled.py"
    prog.write_text("from lmbatch.frontend import gen, select\n\ndef instances():\n"
                    "    return [{'id': f'q{k}', 'n': k} for k in range(12)]\n\ndef program(s, n):\n"
                    "    s += f'Question {n}: what comes after {n}?' * (1 + n % 3)\n"
                    "    s += gen('thought', max_tokens=8, temperature=0.9)\n"
                    "    s += ' So' + select('answer', [' one', ' two', ' three'])\n")
    got = {}
    for name, kw in {"one": dict(data_parallel="1"), "two": dict(data_parallel="2"),
                     "budget": dict(data_parallel="1", max_tokens_per_batch=97)}.items():
        for task in ("mmlu", str(prog)):
            extra = dict(shots=2, limit=3) if task == "mmlu" else {}
            d = run(RunOptions.of(task=task, model=str(model), out=tmp_path, run_id=f"{name}-{len(got)}",
                                  device="cuda", dtype="bfloat16", deterministic=True, quiet=True, **extra, **kw))
            rows = pq.read_table(d / "instances.parquet").to_pylist()
            got[name, task] = [(r["id"], r["prediction"], r["outputs"], r["logprobs"]) for r in rows]
    for task in ("mmlu", str(prog)):
        assert got["two", task] == got["one", task] and got["budget", task] == got["one", task], task
