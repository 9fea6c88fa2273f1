"""Load a Hugging Face checkpoint (safetensors, sharded or not) into our Transformer, or dummy weights."""
from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from lmbatch.model.config import ModelConfig
from lmbatch.model.network import Transformer
from lmbatch.model.tensor_parallel import shard_tensor

# HF name suffix -> (our parameter suffix, index of the shard within a fused parameter, or None)
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


# one expert's weight: Qwen3-MoE's names, then Mixtral's (w1 gate, w3 up, w2 down)
_EXPERT = re.compile(r"(layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
                     r"(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight")
_EXPERT_PART = {"gate_proj": 0, "w1": 0, "up_proj": 1, "w3": 1, "down_proj": None, "w2": None}
_RENAMED = {"block_sparse_moe.gate.": "mlp.gate.",                  # Mixtral's router
            "mlp.experts.gate_up_proj": "mlp.gate_up_proj",         # experts already stacked ([E, ...])
            "mlp.experts.down_proj": "mlp.down_proj"}


def _expert_slot(model: Transformer, name: str) -> tuple[str, int, slice] | None:
    """(our stacked parameter, expert, rows of it) for one expert's weight, else None."""
    m = _EXPERT.fullmatch(name)
    if m is None:
        return None
    layer, expert, part = m.group(1), int(m.group(2)), _EXPERT_PART[m.group(3)]
    if part is None:
        return f"{layer}.mlp.down_proj", expert, slice(None)
    i = model.cfg.moe_intermediate_size
    return f"{layer}.mlp.gate_up_proj", expert, slice(part * i, (part + 1) * i)


def _shard_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        return sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    return files


def _fused_slice(model: Transformer, target: str, shard: int) -> slice:
    cfg = model.cfg
    if target.endswith("qkv_proj"):
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        starts = [0, q, q + kv, q + 2 * kv]
    else:
        i = cfg.intermediate_size
        starts = [0, i, 2 * i]
    return slice(starts[shard], starts[shard + 1])


def _checkpoint_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for file in _shard_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


@torch.no_grad()
def load_weights(model: Transformer, source: str | Path | dict[str, torch.Tensor],
                 full: ModelConfig | None = None) -> None:
    """Copy every tensor of a checkpoint folder (or of a HF state dict) into the model; fail if any
    parameter is left unset. Under tensor parallelism (`model.tp`) each tensor's slice for this rank
    is copied; `full` is then the unsplit config."""
    tensors = source.items() if isinstance(source, dict) else _checkpoint_tensors(Path(source))
    params = dict(model.named_parameters())
    pending = set(params)
    tp = model.tp
    for name, whole in tensors:
        ours = name.removeprefix("model.")
        if "rotary_emb" in ours or (ours == "lm_head.weight" and model.lm_head is None):
            continue
        for theirs, mine in _RENAMED.items():
            ours = ours.replace(theirs, mine)
        if (slot := _expert_slot(model, ours)) is not None:
            key, expert, rows = slot
            tensor = whole if tp is None else shard_tensor(key, whole, full or model.cfg, tp)
            params[key][expert, rows].copy_(tensor)
            pending.discard(key)
            continue
        module, kind = ours.rsplit(".", 1)
        for hf_sfx, (our_sfx, shard) in _FUSED.items():
            if module.endswith(hf_sfx):
                key = module[: -len(hf_sfx)] + our_sfx + "." + kind
                tensor = whole if tp is None else shard_tensor(key, whole, full or model.cfg, tp)
                params[key][_fused_slice(model, our_sfx, shard)].copy_(tensor)
                pending.discard(key)
                break
        else:
            if ours not in params:
                raise KeyError(f"checkpoint tensor {name} has no place in the model")
            params[ours].copy_(whole if tp is None else shard_tensor(ours, whole, full or model.cfg, tp))
            pending.discard(ours)
    if pending:
        raise KeyError(f"checkpoint lacks: {', '.join(sorted(pending)[:5])}")


@torch.no_grad()
def init_dummy(model: Transformer, seed: int = 0) -> None:
    """Random weights of the config's shapes (like vLLM's --load-format dummy): for speed work only."""
    device = next(model.parameters()).device
    g = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        else:
            p.copy_(torch.randn(p.shape, generator=g, device=device) * 0.02)
