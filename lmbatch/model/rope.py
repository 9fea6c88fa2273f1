"""Rotary position embeddings' parameters as transformers reads them from a config (v4's and v5's fields, one
set or one per layer type; linear, Llama 3 and YaRN scaling, YaRN's defaults and derived factors filled in),
and YaRN's frequencies and attention factor."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from lmbatch.model.architectures import Architecture

if TYPE_CHECKING:
    import torch


ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_parameters(hf: Any, arch: Architecture) -> tuple[float, dict, float | None]:
    """(base, scaling parameters, base of sliding layers where they differ or are left unscaled): from
    transformers v5's `rope_parameters` (one dict, or one per layer type as Gemma 3 and OLMo 3 have) or
    v4's `rope_theta`, `rope_scaling` and `rope_local_base_freq`. Scaling parameters come out whole (YaRN's
    defaults and derived factors filled in as transformers' `_compute_yarn_parameters` fills them), so
    that a config.json and AutoConfig's reading of it compare equal."""
    params = dict(getattr(hf, "rope_parameters", None) or {})
    local, nested = None, "full_attention" in params
    if nested:                               # per layer type
        sliding = params.get("sliding_attention") or {}
        if sliding.get("rope_type", sliding.get("type", "default")) != "default":
            raise ValueError("sliding-window layers with a scaled RoPE are not supported")
        local = sliding.get("rope_theta")
        params = dict(params["full_attention"] or {})
    theta = params.pop("rope_theta", None) or getattr(hf, "rope_theta", None) or 10000.0
    if not params:
        params = dict(getattr(hf, "rope_scaling", None) or {})
    local = local or getattr(hf, "rope_local_base_freq", None)
    if arch.rope_per_layer_type and not nested:     # v4 fields, as the config class nests them: scaling on full
        defaults = arch.defaults                    # layers; sliding ones at their own base, else the default
        local = local or defaults.get("rope_local_base_freq") or defaults["rope_theta"]   # (not config.json's)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} is not supported ({', '.join(ROPE_TYPES)})")
    scaling = {k: v for k, v in params.items() if k not in ("type", "partial_rotary_factor")}
    scaling["rope_type"] = rope_type
    if rope_type in ("llama3", "yarn"):
        own = getattr(hf, "original_max_position_embeddings", None) if not nested else None
        scaling["original_max_position_embeddings"] = own or scaling.get("original_max_position_embeddings") \
            or hf.max_position_embeddings
    if rope_type == "yarn":
        scaling = _yarn(scaling, hf.max_position_embeddings, nested)
    if local is not None and float(local) == float(theta) and rope_type == "default":
        local = None                         # sliding layers rotate as the others
    return float(theta), (scaling if rope_type != "default" else {}), (float(local) if local else None)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(s: dict, max_positions: int, nested: bool) -> dict:
    """YaRN's parameters as transformers reads them: the factor (else max over original positions), the
    attention factor (else from the factor and DeepSeek's mscale / mscale_all_dim), beta_fast and
    beta_slow (32 and 1), `truncate` (true; read from the outer dict, so always true per layer type)."""
    original = s["original_max_position_embeddings"]
    factor = s.get("factor") or max_positions / original
    attention = s.get("attention_factor")
    if attention is None:
        mscale, all_dim = s.get("mscale"), s.get("mscale_all_dim")
        attention = yarn_mscale(factor, mscale) / yarn_mscale(factor, all_dim) if mscale and all_dim else \
            yarn_mscale(factor)
    return {**s, "factor": float(factor), "attention_factor": float(attention),
            "beta_fast": float(s.get("beta_fast") or 32), "beta_slow": float(s.get("beta_slow") or 1),
            "truncate": True if nested else bool(s.get("truncate", True))}


def yarn_inv_freq(inv: torch.Tensor, d: int, theta: float, s: dict) -> torch.Tensor:
    """YaRN's frequencies: interpolated (divided by the factor) below the correction range, kept above it,
    a linear ramp between (transformers' `_compute_yarn_parameters`)."""
    import torch

    def dim_of(rotations: float) -> float:
        return d * math.log(s["original_max_position_embeddings"] / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(s["beta_fast"]), dim_of(s["beta_slow"])
    if s["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(d // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp
    return inv / s["factor"] * (1 - keep) + inv * keep
