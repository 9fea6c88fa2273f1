"""config.json read without transformers equals what transformers reads.

A native model's config is parsed by our own code (`ModelConfig.from_dir`: the file over the defaults
transformers' config class would fill in, each entry's `defaults` in model/architectures.py, with what the
class derives from them), so a run imports no transformers. Each case below writes a config.json (saved by
transformers, or written by hand with fields left out) and compares our parse with
`ModelConfig.from_hf(AutoConfig...)`.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoConfig

from lmbatch.model.config import ARCHITECTURES, ModelConfig
from tests.conftest import TINY_CONFIGS

SIZES = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4)


def _both(folder: Path) -> tuple[ModelConfig, ModelConfig]:
    return ModelConfig.from_dir(folder), ModelConfig.from_hf(AutoConfig.from_pretrained(str(folder)))


def _write(folder: Path, raw: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(raw))
    return folder


@pytest.mark.parametrize("kind", list(TINY_CONFIGS))
def test_saved_configs(kind, tmp_path):
    """Every family's config as transformers saves it (the parity tests' tiny models)."""
    TINY_CONFIGS[kind]().save_pretrained(tmp_path)
    ours, theirs = _both(tmp_path)
    assert ours == theirs


@pytest.mark.parametrize("kind", list(ARCHITECTURES))
def test_minimal_configs(kind, tmp_path):
    """Only the sizes given: every other field is the class's default (Qwen2's 32 KV heads, Qwen3's head_dim
    128, Gemma's 256, tied embeddings for Gemma, Mixtral's RoPE base, the default layer types)."""
    ours, theirs = _both(_write(tmp_path, {"model_type": kind, **SIZES}))
    assert ours == theirs


VARIANTS = {
    "llama-v4-rope": {"model_type": "llama", **SIZES, "rope_theta": 500000.0, "tie_word_embeddings": True,
                      "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
    "llama-linear-type-key": {"model_type": "llama", **SIZES, "rope_scaling": {"type": "linear", "factor": 2.0}},
    "llama-eos-list": {"model_type": "llama", **SIZES, "eos_token_id": [2, 7], "num_key_value_heads": 2},
    "qwen2-sliding": {"model_type": "qwen2", **SIZES, "use_sliding_window": True, "sliding_window": 32,
                      "max_window_layers": 3, "num_key_value_heads": 2},
    "qwen2-window-unused": {"model_type": "qwen2", **SIZES, "use_sliding_window": False, "sliding_window": 32},
    "qwen3-head-dim": {"model_type": "qwen3", **SIZES, "head_dim": 24, "rope_theta": 1000000.0},
    "qwen3_moe-sparse-step": {"model_type": "qwen3_moe", **SIZES, "decoder_sparse_step": 2, "num_experts": 4,
                              "num_experts_per_tok": 2, "mlp_only_layers": [1]},
    "mistral-no-window": {"model_type": "mistral", **SIZES, "sliding_window": None},
    "mixtral-window": {"model_type": "mixtral", **SIZES, "sliding_window": 16, "num_local_experts": 4},
    "phi3-kv": {"model_type": "phi3", **SIZES, "num_key_value_heads": 2, "sliding_window": 20},
    "gemma2-no-caps": {"model_type": "gemma2", **SIZES, "attn_logit_softcapping": None,
                       "final_logit_softcapping": None, "head_dim": 16},
    "gemma3-pattern-v4-rope": {"model_type": "gemma3_text", **SIZES, "head_dim": 16, "sliding_window_pattern": 3,
                               "rope_theta": 500000.0, "rope_local_base_freq": 20000.0,
                               "rope_scaling": {"rope_type": "linear", "factor": 8.0}},
    "gemma3-layer-types": {"model_type": "gemma3_text", **SIZES, "head_dim": 16,
                           "layer_types": ["full_attention", "sliding_attention"] * 3},
    # v4 rope_scaling: the full layers' only; YaRN's attention factor and betas filled in
    "olmo3-v4-yarn": {"model_type": "olmo3", **SIZES, "sliding_window": 16, "max_position_embeddings": 4096,
                      "rope_scaling": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512}},
    "smollm3-nope-list-window-off": {"model_type": "smollm3", **SIZES, "no_rope_layers": [1, 0, 1, 1, 0, 1],
                                     "sliding_window": 16},
    "smollm3-interval-window": {"model_type": "smollm3", **SIZES, "no_rope_layer_interval": 3,
                                "use_sliding_window": True, "sliding_window": 16},
    # gpt-oss-20b's config.json as published (v4 RoPE fields, YaRN without truncation), its sizes shrunk
    "gpt_oss-hub": {"model_type": "gpt_oss", **SIZES, "num_hidden_layers": 4, "attention_bias": True, "head_dim": 16,
                    "num_key_value_heads": 2, "num_local_experts": 8, "num_experts_per_tok": 4, "sliding_window": 128,
                    "experts_per_token": 4, "initial_context_length": 4096, "eos_token_id": 200002,
                    "layer_types": ["sliding_attention", "full_attention"] * 2, "max_position_embeddings": 131072,
                    "rope_theta": 150000, "swiglu_limit": 7.0, "rope_scaling": {
                        "beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                        "rope_type": "yarn", "truncate": False}},
    # DeepSeek-V3's config.json as published (v4 YaRN with mscale, "type" key, MTP layer count), sizes shrunk
    "deepseek_v3-hub": {"model_type": "deepseek_v3", **SIZES, "num_key_value_heads": 4, "q_lora_rank": 24,
                        "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
                        "n_routed_experts": 16, "n_group": 4, "topk_group": 2, "first_k_dense_replace": 3,
                        "moe_layer_freq": 1, "num_nextn_predict_layers": 1, "topk_method": "noaux_tc",
                        "scoring_func": "sigmoid", "max_position_embeddings": 163840, "rope_theta": 10000,
                        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                                         "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                                         "type": "yarn"}},
    "deepseek_v3-no-q-lora": {"model_type": "deepseek_v3", **SIZES, "q_lora_rank": None, "kv_lora_rank": 32,
                              "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "n_group": 1,
                              "topk_group": 1, "n_routed_experts": 8, "rope_interleave": False},
    "olmo3-layer-types": {"model_type": "olmo3", **SIZES, "layer_types": ["full_attention", "sliding_attention"] * 3,
                          "rope_theta": 10000.0},
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_variants(name, tmp_path):
    """Fields older configs (transformers v4) and hub configs write: rope_theta and rope_scaling apart, a "type"
    key, EOS lists, Qwen's sliding windows, Gemma 3's window pattern and local RoPE base."""
    ours, theirs = _both(_write(tmp_path, VARIANTS[name]))
    assert ours == theirs


def test_the_embedded_models_config():
    """The GGUF conversion's config.json (the embedded default model)."""
    from lmbatch.model.checkpoint import resolve_model

    ours, theirs = _both(resolve_model(None))
    assert ours == theirs and ours.model_type == "llama"


def test_a_difference_is_seen(tmp_path):
    """The comparison can fail: a field our parse reads differs from transformers' default when left out."""
    folder = _write(tmp_path, {"model_type": "qwen2", **SIZES})
    ours, theirs = _both(folder)
    assert ours.num_kv_heads == theirs.num_kv_heads == 32      # Qwen2Config's default, not the heads (4)
