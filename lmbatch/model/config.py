"""Model shape read from a Hugging Face config: the few numbers our forward pass needs."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from lmbatch.model.architectures import ARCHITECTURES, Architecture, experts_of
from lmbatch.model.rope import rope_parameters, yarn_inv_freq, yarn_mscale

if TYPE_CHECKING:
    import torch


ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}

# the sizes the weights' shapes follow from: a native model's config.json must give them, as every saved
# config does (transformers would fill in its config class's defaults, Llama's those of a 7B model, and
# the weights would fail to load only after the data was loaded and tokenized)
REQUIRED_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
# config.json fields that are integers or numbers where a config gives them (GPT-2's names for sizes too)
_INTEGER_FIELDS = REQUIRED_SIZES + (
    "num_key_value_heads", "head_dim", "max_position_embeddings", "sliding_window", "num_experts",
    "num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step",
    "n_embd", "n_layer", "n_head", "n_inner", "n_positions", "n_ctx")
_NUMBER_FIELDS = ("rms_norm_eps", "rope_theta", "layer_norm_eps", "layer_norm_epsilon")


def _with_defaults(raw: dict) -> dict:
    """config.json's fields over what transformers 5 fills in for those it leaves out (its architecture's
    `defaults`, so that config.json is read without importing transformers: seconds, it imports torch;
    tests/unit/test_config_parse.py compares this parse with AutoConfig's on every family), with what
    the config class derives from them (transformers' `__post_init__`s): KV heads, layer types, Qwen's
    sliding window."""
    arch = ARCHITECTURES[raw["model_type"]]
    c = {**arch.defaults, **raw}
    for alias, name in (("num_experts", "num_local_experts"), ("n_routed_experts", "num_local_experts"),
                        ("num_mtp_layers", "num_nextn_predict_layers")):    # the config classes' attribute_map
        if alias in c:
            c[name] = c.pop(alias)
    if c.get("num_key_value_heads") is None:
        c["num_key_value_heads"] = c["num_attention_heads"]
    if arch.sliding_switch and not c.get("use_sliding_window"):
        c["sliding_window"] = None
    if arch.nope_every and c.get("no_rope_layers") is None:     # 1: the layer rotates; 0: NoPE
        every = c.get("no_rope_layer_interval") or arch.nope_every
        c["no_rope_layers"] = [int((i + 1) % every != 0) for i in range(c["num_hidden_layers"])]
    if arch.layer_types and c.get("layer_types") is None:
        c["layer_types"] = _layer_types(arch, c)
    for name in arch.null_is_default:
        if c.get(name) is None:
            c[name] = arch.defaults[name]
    return c


def _layer_types(arch: Architecture, c: dict) -> list[str]:
    """Each layer's type as the config class derives it: Qwen's sliding layers from `max_window_layers`
    on; else a full layer every `sliding_every`-th."""
    n = c["num_hidden_layers"]
    if arch.layer_types == "qwen":
        return ["sliding_attention" if c["sliding_window"] is not None and i >= c["max_window_layers"]
                else "full_attention" for i in range(n)]
    if arch.layer_types == "nope":          # SmolLM3: its NoPE layers slide, where a window is switched on
        return ["sliding_attention" if c.get("use_sliding_window") and c.get("sliding_window") is not None
                and not c["no_rope_layers"][i] else "full_attention" for i in range(n)]
    every = int(c.get(arch.sliding_every_field) or arch.sliding_every) if arch.sliding_every_field else \
        arch.sliding_every
    return ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(n)]


def config_problem(raw: dict) -> str | None:
    """What is wrong with a config.json's sizes (None: nothing), in a few words: a required size
    missing (native model types), or a size or number of another type (e.g. "thirty"). Checked on the
    file before transformers reads it (its config classes raise a multi-line validation error)."""
    if raw.get("model_type") in ARCHITECTURES:
        missing = [f for f in REQUIRED_SIZES if raw.get(f) is None]
        if missing:
            return f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} missing"
    for name in _INTEGER_FIELDS:
        v = raw.get(name)
        if v is not None and type(v) is not int:
            return f"{name} must be an integer, got {v!r}"
        if name in REQUIRED_SIZES and v is not None and v < 1:
            return f"{name} must be at least 1, got {v}"
    for name in _NUMBER_FIELDS:
        v = raw.get(name)
        if v is not None and type(v) not in (int, float):
            return f"{name} must be a number, got {v!r}"
    return None


def _layer_windows(hf: Any) -> tuple[int | None, ...]:
    """Each layer's sliding window: transformers' `layer_types` where the config has them; else the
    config's `sliding_window` for every layer (mistral, mixtral, phi3), unless `use_sliding_window` is off."""
    window = getattr(hf, "sliding_window", None)
    if getattr(hf, "use_sliding_window", True) is False:     # switched off whatever the layer types say
        window = None
    layer_types = getattr(hf, "layer_types", None)
    if layer_types:
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    if not window or getattr(hf, "use_sliding_window", True) is False:
        return ()
    return (int(window),) * hf.num_hidden_layers


def _eos(hf: Any) -> tuple[int, ...]:
    eos = getattr(hf, "eos_token_id", None)
    return tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))


def _activation(hf: Any) -> str:
    act = getattr(hf, "hidden_activation", None) or getattr(hf, "hidden_act", None) or "silu"
    if act not in ACTIVATIONS:
        raise ValueError(f"MLP activation {act!r} is not supported ({', '.join(ACTIVATIONS)})")
    return ACTIVATIONS[act]


def _rotary_dim(hf: Any, arch: Architecture, head_dim: int) -> int:
    """The dimensions of a head RoPE rotates where not all of them (GLM-4.5: partial_rotary_factor); 0: all."""
    params = getattr(hf, "rope_parameters", None) or {}
    params = params.get("full_attention") or params if "full_attention" in params else params
    factor = params.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", None) or 1.0)
    if factor == 1.0:
        return 0
    if not arch.partial_rotary:
        raise ValueError(f"partial rotary embeddings (partial_rotary_factor {factor}) are not supported for "
                         f"{hf.model_type}")
    return int(head_dim * factor)


def _latent_fields(hf: Any, rope_scaling: dict) -> dict[str, Any]:
    """Multi-head latent attention's shape (DeepSeek-V3): the KV pool holds one entry per token and layer, the
    normalized latent (kv_lora_rank) and the rotated shared key (qk_rope_head_dim), as one KV head whose keys
    are also its values (`head_dim` is their width); each head attends over it with its query absorbed
    (network.LatentAttention). The softmax scale is the full q/k head's, times YaRN's mscale(mscale_all_dim)
    squared where RoPE is scaled."""
    rope, nope, rank = int(hf.qk_rope_head_dim), int(hf.qk_nope_head_dim), int(hf.kv_lora_rank)
    scale = (nope + rope) ** -0.5
    if rope_scaling.get("mscale_all_dim"):
        scale *= yarn_mscale(rope_scaling["factor"], rope_scaling["mscale_all_dim"]) ** 2
    return dict(num_kv_heads=1, head_dim=rank + rope, rotary_dim=rope, attn_scale=scale, kv_lora_rank=rank,
                q_lora_rank=int(hf.q_lora_rank or 0), qk_nope_head_dim=nope, v_head_dim=int(hf.v_head_dim),
                rope_interleaved=bool(getattr(hf, "rope_interleave", False)), o_bias=bool(hf.attention_bias))


def _expert_fields(hf: Any, kind: str) -> dict:
    """ModelConfig's fields of the routed experts (none for a dense model)."""
    routing = experts_of(kind)
    experts = int(getattr(hf, "num_experts", None) or getattr(hf, "num_local_experts", None) or 0)
    if not experts:
        return {}
    fields: dict[str, Any] = dict(
        num_experts=experts, experts_per_token=int(getattr(hf, "num_experts_per_tok", 0) or 0),
        moe_intermediate_size=int(getattr(hf, "moe_intermediate_size", None) or hf.intermediate_size),
        norm_topk_prob=bool(getattr(hf, "norm_topk_prob", True)) if routing.norm_topk_prob is None
        else routing.norm_topk_prob,
        router_weights_in_model_dtype=routing.router_weights_in_model_dtype,
        sparse_layers=_sparse_layers(hf, experts, routing.dense_first))
    if routing.routing == "sigmoid":
        fields.update(router="sigmoid", n_group=int(hf.n_group or 1), topk_group=int(hf.topk_group or 1),
                      routed_scaling_factor=float(hf.routed_scaling_factor))
    if routing.shared:
        fields["shared_experts_size"] = int(hf.n_shared_experts or 0) * fields["moe_intermediate_size"]
    if routing.gpt_oss:
        fields.update(expert_bias=True, swiglu_alpha=float(hf.swiglu_alpha), swiglu_limit=float(hf.swiglu_limit))
    return fields


def _sparse_layers(hf: Any, experts: int, dense_first: bool = False) -> tuple[bool, ...]:
    """Which layers route to experts: every one for mixtral; for qwen3_moe those not in `mlp_only_layers`
    at every `decoder_sparse_step`-th layer; for DeepSeek's and GLM's, all after the first
    `first_k_dense_replace`."""
    if not experts:
        return ()
    if dense_first:
        return tuple(i >= int(hf.first_k_dense_replace or 0) for i in range(hf.num_hidden_layers))
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
    # the architectures' deltas from Llama (see architectures.py)
    qk_norm: str = ""           # "head": RMSNorm of each head's q and k (qwen3); "proj": of the projections (olmo2)
    norm_layout: str = "pre"    # "pre": norm before attention and MLP (llama); "post": after each (olmo2)
    layer_windows: tuple[int | None, ...] = ()  # per layer: keys a query sees (itself included), None: all
    nope_layers: tuple[bool, ...] = ()          # per layer: no RoPE at all (SmolLM3's NoPE layers)
    num_experts: int = 0            # routed experts of a sparse MLP (0: dense model)
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True     # renormalize the top-k routing weights to sum to one
    router_weights_in_model_dtype: bool = True   # qwen3_moe rounds routing weights to the model dtype; mixtral does not
    sparse_layers: tuple[bool, ...] = ()         # per layer: MLP is the routed experts (else dense)
    router: str = "softmax"         # "softmax" or "sigmoid" (DeepSeek's: see architectures.Experts.routing)
    n_group: int = 1                # "sigmoid": experts in n_group groups, chosen within the best topk_group
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    shared_experts_size: int = 0    # width of the shared experts' MLP beside the routed ones (0: none)
    rotary_dim: int = 0             # dimensions of each head RoPE rotates, the first ones (0: all)
    mtp_layers: int = 0             # multi-token-prediction layers stored after the decoder's (not run)
    # gpt-oss: the output projection's bias, attention sinks, a biased router and experts, a clamped SwiGLU
    o_bias: bool = False
    attn_sinks: bool = False
    expert_bias: bool = False       # router and experts biased
    swiglu_alpha: float = 0.0       # the experts' SwiGLU: gate * sigmoid(alpha * gate) * (up + 1), gate and up
    swiglu_limit: float = 0.0       # clamped at limit (0: plain SiLU(gate) * up)
    # multi-head latent attention (DeepSeek-V3; _latent_fields): num_kv_heads 1 and head_dim kv_lora_rank +
    # rotary_dim then describe the pool's latent entry, whose keys are its values
    kv_lora_rank: int = 0           # 0: not latent attention
    q_lora_rank: int = 0            # 0: a plain q projection
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleaved: bool = False  # the rotated dimensions pair up (x0, x1), (x2, x3), ... (DeepSeek's layout)
    # Gemma: "sandwich" norm layout (norms before and after attention and MLP), RMSNorm scaling by
    # (1 + w) in float32, embeddings times sqrt(hidden), tanh soft-capping of attention and final logits
    norm_offset: float = 0.0        # RMSNorm multiplies by (norm_offset + weight)
    embed_scale: float = 1.0
    attn_scale: float | None = None  # softmax scale; None: head_dim ** -0.5
    attn_softcap: float = 0.0       # cap * tanh(score / cap) before the softmax (0: none)
    final_softcap: float = 0.0      # the same on the output logits
    activation: str = "silu"        # of the MLP's gate: "silu" or "gelu_tanh"
    local_rope_theta: float | None = None   # RoPE base of sliding-window layers where it differs (Gemma 3)
    runtime: str = "native"         # "native": our network.py; "transformers": the fallback (model/fallback.py)

    @classmethod
    def from_hf(cls, hf: Any) -> "ModelConfig":
        """Build from a transformers PretrainedConfig (v4 `rope_theta`/`rope_scaling` or v5 `rope_parameters`)."""
        kind = hf.model_type
        if kind not in ARCHITECTURES:
            raise ValueError(f"model_type {kind!r} is not supported natively ({', '.join(ARCHITECTURES)})")
        if getattr(hf, "use_bidirectional_attention", False):
            raise ValueError("bidirectional attention is not supported (causal LMs only)")
        arch = ARCHITECTURES[kind]
        theta, rope_scaling, local_theta = rope_parameters(hf, arch)
        gemma = arch.gemma_scaling
        heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
        fields = dict(
            model_type=kind,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            rms_norm_eps=hf.rms_norm_eps,
            rope_theta=theta,
            max_position_embeddings=hf.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            qkv_bias=arch.qkv_bias or bool(getattr(hf, "attention_bias", False)),
            rope_scaling=rope_scaling,
            eos_token_ids=_eos(hf),
            qk_norm=arch.qk_norm if not arch.qk_norm_field or getattr(hf, arch.qk_norm_field, False) else "",
            norm_layout=arch.norm_layout,
            layer_windows=_layer_windows(hf),
            nope_layers=tuple(not r for r in hf.no_rope_layers[:hf.num_hidden_layers]) if arch.nope_every else (),
            rotary_dim=_rotary_dim(hf, arch, head_dim),
            mtp_layers=int(getattr(hf, arch.mtp_field, 0) or 0) if arch.mtp_field else 0,
            o_bias=arch.o_bias and bool(getattr(hf, "attention_bias", False)),
            attn_sinks=arch.sinks,
            **_expert_fields(hf, kind),
            norm_offset=1.0 if gemma else 0.0,
            embed_scale=hf.hidden_size ** 0.5 if gemma else 1.0,
            attn_scale=float(hf.query_pre_attn_scalar) ** -0.5 if gemma else None,
            attn_softcap=float(getattr(hf, "attn_logit_softcapping", None) or 0.0),
            final_softcap=float(getattr(hf, "final_logit_softcapping", None) or 0.0),
            activation=_activation(hf),
            local_rope_theta=local_theta,
        )
        if arch.latent:
            fields.update(_latent_fields(hf, rope_scaling))
        return cls(**fields)

    @classmethod
    def for_fallback(cls, hf: Any) -> "ModelConfig":
        """The shape of a causal LM that transformers runs for us (model/fallback.py): the numbers
        the KV pool, the batch budget and the sampler need, read through the config's attribute map."""
        heads = hf.num_attention_heads
        hidden = hf.hidden_size
        inter = getattr(hf, "intermediate_size", None) or getattr(hf, "n_inner", None) or 4 * hidden
        return cls(
            model_type=hf.model_type, vocab_size=hf.vocab_size, hidden_size=hidden, intermediate_size=int(inter),
            num_layers=hf.num_hidden_layers, num_heads=heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
            head_dim=getattr(hf, "head_dim", None) or hidden // heads, rms_norm_eps=0.0, rope_theta=0.0,
            max_position_embeddings=int(getattr(hf, "max_position_embeddings", 0) or 0),
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)), qkv_bias=False,
            eos_token_ids=_eos(hf), runtime="transformers")

    @classmethod
    def from_json(cls, raw: dict) -> "ModelConfig":
        """The native config of a supported model_type from config.json's fields (its architecture's defaults
        filling in what it leaves out), without transformers."""
        return cls.from_hf(SimpleNamespace(**_with_defaults(raw)))

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelConfig":
        """The native config of a supported model_type, read from config.json by our own code (with the
        defaults transformers would fill in, its architecture's `defaults`); else the fallback's shape,
        read by transformers."""
        raw = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
        if isinstance(raw, dict) and raw.get("model_type") in ARCHITECTURES:
            return cls.from_json(raw)
        import lmbatch

        with lmbatch.IMPORT_LOCK:
            from transformers import AutoConfig
        hf = AutoConfig.from_pretrained(str(path))
        return cls.from_hf(hf) if hf.model_type in ARCHITECTURES else cls.for_fallback(hf)

    @property
    def keys_are_values(self) -> bool:
        """The KV pool's values are its keys (latent attention's entry): one tensor, not two."""
        return self.kv_lora_rank > 0

    def torch_attention_only(self) -> str | None:
        """Why this model attends with the torch backend on CUDA too (a delta lmbatch's GPU attention kernels
        do not have yet), or None."""
        if self.kv_lora_rank:
            return "latent attention (MLA): the GPU attention kernels have no latent path yet"
        return None

    def attention_params(self) -> int:
        """Weights of one layer's attention projections."""
        h, nh = self.hidden_size, self.num_heads
        if not self.kv_lora_rank:
            return h * (nh + 2 * self.num_kv_heads) * self.head_dim + nh * self.head_dim * h
        qk = self.qk_nope_head_dim + self.rotary_dim
        q = (h + nh * qk) * self.q_lora_rank if self.q_lora_rank else h * nh * qk
        return q + h * self.head_dim + self.kv_lora_rank * nh * (self.qk_nope_head_dim + self.v_head_dim) \
            + nh * self.v_head_dim * h

    def active_linear_params(self) -> int:
        """Weights of the linear layers one token runs through (an MoE layer: its router and the
        experts it is routed to, not all of them): its model FLOPs outside attention and the LM head
        are twice this."""
        h = self.hidden_size
        attention = self.attention_params()
        dense = 3 * h * self.intermediate_size
        sparse = (self.experts_per_token * self.moe_intermediate_size + self.shared_experts_size) * 3 * h \
            + h * self.num_experts
        n_sparse = sum(self.sparse_layers)
        return self.num_layers * attention + (self.num_layers - n_sparse) * dense + n_sparse * sparse

    def inv_freq(self, local: bool = False) -> torch.Tensor:
        """RoPE inverse frequencies in float64, with llama3 or linear scaling when configured; `local`:
        those of sliding-window layers (their own base, unscaled, where the config gives them one)."""
        import torch

        d = self.rotary_dim or self.head_dim
        theta = self.local_rope_theta if local and self.local_rope_theta else self.rope_theta
        inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        s = self.rope_scaling
        if not s or (local and self.local_rope_theta):
            return inv
        if s["rope_type"] == "linear":
            return inv / s["factor"]
        if s["rope_type"] == "yarn":
            return yarn_inv_freq(inv, d, theta, s)
        factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        old_len = s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        lo_wavelen, hi_wavelen = old_len / lo, old_len / hi
        smooth = (old_len / wavelen - lo) / (hi - lo)
        mid = (1 - smooth) * inv / factor + smooth * inv
        out = torch.where(wavelen > lo_wavelen, inv / factor, inv)
        is_mid = (wavelen >= hi_wavelen) & (wavelen <= lo_wavelen)
        return torch.where(is_mid, mid, out)

    def rope_attention_factor(self, local: bool = False) -> float:
        """What YaRN multiplies cos and sin by (1.0 for other RoPE and for sliding layers of their own base)."""
        s = self.rope_scaling
        if not s or s["rope_type"] != "yarn" or (local and self.local_rope_theta):
            return 1.0
        return float(s["attention_factor"])
