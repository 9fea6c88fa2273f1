"""Our forward pass over the paged KV pool against transformers' own model, float32."""
import dataclasses

import pytest
import torch
from conftest import make_tiny_hf

from lmbatch.attention.base import ForwardBatch
from lmbatch.attention.kv_pool import KVPool, LatentKVPool
from lmbatch.attention.torch_ref import TorchBackend
from lmbatch.model.config import ModelConfig
from lmbatch.model.network import Transformer
from lmbatch.model.weights import load_weights

TOL = 1e-4


def _ours(path, **change):
    """Our model of the checkpoint, its config changed by `change` (ModelConfig fields)."""
    cfg = dataclasses.replace(ModelConfig.from_dir(path), **change)
    model = Transformer(cfg)
    load_weights(model, path)
    pool = (LatentKVPool if cfg.keys_are_values else KVPool)(256, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
                                                              torch.float32, "cpu")
    return model.eval(), TorchBackend(pool, cfg.num_heads, cfg.head_dim, cfg.attn_scale, cfg.attn_softcap), pool


def _step(model, attn, ids, start, slots):
    """Run ids at positions start.. with KV slots[:start+len(ids)]; logits for every new token."""
    n = len(ids)
    kv = slots[: start + n]
    batch = ForwardBatch(torch.tensor(ids), torch.arange(start, start + n), kv[start:], [0, n], [0, len(kv)], kv,
                         torch.arange(n))
    with torch.no_grad():
        return model(batch, attn)


def _hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def test_full_prefill(tiny_model):
    _, path, hf = tiny_model
    model, attn, pool = _ours(path)
    ids = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    slots = torch.randperm(256)[:40]  # scattered slots: paging must not depend on contiguity
    diff = (_step(model, attn, ids, 0, slots) - _hf_logits(hf, ids)).abs().max()
    assert diff < TOL, diff


def test_extend_on_cached_prefix(tiny_model):
    _, path, hf = tiny_model
    model, attn, pool = _ours(path)
    ids = torch.randint(0, 128, (50,), generator=torch.Generator().manual_seed(2)).tolist()
    slots = torch.randperm(256)[:50]
    _step(model, attn, ids[:30], 0, slots)          # cache the prefix
    ext = _step(model, attn, ids[30:], 30, slots)   # extend: 20 new tokens over 30 cached
    diff = (ext - _hf_logits(hf, ids)[30:]).abs().max()
    assert diff < TOL, diff


def test_eight_decode_steps(tiny_model):
    _, path, hf = tiny_model
    model, attn, pool = _ours(path)
    ids = torch.randint(0, 128, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    slots = torch.randperm(256)[:28]
    logits = _step(model, attn, ids, 0, slots)
    for _ in range(8):
        ids.append(int(logits[-1].argmax()))
        logits = _step(model, attn, ids[-1:], len(ids) - 1, slots)
        diff = (logits[-1] - _hf_logits(hf, ids)[-1]).abs().max()
        assert diff < TOL, diff


@pytest.mark.parametrize("kind,change", [
    ("mistral", {"layer_windows": ()}),
    ("gemma2", {"layer_windows": ()}), ("gemma2", {"attn_softcap": 0.0}), ("gemma2", {"final_softcap": 0.0}),
    ("gemma2", {"norm_offset": 0.0}), ("gemma2", {"embed_scale": 1.0}), ("gemma2", {"attn_scale": None}),
    ("gemma2", {"activation": "silu"}),
    ("gemma3_text", {"local_rope_theta": None}), ("gemma3_text", {"rope_scaling": {}}),
    ("smollm3", {"nope_layers": ()}), ("smollm3", {"layer_windows": ()}),
    ("glm4_moe", {"routed_scaling_factor": 1.0}), ("glm4_moe", {"n_group": 1}), ("glm4_moe", {"rotary_dim": 0}),
    ("gpt_oss", {"swiglu_limit": 100.0}), ("gpt_oss", {"rope_scaling": {}}), ("gpt_oss", {"layer_windows": ()}),
    ("deepseek_v3", {"rope_interleaved": False}), ("deepseek_v3", {"attn_scale": None}),
    ("deepseek_v3", {"rope_scaling": {}}),
    ("olmo3", {"layer_windows": ()}), ("olmo3", {"local_rope_theta": None}), ("olmo3", {"rope_scaling": {}}),
])
def test_each_delta_matters(kind, change, tmp_path):
    """The parity tests can fail: dropping any one of an architecture's deltas from its config breaks
    agreement with transformers on a 40-token prompt (longer than the windows)."""
    hf = make_tiny_hf(kind, tmp_path)
    model, attn, _ = _ours(tmp_path, **change)
    ids = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(4)).tolist()
    diff = (_step(model, attn, ids, 0, torch.arange(40)) - _hf_logits(hf, ids)).abs().max()
    assert diff > 100 * TOL, diff


def test_attention_sinks_matter(tmp_path):
    """gpt-oss's sinks (a parameter, not a config field): sinks that weigh nothing break the agreement."""
    hf = make_tiny_hf("gpt_oss", tmp_path)
    model, attn, _ = _ours(tmp_path)
    for layer in model.layers:
        layer.self_attn.sinks.data.fill_(-1e4)
    ids = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(4)).tolist()
    diff = (_step(model, attn, ids, 0, torch.arange(40)) - _hf_logits(hf, ids)).abs().max()
    assert diff > 100 * TOL, diff


def test_attention_backends_for_sinks_and_latent_attention(tmp_path):
    """On CUDA in bf16 a gpt-oss model attends with Triton (its kernels have the sink term), never FlashInfer or
    the cascade kernel (they have none: asking is one line); a DeepSeek model with the torch backend (latent
    attention has no GPU kernel yet), said in the summary's reason."""
    from lmbatch.engine.build import pick_attention
    from lmbatch.errors import UserError

    make_tiny_hf("gpt_oss", tmp_path / "oss")
    cfg = ModelConfig.from_dir(tmp_path / "oss")
    assert pick_attention("auto", "cuda", "bfloat16", cfg) == ("triton", "attention sinks (gpt-oss): Triton's "
                                                                "kernels have them")
    assert pick_attention("triton", "cuda", "bfloat16", cfg).name == "triton"
    for wanted in ("flashinfer", "cascade"):
        with pytest.raises(UserError, match=f"--attention {wanted}: gpt_oss has attention sinks"):
            pick_attention(wanted, "cuda", "bfloat16", cfg)
    make_tiny_hf("deepseek_v3", tmp_path / "ds")
    cfg = ModelConfig.from_dir(tmp_path / "ds")
    assert pick_attention("auto", "cuda", "bfloat16", cfg) == ("torch", "latent attention (MLA): the GPU attention "
                                                                "kernels have no latent path yet")
    with pytest.raises(UserError, match="--attention triton: deepseek_v3 has latent attention"):
        pick_attention("triton", "cuda", "bfloat16", cfg)


@pytest.mark.parametrize("variant", [
    {"q_lora_rank": None, "rope_interleave": False},       # a plain q projection, RoPE on halves
    {"attention_bias": True, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
])
def test_latent_attention_variants(variant, tmp_path):
    """DeepSeek's other layouts: without q LoRA (DeepSeek-V2-Lite's), with the attention biases, unscaled RoPE;
    prefill, then an extension over the cached latent."""
    hf = make_tiny_hf("deepseek_v3", tmp_path, **variant)
    model, attn, _ = _ours(tmp_path)
    ids = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    slots = torch.randperm(256)[:40]
    want = _hf_logits(hf, ids)
    assert (_step(model, attn, ids[:25], 0, slots) - want[:25]).abs().max() < TOL
    assert (_step(model, attn, ids[25:], 25, slots) - want[25:]).abs().max() < TOL


def test_latent_attention_pool_holds_one_entry_per_token(tmp_path):
    """The pool of a latent-attention model holds kv_lora_rank + qk_rope_head_dim numbers per token and layer,
    once (its values are its keys): 40 here, against 2 x heads x (nope + rope) = 192 that expanded keys and
    values of the same model would take."""
    make_tiny_hf("deepseek_v3", tmp_path)
    cfg = ModelConfig.from_dir(tmp_path)
    assert cfg.keys_are_values
    pool = LatentKVPool(16, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
    assert pool.v is pool.k and pool.k.shape == (3, 16, 1, 32 + 8)


@pytest.mark.parametrize("kind", ["llama", "olmo3", "gemma3_text", "smollm3"])
def test_attention_bias_includes_the_output_projection(kind, tmp_path):
    """attention_bias gives these families' output projection a bias too, as transformers builds them."""
    hf = make_tiny_hf(kind, tmp_path, attention_bias=True)
    assert hf.model.layers[0].self_attn.o_proj.bias is not None
    model, attn, _ = _ours(tmp_path)
    ids = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(6)).tolist()
    diff = (_step(model, attn, ids, 0, torch.randperm(256)[:40]) - _hf_logits(hf, ids)).abs().max()
    assert diff < TOL, diff
