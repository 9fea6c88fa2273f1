"""Attention backends over the paged KV pool.

A batch is ragged (no padding): sequence b owns query rows qo_indptr[b]:qo_indptr[b+1] (its new
tokens, which are the last tokens of the sequence) and reads KV slots kv_indices[kv_indptr[b]:kv_indptr[b+1]]
(the whole sequence, new tokens included). This is FlashInfer's paged layout with page_size=1, so
the GPU backends can take the same metadata.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lmbatch.kv_pool import KVPool


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor     # [T] new tokens of all sequences, concatenated
    positions: torch.Tensor     # [T] their positions in their sequences
    out_slots: torch.Tensor     # [T] KV slot each new token is written to
    qo_indptr: list[int]        # [B+1]
    kv_indptr: list[int]        # [B+1]
    kv_indices: torch.Tensor    # slots of every sequence, concatenated
    logit_rows: torch.Tensor    # rows of the batch whose logits are wanted

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    def to(self, device) -> "ForwardBatch":
        return ForwardBatch(self.input_ids.to(device), self.positions.to(device), self.out_slots.to(device),
                            self.qo_indptr, self.kv_indptr, self.kv_indices.to(device), self.logit_rows.to(device))


class AttentionBackend:
    """Interface: `plan` once per batch, then `forward` per layer (store new KV, attend)."""

    def __init__(self, pool: KVPool, num_heads: int, head_dim: int):
        self.pool, self.num_heads, self.head_dim = pool, num_heads, head_dim
        self.scale = head_dim ** -0.5

    def plan(self, batch: ForwardBatch) -> None:
        self.batch = batch

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        slots = self.batch.out_slots
        self.pool.k[layer, slots] = k
        self.pool.v[layer, slots] = v

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class TorchBackend(AttentionBackend):
    """Reference backend (CPU and GPU): one SDPA call per sequence, KV gathered from the pool."""

    def forward(self, layer, q, k, v):
        # Store every new token's KV first: a sequence may read KV that another sequence of the
        # same batch writes (a shared prefix inserted into the tree earlier in this batch).
        self.store(layer, k, v)
        b = self.batch
        out = torch.empty_like(q)
        kv_idx = b.kv_indices
        for i in range(len(b.qo_indptr) - 1):
            q0, q1 = b.qo_indptr[i], b.qo_indptr[i + 1]
            k0, k1 = b.kv_indptr[i], b.kv_indptr[i + 1]
            slots = kv_idx[k0:k1]
            out[q0:q1] = self._attend(q[q0:q1], self.pool.k[layer, slots], self.pool.v[layer, slots])
        return out

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        n, L = q.shape[0], k.shape[0]
        group = q.shape[1] // k.shape[1]
        if group > 1:
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
        qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
        if n == 1:
            o = F.scaled_dot_product_attention(qh, kh, vh, scale=self.scale)
        elif n == L:
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=self.scale)
        else:  # new tokens are the last n of L: query i sees keys 0 .. L-n+i
            qpos = torch.arange(L - n, L, device=q.device)[:, None]
            mask = torch.arange(L, device=q.device)[None, :] <= qpos
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=self.scale)
        return o.transpose(0, 1)


BACKENDS = {"torch": TorchBackend}


def make_backend(name: str, pool: KVPool, num_heads: int, head_dim: int) -> AttentionBackend:
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; known: {', '.join(BACKENDS)}")
    return BACKENDS[name](pool, num_heads, head_dim)
