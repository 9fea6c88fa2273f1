"""Load a Hugging Face checkpoint (safetensors, sharded or not) into our Transformer, or dummy weights."""
from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from lmbatch.model.architectures import ARCHITECTURES, experts_of
from lmbatch.model.config import ModelConfig
from lmbatch.model.dequantize import QuantizedCheckpoint
from lmbatch.model.names import EXPERT, EXPERT_PART, beyond_the_decoder, fused, renamed, target
from lmbatch.model.network import Transformer
from lmbatch.model.quantization import read_quantization
from lmbatch.model.tensor_parallel import shard_tensor


def _expert_slot(model: Transformer, name: str) -> tuple[str, int, slice] | None:
    """(our stacked parameter, expert, rows of it) for one expert's weight, else None."""
    m = EXPERT.fullmatch(name)
    if m is None:
        return None
    layer, expert, part = m.group(1), int(m.group(2)), EXPERT_PART[m.group(3)]
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
        i = cfg.shared_experts_size if target.endswith("shared_experts.gate_up_proj") else cfg.intermediate_size
        starts = [0, i, 2 * i]
    return slice(starts[shard], starts[shard + 1])


def _checkpoint_tensors(path: Path, model: Transformer, fp8_gemm: bool) -> Iterable[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors by name; a quantized checkpoint's weights dequantized to the model's dtype on
    its device (model/dequantize.py) or, with `fp8_gemm`, its dense layers' FP8 weights kept as stored beside
    their scales, those layers made FP8 (model/fp8.py)."""
    q = read_quantization(json.loads((path / "config.json").read_text(encoding="utf-8")))
    if q is None:
        return _plain_tensors(path)
    p = next(model.parameters())
    transposed = ARCHITECTURES[model.cfg.model_type].mxfp4_transposed
    stored = QuantizedCheckpoint(_shard_files(path), q, p.device, p.dtype, transposed)
    if fp8_gemm:
        from lmbatch.model import fp8

        blocks = fp8.convert(model, q, fp8.gemm_targets(model.cfg, stored.dtypes()))
        stored.keep = {name: blocks[key] for name in stored.where if (key := target(name, model.cfg)) in blocks}
    return stored


def _plain_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for file in _shard_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _our_layout(cfg: ModelConfig, ours: str, t: torch.Tensor) -> torch.Tensor:
    """gpt-oss's stacked experts as transformers stores them (after any dequantization), in our layout:
    gate_up [E, H, 2I] with gate and up columns interleaved -> [E, 2I, H], the gate rows then the up rows
    (its bias [E, 2I] alike); down [E, I, H] -> [E, H, I]. Other tensors as they are."""
    if not experts_of(cfg.model_type).gpt_oss:
        return t
    if ours.endswith("mlp.gate_up_proj"):
        t = t.transpose(1, 2)
        return torch.cat([t[:, 0::2], t[:, 1::2]], dim=1)
    if ours.endswith("mlp.gate_up_proj_bias"):
        return torch.cat([t[:, 0::2], t[:, 1::2]], dim=1)
    if ours.endswith("mlp.down_proj"):
        return t.transpose(1, 2)
    return t


@torch.no_grad()
def load_weights(model: Transformer, source: str | Path | dict[str, torch.Tensor],
                 full: ModelConfig | None = None, fp8_gemm: bool = False) -> None:
    """Copy every tensor of a checkpoint folder (or of a HF state dict) into the model; fail if any
    parameter is left unset. Under tensor parallelism (`model.tp`) each tensor's slice for this rank
    is copied; `full` is then the unsplit config. `fp8_gemm`: an FP8 checkpoint's dense layers stay FP8
    (model/fp8.py; a single device)."""
    tensors = source.items() if isinstance(source, dict) else _checkpoint_tensors(Path(source), model, fp8_gemm)
    params = dict(model.named_parameters())
    pending = set(params)
    tp = model.tp
    for name, whole in tensors:
        ours = renamed(name, model.lm_head is None)
        if ours is None or beyond_the_decoder(name, model.cfg):
            continue
        if (slot := _expert_slot(model, ours)) is not None:
            key, expert, rows = slot
            tensor = whole if tp is None else shard_tensor(key, whole, full or model.cfg, tp)
            params[key][expert, rows].copy_(tensor)
            pending.discard(key)
            continue
        module, kind = ours.rsplit(".", 1)
        if (into := fused(module, model.cfg)) is not None:
            key = f"{into[0]}.{kind}"
            tensor = whole if tp is None else shard_tensor(key, whole, full or model.cfg, tp)
            rows = _fused_slice(model, into[1], into[2])
            if kind == "weight_scale":      # an FP8 layer's scales: the rows of its blocks (model/fp8.py)
                per = getattr(model.get_submodule(key.removesuffix(".weight_scale")), "fp8_block")[0]
                rows = slice(rows.start // per, -(-rows.stop // per))
            params[key][rows].copy_(tensor)
            pending.discard(key)
        else:
            if ours not in params:
                raise KeyError(f"checkpoint tensor {name} has no place in the model")
            whole = _our_layout(model.cfg, ours, whole)
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
