"""How many devices a run uses (engine/devices.py), decided without torch: the GPUs CUDA would show
(CUDA_VISIBLE_DEVICES applied), the model's weights against their memory, and auto's choices."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from lmbatch.engine import devices
from lmbatch.engine.devices import GPUs, layout, visible_gpus, weight_bytes
from lmbatch.engine.options import EngineSpec
from lmbatch.errors import UserError
from lmbatch.model.config import ModelConfig

PRESETS = Path(__file__).resolve().parents[2] / "presets"
GIB = 1 << 30


def _cfg(preset: str) -> ModelConfig:
    return ModelConfig.from_dir(PRESETS / preset)


def test_weights_are_the_models_parameters():
    """Qwen2.5-1.5B has 1.54B parameters (tied embeddings), Llama-3.1-8B 8.03B, Llama-3.1-70B 70.6B."""
    for preset, params in (("qwen2.5-1.5b", 1.54e9), ("llama-3.1-8b", 8.03e9), ("llama-3.1-70b", 70.6e9)):
        assert weight_bytes(_cfg(preset), "bfloat16") == pytest.approx(2 * params, rel=0.01), preset
    assert weight_bytes(_cfg("qwen2.5-1.5b"), "float32") == 2 * weight_bytes(_cfg("qwen2.5-1.5b"), "bfloat16")


@pytest.mark.parametrize("preset, gpus, want", [
    ("qwen3-8b", GPUs(4, 80 * GIB), (4, 1)),            # fits one GPU: a worker on each
    ("qwen3-8b", GPUs(1, 80 * GIB), (1, 1)),
    ("llama-3.1-70b", GPUs(4, 80 * GIB), (1, 4)),       # 141 GB of weights: four H100s hold one copy
    ("llama-3.1-70b", GPUs(4, 141 * GIB), (2, 2)),      # two H200s hold one: two workers
    ("llama-3.1-70b", GPUs(8, 80 * GIB), (2, 4)),
    ("qwen3-8b", GPUs(4, None), (4, 1)),                # memory not known: one GPU a model
])
def test_auto_takes_every_gpu_and_splits_what_does_not_fit(preset, gpus, want):
    spec = EngineSpec(str(PRESETS / preset), "auto", data_parallel="auto", tensor_parallel="auto")
    got = layout(spec, _cfg(preset), gpus, cores=128)
    assert (got.data_parallel, got.tensor_parallel) == want
    assert got.why.endswith(f"{gpus.visible} GPUs visible" + (f", {want[1]} a model" if want[1] > 1 else "")) \
        or got.why.endswith(f"{gpus.visible} GPU visible")


def test_auto_on_cpu_and_what_is_asked_for():
    cfg = _cfg("qwen3-8b")
    spec = EngineSpec("m", "auto", data_parallel="auto", tensor_parallel="auto")
    assert layout(spec, cfg, GPUs(0, None)) == (1, 1, "--data-parallel and --tensor-parallel auto: 1 on CPU")
    assert layout(EngineSpec("m", "cpu", data_parallel=2, tensor_parallel=2), cfg, GPUs(4, 80 * GIB)) == \
        (2, 2, "asked for")
    assert layout(EngineSpec("m", "cuda", data_parallel="2", tensor_parallel=2), cfg, GPUs(4, 80 * GIB))[:2] == (2, 2)
    assert layout(EngineSpec("m", "cuda", data_parallel="auto", tensor_parallel=2), cfg, GPUs(4, 80 * GIB))[:2] == \
        (2, 2)


def test_what_cannot_be_placed_is_one_line():
    cfg = _cfg("qwen3-8b")
    with pytest.raises(UserError, match=r"^--data-parallel 4 x --tensor-parallel 2: 8 GPUs needed, 4 visible$"):
        layout(EngineSpec("m", "cuda", data_parallel=4, tensor_parallel=2), cfg, GPUs(4, 80 * GIB))
    with pytest.raises(UserError, match=r"^the model \(131\.\d GiB of weights\) does not fit the 2 visible GPUs "):
        layout(EngineSpec("m", "cuda", data_parallel="auto", tensor_parallel="auto"), _cfg("llama-3.1-70b"),
               GPUs(2, 40 * GIB))
    for flag, value in (("--data-parallel", "0"), ("--tensor-parallel", "many"), ("--data-parallel", "-1")):
        with pytest.raises(UserError, match=f"^{flag} {value}: use a number of "):
            devices.check_count(flag, value)


def test_visible_gpus_follow_cuda_visible_devices(monkeypatch):
    monkeypatch.setattr(devices, "_nvml", lambda: (4, 80 * GIB))
    for seen, want in (("1,3", 2), ("", 0), ("0,-1,2", 1), ("0,1,2,3,4,5", 4), (None, 4)):
        if seen is None:
            monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        else:
            monkeypatch.setenv("CUDA_VISIBLE_DEVICES", seen)
        assert visible_gpus() == GPUs(want, 80 * GIB if want else None), seen


def test_a_small_job_runs_on_one_engine():
    """auto with the job's model work known (a cached scoring workload): one engine under SMALL_JOB_FLOPS,
    every GPU over it; tensor parallel as the model needs either way."""
    spec = EngineSpec("m", "auto", data_parallel="auto", tensor_parallel="auto")
    cfg = _cfg("qwen3-8b")
    assert layout(spec, cfg, GPUs(4, 80 * GIB), work=1e14) == (1, 1, "the model fits one GPU (15.3 GiB of weights); "
                                                               "1 worker: a small job (100 TFLOP of model work)")
    assert layout(spec, cfg, GPUs(4, 80 * GIB), work=devices.SMALL_JOB_FLOPS)[:2] == (4, 1)
    assert layout(EngineSpec("m", "cuda", data_parallel=4), cfg, GPUs(4, 80 * GIB), work=1e14)[:2] == (4, 1)
    assert layout(spec, _cfg("llama-3.1-70b"), GPUs(4, 141 * GIB), work=1e14)[:2] == (1, 2)


def test_more_workers_than_gpus_share_them_evenly(monkeypatch):
    """A number of workers beyond the GPUs (a multiple of them) puts as many on each GPU: each worker's process
    sees its GPU (`build.gpus`), and fits its pool and batch to its share of the GPU's free memory."""
    import torch

    from lmbatch.engine import build

    cfg = _cfg("qwen3-8b")
    assert layout(EngineSpec("m", "cuda", data_parallel=2), cfg, GPUs(1, 80 * GIB)) == \
        (2, 1, "asked for: 2 workers on 1 GPU, 2 a GPU")
    assert layout(EngineSpec("m", "cuda", data_parallel=8), cfg, GPUs(4, 80 * GIB))[:2] == (8, 1)
    with pytest.raises(UserError, match=r"^--data-parallel 3: 3 workers do not share 2 GPUs evenly \(use a multiple "
                                        r"of 2\)$"):
        layout(EngineSpec("m", "cuda", data_parallel=3), cfg, GPUs(2, 80 * GIB))
    with pytest.raises(UserError, match=r"^--data-parallel 2 x --tensor-parallel 2: 4 GPUs needed, 2 visible$"):
        layout(EngineSpec("m", "cuda", data_parallel=2, tensor_parallel=2), cfg, GPUs(2, 80 * GIB))
    monkeypatch.setattr(devices, "visible_gpus", lambda: GPUs(2, 80 * GIB))
    spec, _ = devices.resolved(EngineSpec("m", "auto", data_parallel=4), cfg)
    assert (spec.device, spec.workers, spec.gpu_share) == ("cuda", 4, 2)
    assert devices.resolved(EngineSpec("m", "auto", data_parallel=2), cfg)[0].gpu_share == 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,3")
    assert build.gpus(4, 2) == ["1", "3", "1", "3"] and build.gpus(2) == ["1", "3"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert build.gpus(6, 3) == ["0", "1", "0", "1", "0", "1"] and build.gpus(2) == ["0", "1"]
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (24 * GIB, 141 * GIB))
    one = build.default_kv_tokens(cfg, "cuda", "bfloat16"), build.default_batch_tokens(cfg, "cuda", "bfloat16")
    two = build.default_kv_tokens(cfg, "cuda", "bfloat16", 2), build.default_batch_tokens(cfg, "cuda", "bfloat16", 2)
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2
    assert (one[0], two[0]) == (24 * GIB // 2 // per_token, 24 * GIB // 2 // 2 // per_token)
    assert (one[1], two[1]) == (16384, 8192)    # 16,384 tokens' activations (1.8 GiB) fit a tenth of 24 GiB, not of 12


@pytest.mark.parametrize("preset, gpus, cores, stages, want", [
    ("qwen2.5-1.5b", GPUs(1, 141 * GIB), 16, 7, (4, 1, "4 workers: 1 GPU visible, 4 a GPU: 7 stages")),
    ("qwen2.5-1.5b", GPUs(1, 141 * GIB), 12, 7, (3, 1, "3 workers: 1 GPU visible, 3 a GPU: 7 stages")),
    ("qwen2.5-1.5b", GPUs(2, 141 * GIB), 64, 7, (8, 1, "8 workers: 2 GPUs visible, 4 a GPU: 7 stages")),
    ("qwen2.5-1.5b", GPUs(1, 12 * GIB), 16, 7, (2, 1, "2 workers: 1 GPU visible, 2 a GPU: 7 stages")),  # memory
    ("qwen2.5-1.5b", GPUs(4, 80 * GIB), 64, 3, (8, 1, "8 workers: 4 GPUs visible, 2 a GPU: 3 stages")),
    ("qwen2.5-1.5b", GPUs(4, 80 * GIB), 16, 7, (4, 1, "4 workers: 4 GPUs visible")),        # 2 cores a worker
    ("qwen2.5-1.5b", GPUs(1, 80 * GIB), 16, 2, (1, 1, "1 worker: 1 GPU visible")),          # thinking then JSON
    ("qwen2.5-1.5b", GPUs(1, 8 * GIB), 16, 7, (1, 1, "1 worker: 1 GPU visible")),           # two copies: 5.7 GiB
    ("qwen3-8b", GPUs(1, 141 * GIB), 16, 7, (1, 1, "1 worker: 1 GPU visible")),             # 15.3 GiB of weights
    ("qwen2.5-1.5b", GPUs(4, None), 64, 7, (4, 1, "4 workers: 4 GPUs visible")),            # memory not known
])
def test_a_host_bound_run_gets_several_workers_a_gpu(preset, gpus, cores, stages, want):
    """auto, for a run that generates (`graphs_ahead`) in HOST_BOUND_STAGES or more on a model of
    SMALL_MODEL_BYTES at most: up to GENERATING_SHARE workers on each GPU (SHARED_WORKERS in all) where their
    weights fit FIT_SHARE of it and the machine has CORES_A_WORKER cores for each; a run that only scores, a
    small job and a placement by Ray keep a worker a GPU."""
    spec = EngineSpec(str(PRESETS / preset), "auto", data_parallel="auto", tensor_parallel="auto", stages=stages)
    got = layout(spec, _cfg(preset), gpus, cores=cores)
    assert (got.data_parallel, got.tensor_parallel) == want[:2]
    assert got.why.endswith(want[2]), got.why
    scoring = layout(replace(spec, graphs_ahead=False), _cfg(preset), gpus, cores=cores)
    assert scoring.data_parallel == gpus.visible
    assert layout(spec, _cfg(preset), gpus, work=1e14, cores=cores).data_parallel == (1 if want[0] > 1 else want[0])
    asked = layout(replace(spec, data_parallel=gpus.visible), _cfg(preset), gpus, cores=cores)
    assert asked.data_parallel == gpus.visible


def test_workers_a_gpu_share_it(monkeypatch):
    """The layout auto picks for tree of thought on a small model and one GPU puts its workers on it, each with
    its share of its memory; as many as the cores allow (4 each), one without the cores for two."""
    import lmbatch.engine.threads as threads

    monkeypatch.setattr(devices, "visible_gpus", lambda: GPUs(1, 141 * GIB))
    monkeypatch.setattr(threads, "usable_cores", lambda: 16)
    spec = EngineSpec("m", "auto", data_parallel="auto", stages=7)
    got, why = devices.resolved(spec, _cfg("qwen2.5-1.5b"))
    assert (got.device, got.workers, got.gpu_share) == ("cuda", 4, 4), why
    monkeypatch.setattr(threads, "usable_cores", lambda: 8)
    got, why = devices.resolved(spec, _cfg("qwen2.5-1.5b"))
    assert (got.device, got.workers, got.gpu_share) == ("cuda", 2, 2), why
    monkeypatch.setattr(threads, "usable_cores", lambda: 4)
    got, why = devices.resolved(spec, _cfg("qwen2.5-1.5b"))
    assert (got.workers, got.gpu_share) == (1, 1), why


def test_tree_of_thought_is_a_run_of_several_stages(tmp_path):
    """`lmbatch run tot-gsm8k` asks for its 7 stages (3 levels of a proposal and a judgement, then the
    answer); a task of one stage, the default."""
    from lmbatch.options import RunOptions, engine_spec
    from lmbatch.programs.registry import get_workload

    tot, mmlu = get_workload("tot-gsm8k"), get_workload("mmlu")
    assert (tot.stages, mmlu.stages) == (7, 1)
    o = RunOptions.of(task="tot-gsm8k", model="m", out=tmp_path)
    assert engine_spec(o, tmp_path, tot.generates, tot.stages).stages == 7


def test_decode_rows_follow_the_models_size_and_the_runs_stages_on_a_gpu():
    """1,024 decode rows for a run of HOST_BOUND_STAGES or more on a model of SMALL_MODEL_BYTES at most on a GPU;
    512 for a run of fewer stages, a larger model and on the CPU; an engine built from options never fitted
    takes DECODE_ROWS, and one the caller sized keeps its own."""
    from lmbatch.engine import build
    from lmbatch.engine.options import DECODE_ROWS, SMALL_DECODE_ROWS, EngineOptions

    assert build.decode_rows(_cfg("qwen2.5-1.5b"), "cuda", "bfloat16", 7) == SMALL_DECODE_ROWS == 1024
    assert build.decode_rows(_cfg("qwen2.5-1.5b"), "cuda", "bfloat16", 1) == DECODE_ROWS == 512
    assert build.decode_rows(_cfg("qwen2.5-1.5b"), "cuda", "bfloat16", 2) == 512      # thinking then JSON
    assert build.decode_rows(_cfg("qwen2.5-1.5b"), "cpu", "float32", 7) == 512
    assert build.decode_rows(_cfg("qwen3-8b"), "cuda", "bfloat16", 7) == 512
    assert EngineOptions().max_running is None and EngineOptions(max_running=3).max_running == 3


def test_wide_rows_are_a_small_models_on_a_gpu():
    """1,024 rows for a stream of many generations on a model of SMALL_MODEL_BYTES at most on a GPU; else
    DECODE_ROWS. A stream takes them only from WIDE_FROM generations, scores not counted."""
    from types import SimpleNamespace

    from lmbatch.engine import build
    from lmbatch.engine.options import DECODE_ROWS, SMALL_DECODE_ROWS, WIDE_FROM
    from lmbatch.engine.stream import Stream
    from lmbatch.requests import GenerateRequest, SamplingParams, ScoreRequest

    assert build.wide_rows(_cfg("qwen2.5-1.5b"), "cuda", "bfloat16") == SMALL_DECODE_ROWS == 1024
    assert build.wide_rows(_cfg("qwen3-8b"), "cuda", "bfloat16") == DECODE_ROWS == 512
    assert build.wide_rows(_cfg("qwen2.5-1.5b"), "cpu", "float32") == DECODE_ROWS
    eng = SimpleNamespace(rows=512, wide_rows=1024)
    gen = GenerateRequest([1, 2], SamplingParams(max_new_tokens=4))
    score = ScoreRequest([1], [2])
    assert Stream.rows(eng, [gen] * WIDE_FROM) == 1024
    assert Stream.rows(eng, [gen] * (WIDE_FROM - 1) + [score] * 10) == 512
    assert Stream.rows(SimpleNamespace(rows=1024, wide_rows=1024), [gen] * 3) == 1024
