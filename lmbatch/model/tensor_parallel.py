"""Tensor parallelism (Megatron's layout): each rank of a group holds a slice of every large weight.

- attention: the query heads and the KV heads split evenly (column-parallel q/k/v, so each rank's KV
  pool holds its own KV heads), the output projection row-parallel, summed over the ranks; latent
  attention (DeepSeek) splits its heads (q_b_proj, kv_b_proj, o_proj) and keeps the latent, its
  down-projections and its pool entry whole on every rank;
- MLP: gate/up column-parallel, down row-parallel, summed (routed experts: each expert's slice);
- embedding and LM head: vocabulary-parallel (rows split, padded to equal slices): a token's
  embedding comes from the rank holding its row (summed over ranks), the logits are gathered.

Norms, the router, RoPE and the biases added after a sum (gpt-oss's o_proj and down projections: added
once, after it) are whole on every rank, but for OLMo's q/k norms over whole projections:
each rank holds its heads' slice of their weights, and their sums of squares are summed over the ranks.
The network sees a config whose head counts and intermediate sizes are one rank's (`shard_config`), so
the KV pool, the attention backend and the decode graphs need nothing else; it calls `all_reduce` after
each row-parallel projection and `gather` on the logits. Collectives go through torch.distributed
(NCCL on CUDA, gloo on CPU).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from lmbatch.model.config import ModelConfig


@dataclass(frozen=True)
class TensorParallel:
    rank: int
    size: int
    group: Any = None           # a torch.distributed group (None: the default one)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        dist.all_reduce(x, group=self.group)
        return x

    def gather(self, x: torch.Tensor, width: int) -> torch.Tensor:
        """[rows, slice] of each rank -> [rows, width] (the slices side by side, padding cut)."""
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)[:, :width]

    def vocab_rows(self, vocab: int) -> tuple[int, int]:
        """(first row, rows) of this rank's vocabulary slice (every slice padded to the same size)."""
        rows = -(-vocab // self.size)
        return self.rank * rows, rows


def shard_config(cfg: ModelConfig, size: int) -> ModelConfig:
    """One rank's shape: heads, KV heads and intermediate sizes divided by `size`. ValueError where a
    model cannot be split so."""
    if cfg.runtime != "native":
        raise ValueError(f"tensor parallelism needs lmbatch's own network; {cfg.model_type} runs through "
                         "transformers (the fallback)")
    split = ("num_heads", "intermediate_size", "moe_intermediate_size", "shared_experts_size") + \
        (() if cfg.keys_are_values else ("num_kv_heads",))      # latent attention's entry: whole on every rank
    for name in split:
        if getattr(cfg, name) % size:
            raise ValueError(f"{size} ranks do not divide the model's {name} ({getattr(cfg, name)})")
    kv_heads = cfg.num_kv_heads if cfg.keys_are_values else cfg.num_kv_heads // size
    return replace(cfg, num_heads=cfg.num_heads // size, num_kv_heads=kv_heads,
                   intermediate_size=cfg.intermediate_size // size,
                   moe_intermediate_size=cfg.moe_intermediate_size // size,
                   shared_experts_size=cfg.shared_experts_size // size)


def _chunk(t: torch.Tensor, tp: TensorParallel, dim: int, parts: int = 1) -> torch.Tensor:
    """This rank's slice along `dim` of each of `parts` equal blocks (fused q|k|v or gate|up)."""
    blocks = t.chunk(parts, dim) if parts > 1 else (t,)
    return torch.cat([b.chunk(tp.size, dim)[tp.rank] for b in blocks], dim)


def shard_tensor(key: str, t: torch.Tensor, full: ModelConfig, tp: TensorParallel) -> torch.Tensor:
    """This rank's part of checkpoint tensor `t` for our parameter `key` (names as in network.py;
    `full` is the unsplit config). q/k/v and gate/up come one by one (loading fuses them) or fused."""
    if key.endswith(("embed_tokens.weight", "lm_head.weight")):
        start, rows = tp.vocab_rows(full.vocab_size)
        out = t.new_zeros((rows,) + t.shape[1:])
        part = t[start:start + rows]
        out[:len(part)] = part
        return out
    if key.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight", "mlp.down_proj",
                     "shared_experts.down_proj.weight")):
        return _chunk(t, tp, t.dim() - 1)          # row-parallel: the input features (experts: [E, H, i])
    if key.endswith(("self_attn.qkv_proj.weight", "self_attn.qkv_proj.bias")):
        q, kv = full.num_heads * full.head_dim, full.num_kv_heads * full.head_dim
        if t.shape[0] == q + 2 * kv:              # fused in the checkpoint (phi3)
            a, b, c = t.split([q, kv, kv], 0)
            return torch.cat([_chunk(a, tp, 0), _chunk(b, tp, 0), _chunk(c, tp, 0)], 0)
        return _chunk(t, tp, 0)
    if key.endswith(("self_attn.q_norm.weight", "self_attn.k_norm.weight")) and full.qk_norm == "proj":
        return _chunk(t, tp, 0)                   # over the whole projection (OLMo): this rank's heads' part
    if key.endswith(("self_attn.q_proj.weight", "self_attn.q_b_proj.weight", "self_attn.kv_b_proj.weight")):
        return _chunk(t, tp, 0)                   # latent attention's per-head projections (rows head by head)
    if key.endswith("self_attn.sinks"):                     # gpt-oss: one per query head
        return _chunk(t, tp, 0)
    if key.endswith("mlp.gate_up_proj_bias"):               # gpt-oss: [E, 2I], gate | up
        return _chunk(t, tp, 1, 2)
    if key.endswith("shared_experts.gate_up_proj.weight"):    # DeepSeek's, GLM's dense MLP beside the experts
        return _chunk(t, tp, 0, 2 if t.shape[0] == 2 * full.shared_experts_size else 1)
    if key.endswith("mlp.gate_up_proj.weight"):
        return _chunk(t, tp, 0, 2 if t.shape[0] == 2 * full.intermediate_size else 1)
    if key.endswith("mlp.gate_up_proj"):          # stacked experts [E, 2i, H] or one expert's [i, H] part
        return _chunk(t, tp, t.dim() - 2, 2 if t.shape[-2] == 2 * full.moe_intermediate_size else 1)
    return t
