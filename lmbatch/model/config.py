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

    @classmethod
    def from_hf(cls, hf) -> "ModelConfig":
        """Build from a transformers PretrainedConfig (v4 `rope_theta`/`rope_scaling` or v5 `rope_parameters`)."""
        rope = dict(getattr(hf, "rope_parameters", None) or {})
        theta = rope.pop("rope_theta", None) or getattr(hf, "rope_theta", None) or 10000.0
        if not rope:
            rope = dict(getattr(hf, "rope_scaling", None) or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "llama3"):
            raise ValueError(f"rope type {rope_type!r} is not supported (default, llama3)")
        heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
        eos = hf.eos_token_id
        eos = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        return cls(
            model_type=hf.model_type,
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
            qkv_bias=hf.model_type == "qwen2" or bool(getattr(hf, "attention_bias", False)),
            rope_scaling={k: v for k, v in rope.items() if k != "type"} if rope_type == "llama3" else {},
            eos_token_ids=eos,
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
