"""Model shape read from a Hugging Face config: the few numbers our forward pass needs."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


# model_type -> what it is: the decoder-only families whose forward pass network.py implements
ARCHITECTURES = {
    "llama": "Llama",
    "qwen2": "Qwen2 (q/k/v biases)",
    "qwen3": "Qwen3 (per-head q/k RMSNorm)",
    "qwen3_moe": "Qwen3-MoE (q/k norm, routed experts)",
    "mistral": "Mistral (sliding-window attention)",
    "mixtral": "Mixtral (routed experts, sliding window)",
    "phi3": "Phi-3 (fused qkv and gate/up weights)",
    "olmo2": "OLMo 2 (norms after attention and MLP, q/k norm over the projections)",
}


def _layer_windows(hf) -> tuple[int | None, ...]:
    """Each layer's sliding window: transformers' `layer_types` where the config has them; else the
    config's `sliding_window` for every layer (mistral, mixtral, phi3), unless `use_sliding_window` is off."""
    window = getattr(hf, "sliding_window", None)
    layer_types = getattr(hf, "layer_types", None)
    if layer_types:
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    if not window or getattr(hf, "use_sliding_window", True) is False:
        return ()
    return (int(window),) * hf.num_hidden_layers


def _sparse_layers(hf, experts: int) -> tuple[bool, ...]:
    """Which layers route to experts: every one for mixtral; for qwen3_moe those not in `mlp_only_layers`
    at every `decoder_sparse_step`-th layer."""
    if not experts:
        return ()
    only_mlp = set(getattr(hf, "mlp_only_layers", None) or [])
    step = int(getattr(hf, "decoder_sparse_step", 1) or 1)
    return tuple(i not in only_mlp and (i + 1) % step == 0 for i in range(hf.num_hidden_layers))


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    rope_scaling: dict = field(default_factory=dict)
    eos_token_ids: tuple[int, ...] = ()
    # the architectures' deltas from Llama (see ARCHITECTURES)
    qk_norm: str = ""           # "head": RMSNorm of each head's q and k (qwen3); "proj": of the projections (olmo2)
    norm_layout: str = "pre"    # "pre": norm before attention and MLP (llama); "post": after each (olmo2)
    layer_windows: tuple[int | None, ...] = ()  # per layer: keys a query sees (itself included), None: all
    num_experts: int = 0            # routed experts of a sparse MLP (0: dense model)
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True     # renormalize the top-k routing weights to sum to one
    router_weights_in_model_dtype: bool = True   # qwen3_moe rounds routing weights to the model dtype; mixtral does not
    sparse_layers: tuple[bool, ...] = ()         # per layer: MLP is the routed experts (else dense)

    @classmethod
    def from_hf(cls, hf) -> "ModelConfig":
        """Build from a transformers PretrainedConfig (v4 `rope_theta`/`rope_scaling` or v5 `rope_parameters`)."""
        kind = hf.model_type
        if kind not in ARCHITECTURES:
            raise ValueError(f"model_type {kind!r} is not supported natively ({', '.join(ARCHITECTURES)})")
        rope = dict(getattr(hf, "rope_parameters", None) or {})
        theta = rope.pop("rope_theta", None) or getattr(hf, "rope_theta", None) or 10000.0
        if not rope:
            rope = dict(getattr(hf, "rope_scaling", None) or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "llama3"):
            raise ValueError(f"rope type {rope_type!r} is not supported (default, llama3)")
        if rope.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", 1.0)) != 1.0:
            raise ValueError("partial rotary embeddings are not supported")
        heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
        eos = hf.eos_token_id
        eos = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        experts = int(getattr(hf, "num_experts", None) or getattr(hf, "num_local_experts", None) or 0)
        return cls(
            model_type=kind,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            rms_norm_eps=hf.rms_norm_eps,
            rope_theta=float(theta),
            max_position_embeddings=hf.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            qkv_bias=kind == "qwen2" or bool(getattr(hf, "attention_bias", False)),
            rope_scaling={k: v for k, v in rope.items() if k != "type"} if rope_type == "llama3" else {},
            eos_token_ids=eos,
            qk_norm={"qwen3": "head", "qwen3_moe": "head", "olmo2": "proj"}.get(kind, ""),
            norm_layout="post" if kind == "olmo2" else "pre",
            layer_windows=_layer_windows(hf),
            num_experts=experts,
            experts_per_token=int(getattr(hf, "num_experts_per_tok", 0) or 0) if experts else 0,
            moe_intermediate_size=int(getattr(hf, "moe_intermediate_size", None) or hf.intermediate_size)
            if experts else 0,
            norm_topk_prob=bool(getattr(hf, "norm_topk_prob", True)) if kind != "mixtral" else True,
            router_weights_in_model_dtype=kind != "mixtral",
            sparse_layers=_sparse_layers(hf, experts),
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelConfig":
        from transformers import AutoConfig

        return cls.from_hf(AutoConfig.from_pretrained(str(path)))

    @classmethod
    def shape_from_json(cls, path: str | Path) -> "ModelConfig":
        """The shape (sizes, context length) from config.json alone, without importing transformers
        (seconds: it imports torch), for the host's side of a run; `from_dir` where the file leaves a
        field to transformers' defaults. Fields a config class may default differently (tied
        embeddings) are not to be trusted from this."""
        try:
            raw = json.loads((Path(path) / "config.json").read_text())
            return cls.from_hf(SimpleNamespace(**raw))
        except (OSError, ValueError, AttributeError, TypeError):
            return cls.from_dir(path)

    def inv_freq(self) -> torch.Tensor:
        """RoPE inverse frequencies in float64, with llama3 scaling when configured."""
        import torch

        d = self.head_dim
        inv = 1.0 / (self.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        if not self.rope_scaling:
            return inv
        s = self.rope_scaling
        factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        old_len = s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        lo_wavelen, hi_wavelen = old_len / lo, old_len / hi
        smooth = (old_len / wavelen - lo) / (hi - lo)
        mid = (1 - smooth) * inv / factor + smooth * inv
        out = torch.where(wavelen > lo_wavelen, inv / factor, inv)
        is_mid = (wavelen >= hi_wavelen) & (wavelen <= lo_wavelen)
        return torch.where(is_mid, mid, out)
