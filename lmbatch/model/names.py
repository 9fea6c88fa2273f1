"""Which of our network's parameters a checkpoint tensor goes to, by name, and which parameters a config's
network has (network.py's `Transformer(cfg).named_parameters()`, without torch): weights.py loads by these
names, and checkpoint.py compares a native checkpoint's tensor names (from its safetensors headers) with
them before any other work, so that a tensor the model has no place for, or a parameter no tensor fills,
is one line at once rather than a KeyError once the weights are read."""
from __future__ import annotations

import re

from lmbatch.model.architectures import ARCHITECTURES, EXPERT_NAMINGS, STACKED_EXPERTS
from lmbatch.model.config import ModelConfig

# HF name suffix -> (our parameter suffix, index of the shard within a fused parameter)
FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
    "mlp.shared_experts.gate_proj": ("mlp.shared_experts.gate_up_proj", 0),     # DeepSeek's, GLM's
    "mlp.shared_experts.up_proj": ("mlp.shared_experts.gate_up_proj", 1),
}
# one expert's weight, under any architecture's naming (architectures.py: Qwen3-MoE's, Mixtral's w1 gate,
# w3 up, w2 down)
EXPERT = re.compile(rf"(layers\.\d+)\.(?:{'|'.join(map(re.escape, EXPERT_NAMINGS))})\.experts\.(\d+)\."
                    rf"({'|'.join(n for names in EXPERT_NAMINGS.values() for n in names)})\.weight")
EXPERT_PART = {n: part for names in EXPERT_NAMINGS.values() for n, part in zip(names, (0, 1, None))}
# every architecture's renames (Mixtral's router), then experts already stacked ([E, ...])
RENAMED = {**{k: v for arch in ARCHITECTURES.values() for k, v in arch.renames.items()}, **STACKED_EXPERTS}
_NORMS = {"pre": ("input_layernorm", "post_attention_layernorm"),
          "post": ("post_attention_layernorm", "post_feedforward_layernorm"),
          "sandwich": ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                       "post_feedforward_layernorm")}


def renamed(name: str, tie_word_embeddings: bool) -> str | None:
    """A checkpoint tensor's name as ours (no "model." prefix, Mixtral's router renamed), or None for one
    that is not loaded (RoPE's cached frequencies; the LM head of a model whose embedding is its head)."""
    ours = name.removeprefix("model.")
    if "rotary_emb" in ours or (ours == "lm_head.weight" and tie_word_embeddings):
        return None
    for theirs, mine in RENAMED.items():
        ours = ours.replace(theirs, mine)
    return ours


_LAYER = re.compile(r"layers\.(\d+)\.")


def beyond_the_decoder(name: str, cfg: ModelConfig) -> bool:
    """A tensor of the multi-token-prediction layers DeepSeek's and GLM's checkpoints store after the
    decoder's (layers num_hidden_layers on, as many as config.json's count of them), which scoring does
    not run: not loaded, as transformers skips them."""
    m = _LAYER.match(name.removeprefix("model."))
    return m is not None and cfg.num_layers <= int(m.group(1)) < cfg.num_layers + cfg.mtp_layers


def fused(module: str, cfg: ModelConfig) -> tuple[str, str, int] | None:
    """(our fused parameter's module, its suffix, the shard's index) of a checkpoint module loaded as a slice
    of one of ours, else None. Latent attention's projections are its own (its q_proj is not one of q/k/v)."""
    for hf_sfx, (our_sfx, shard) in FUSED.items():
        if module.endswith(hf_sfx) and not (cfg.kv_lora_rank and hf_sfx.startswith("self_attn.")):
            return module[: -len(hf_sfx)] + our_sfx, our_sfx, shard
    return None


def target(name: str, cfg: ModelConfig) -> str | None:
    """The parameter the checkpoint tensor `name` is copied into (a fused or stacked one: a slice of it), or
    None where it is not loaded. The parameter may not exist: `parameter_names` says."""
    ours = renamed(name, cfg.tie_word_embeddings)
    if ours is None or beyond_the_decoder(name, cfg):
        return None
    if m := EXPERT.fullmatch(ours):
        return f"{m.group(1)}.mlp.{'down_proj' if EXPERT_PART[m.group(3)] is None else 'gate_up_proj'}"
    module, _, kind = ours.rpartition(".")
    if (into := fused(module, cfg)) is not None:
        return f"{into[0]}.{kind}"
    return ours


def parameter_names(cfg: ModelConfig) -> set[str]:
    """The names of `Transformer(cfg)`'s parameters (tests/unit/test_models.py compares them)."""
    names = {"embed_tokens.weight", "norm.weight"} | (set() if cfg.tie_word_embeddings else {"lm_head.weight"})
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        names |= {f"{p}{norm}.weight" for norm in _NORMS.get(cfg.norm_layout, _NORMS["pre"])}
        names |= _latent_names(cfg, p + "self_attn.") if cfg.kv_lora_rank else {p + "self_attn.qkv_proj.weight"}
        names.add(p + "self_attn.o_proj.weight")
        if cfg.qkv_bias and not cfg.kv_lora_rank:
            names.add(p + "self_attn.qkv_proj.bias")
        if cfg.o_bias:
            names.add(p + "self_attn.o_proj.bias")
        if cfg.attn_sinks:
            names.add(p + "self_attn.sinks")
        if cfg.qk_norm:
            names |= {p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"}
        # network.py: only a pre-norm Block routes to experts
        sparse = cfg.norm_layout not in ("post", "sandwich") and bool(cfg.sparse_layers) and cfg.sparse_layers[i]
        names |= _moe_names(cfg, p + "mlp.") if sparse else {p + "mlp.gate_up_proj.weight", p + "mlp.down_proj.weight"}
    return names


def _latent_names(cfg: ModelConfig, p: str) -> set[str]:
    """Latent attention's projections and norms (network.LatentAttention), as DeepSeek's checkpoints name them."""
    names = {p + "kv_a_proj_with_mqa.weight", p + "kv_a_layernorm.weight", p + "kv_b_proj.weight"}
    names |= {p + "q_a_proj.weight", p + "q_a_layernorm.weight", p + "q_b_proj.weight"} if cfg.q_lora_rank else \
        {p + "q_proj.weight"}
    if cfg.qkv_bias:
        names |= {p + "kv_a_proj_with_mqa.bias"} | ({p + "q_a_proj.bias"} if cfg.q_lora_rank else set())
    return names


def _moe_names(cfg: ModelConfig, p: str) -> set[str]:
    names = {p + "gate.weight", p + "gate_up_proj", p + "down_proj"}
    if cfg.router == "sigmoid":
        names.add(p + "gate.e_score_correction_bias")
    if cfg.shared_experts_size:
        names |= {p + "shared_experts.gate_up_proj.weight", p + "shared_experts.down_proj.weight"}
    if cfg.expert_bias:
        names |= {p + "gate.bias", p + "gate_up_proj_bias", p + "down_proj_bias"}
    return names


def unplaced(cfg: ModelConfig, tensors: list[str]) -> list[str]:
    """The checkpoint tensors the network has no place for."""
    params = parameter_names(cfg)
    return [name for name in tensors if (key := target(name, cfg)) is not None and key not in params]


def name_problem(cfg: ModelConfig, tensors: list[str], where: str) -> str | None:
    """The first checkpoint tensor the network has no place for, else the first parameter no tensor fills,
    in one phrase; None where every tensor has its place and every parameter a tensor."""
    params = parameter_names(cfg)
    filled: set[str] = set()
    for name in tensors:
        key = target(name, cfg)
        if key is None:
            continue
        if key not in params:
            return (f"{where} holds {name}, which a {cfg.model_type} model of this config.json has no place for "
                    "(a tensor of another architecture or layer count?)")
        filled.add(key)
    missing = sorted(params - filled)
    if missing:
        return f"{where} has no tensor for the model's {missing[0]}" + (
            f" (and {len(missing) - 1} other parameters)" if len(missing) > 1 else "")
    return None
