"""The decode graphs' kernels compiled ahead (engine/precompile.py): which layers a helper builds, and the
helpers' lifetime around the engine's load (their kernels against the engine's: tests/gpu)."""
from dataclasses import replace

import pytest
from conftest import make_tiny_hf

from lmbatch.engine import precompile
from lmbatch.engine.options import EngineOptions, EngineSpec
from lmbatch.model.checkpoint import model_config


@pytest.mark.parametrize("kind, layers, want", [
    ("llama", 4, 1),            # every layer alike
    ("gemma3_text", 6, 2),      # sliding and global layers
    ("deepseek_v3", 4, 2),      # dense first layers, then routed experts
    ("smollm3", 2, 2),          # a NoPE layer and a RoPE one
])
def test_a_helper_builds_one_layer_of_each_kind(tmp_path, kind, layers, want):
    over = {"num_hidden_layers": layers} if kind != "smollm3" else {}     # its NoPE layers are fixed at init
    if kind == "gemma3_text":
        over["layer_types"] = ["sliding_attention"] * 5 + ["full_attention"]
    if kind == "deepseek_v3":
        over["first_k_dense_replace"] = 2
    make_tiny_hf(kind, tmp_path, **over)
    cfg = model_config(tmp_path)
    small = precompile.few_layers(cfg)
    assert small.num_layers == want
    kinds = {(w, n, s) for w, n, s in zip(cfg.layer_windows or [None] * layers, cfg.nope_layers or [None] * layers,
                                         cfg.sparse_layers or [None] * layers)}
    small_kinds = [(w, n, s) for w, n, s in zip(small.layer_windows or [None] * want,
                                                small.nope_layers or [None] * want,
                                                small.sparse_layers or [None] * want)]
    assert len(small_kinds) == len(set(small_kinds)) and set(small_kinds) == kinds
    assert replace(small, num_layers=cfg.num_layers, layer_windows=cfg.layer_windows, nope_layers=cfg.nope_layers,
                   sparse_layers=cfg.sparse_layers, mtp_layers=cfg.mtp_layers) == cfg


def test_helpers_end_when_the_engine_wants_no_graphs(tmp_path, monkeypatch):
    """Helpers told of an engine without decode graphs on a GPU (on the CPU; with the torch backend) end at
    once, and so do helpers never told anything (their input closed: the engine's process went)."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    make_tiny_hf("llama", tmp_path)
    cpu = EngineSpec(str(tmp_path), "cpu", "float32", EngineOptions())
    assert not precompile.wanted(cpu, True)
    gpu = replace(cpu, device="cuda")
    monkeypatch.setattr(precompile, "gpu_present", lambda: True)
    monkeypatch.setenv("LMBATCH_PRECOMPILE", "2")
    assert precompile.wanted(gpu, True) and not precompile.wanted(gpu, False)     # a run that only scores: none
    monkeypatch.delenv("LMBATCH_PRECOMPILE")
    helpers = precompile.Precompile(cpu, count=2)
    procs = list(helpers.procs)
    assert len(procs) == 2
    helpers.go(cpu, model_config(tmp_path))
    assert helpers.procs == [] and all(p.poll() is not None for p in procs)
    torch_attention = replace(cpu, device="cuda", dtype="bfloat16", options=EngineOptions(attention="torch"))
    helpers = precompile.Precompile(cpu, count=1)    # a CUDA engine whose backend runs no decode graphs
    procs = list(helpers.procs)
    helpers.go(torch_attention, model_config(tmp_path))
    assert helpers.procs == [] and all(p.poll() is not None for p in procs)
    failing = replace(torch_attention, options=EngineOptions(attention="triton"))
    helpers = precompile.Precompile(cpu, count=1)    # no GPU here: its free memory cannot be read, and no error escapes
    procs = list(helpers.procs)
    helpers.go(failing, model_config(tmp_path))
    assert helpers.procs == [] and all(p.poll() is not None for p in procs)
    idle = precompile.Precompile(cpu, count=1)
    p = idle.procs[0]
    assert p.stdin is not None
    p.stdin.close()         # as when the engine's process ends
    assert p.wait(timeout=120) == 0


def test_no_helpers_once_an_engine_of_the_spec_captured_its_graphs(tmp_path, monkeypatch):
    """`captured` marks Triton's cache for the spec: a later load of it starts no helper; another spec (other
    options, another model's config) or another cache still does."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    make_tiny_hf("llama", tmp_path / "a")
    make_tiny_hf("llama", tmp_path / "b", num_hidden_layers=3)
    spec = EngineSpec(str(tmp_path / "a"), "cuda", "bfloat16", EngineOptions())
    first = precompile.Precompile(spec, count=1)
    assert len(first.procs) == 1
    first.close()
    first.captured()
    assert first.marker is not None and first.marker.is_relative_to(tmp_path / "triton")
    assert precompile.Precompile(spec, count=1).procs == []
    others = [replace(spec, options=EngineOptions(attention="cascade")), replace(spec, model_dir=str(tmp_path / "b"))]
    for other in others:
        helpers = precompile.Precompile(other, count=1)
        assert len(helpers.procs) == 1, other
        helpers.close()
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "fresh"))
    helpers = precompile.Precompile(spec, count=1)
    assert len(helpers.procs) == 1
    helpers.close()


def test_helpers_take_a_small_share_of_the_gpu(tmp_path):
    """As many helpers as a twentieth of the free memory holds (a helper: its CUDA context and a model of
    one layer and a small vocabulary), none where the engine's weights leave too little beside its pool."""
    import torch

    make_tiny_hf("llama", tmp_path, vocab_size=1000)
    cfg = model_config(tmp_path)
    small = precompile.helper_config(cfg)
    assert small.vocab_size % 16 == cfg.vocab_size % 16 and small.vocab_size < cfg.vocab_size
    gb = 1 << 30
    assert precompile.affordable(cfg, torch.bfloat16, 80 * gb) == 3        # 4 GB over a GB each
    assert precompile.affordable(cfg, torch.bfloat16, 140 * gb) == 6
    big = replace(cfg, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
                  head_dim=128, vocab_size=128256)
    assert precompile.affordable(big, torch.bfloat16, 80 * gb) == 2        # 4 GB over 1.4 GB each (8B shape)
    assert precompile.affordable(big, torch.bfloat16, 24 * gb) == 0        # 16 GB of weights beside a 12 GB pool


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe", "gemma3_text"])
def test_the_weight_estimate_is_the_models_projections_and_embeddings(tmp_path, kind):
    """`weight_count` (from the config alone) against the model built on the meta device: every parameter but
    norms and biases."""
    import torch

    from lmbatch.model.network import Transformer

    make_tiny_hf(kind, tmp_path)
    cfg = model_config(tmp_path)
    model = Transformer.empty(cfg, "meta", torch.float32)
    want = sum(p.numel() for name, p in model.named_parameters() if "norm" not in name and "bias" not in name)
    assert precompile.weight_count(cfg) == want


@pytest.mark.parametrize("cores, engines, env, want", [
    (16, 1, None, 8), (64, 4, None, 8), (16, 2, None, 4), (2, 1, None, 1), (64, 1, None, 8), (16, 1, "0", 0),
    (16, 4, "3", 3),
])
def test_how_many_helpers_an_engine_starts(monkeypatch, cores, engines, env, want):
    """One helper for two of an engine's share of the cores, 8 at most; $LMBATCH_PRECOMPILE decides where set."""
    monkeypatch.setattr(precompile.os, "cpu_count", lambda: cores)
    if env is None:
        monkeypatch.delenv("LMBATCH_PRECOMPILE", raising=False)
    else:
        monkeypatch.setenv("LMBATCH_PRECOMPILE", env)
    assert precompile.helpers(engines) == want
