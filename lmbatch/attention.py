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
        move = lambda t: to_device(t, device)  # noqa: E731
        return ForwardBatch(move(self.input_ids), move(self.positions), move(self.out_slots),
                            self.qo_indptr, self.kv_indptr, move(self.kv_indices), move(self.logit_rows))


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """Host -> device without blocking the host: a copy from pageable memory would wait for all work
    queued on the stream, which would serialize scheduling with the batch in flight."""
    if torch.device(device).type != "cuda" or t.is_cuda:
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


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


def _flash_cpu(q, k, v, causal: bool):
    """[1, heads, n, D] x [1, heads, L, D] -> (out, logsumexp) via PyTorch's CPU flash kernel."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, is_causal=causal)[:2]
    return out, lse


class TorchBackend(AttentionBackend):
    """Reference backend in plain PyTorch: one attention per sequence, KV gathered from the pool.

    On CPU each sequence splits into its cached prefix (every new token sees all of it: no mask, so
    the query heads of a KV group fold into rows and no KV is repeated) and its causal new part, and
    the two are merged by their log-sum-exp, as cascade attention does.
    """

    def forward(self, layer, q, k, v):
        # Store every new token's KV first: a sequence may read KV that another sequence of the
        # same batch writes (a shared prefix inserted into the tree earlier in this batch).
        self.store(layer, k, v)
        b = self.batch
        out = torch.empty_like(q)
        for i in range(len(b.qo_indptr) - 1):
            q0, q1 = b.qo_indptr[i], b.qo_indptr[i + 1]
            slots = b.kv_indices[b.kv_indptr[i]:b.kv_indptr[i + 1]]
            keys, values = self.pool.k[layer, slots], self.pool.v[layer, slots]
            if q.device.type == "cpu":
                out[q0:q1] = self._attend_cpu(q[q0:q1], keys, values)
            else:
                out[q0:q1] = self._attend_masked(q[q0:q1], keys, values)
        return out

    def _attend_masked(self, q, k, v):
        n, L = q.shape[0], k.shape[0]
        mask = torch.arange(L, device=q.device)[None, :] <= torch.arange(L - n, L, device=q.device)[:, None]
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                           attn_mask=mask, scale=self.scale, enable_gqa=True)
        return o.transpose(0, 1)

    def _attend_cpu(self, q, k, v):
        n, H, D = q.shape
        L, KVH = k.shape[0], k.shape[1]
        G, P = H // KVH, L - n
        if n == 1 or P > 0:  # the part every new token sees in full
            seen = L if n == 1 else P
            qf = q.view(n, KVH, G, D).permute(1, 2, 0, 3).reshape(1, KVH, G * n, D)
            kf, vf = k[:seen].permute(1, 0, 2)[None], v[:seen].permute(1, 0, 2)[None]
            o1, lse1 = _flash_cpu(qf.contiguous(), kf.contiguous(), vf.contiguous(), causal=False)
            o1 = o1.view(KVH, G, n, D).permute(2, 0, 1, 3).reshape(n, H, D)
            if n == 1:
                return o1
            lse1 = lse1.view(KVH, G, n).permute(2, 0, 1).reshape(n, H)
        kt = k[P:].repeat_interleave(G, dim=1).transpose(0, 1)[None]
        vt = v[P:].repeat_interleave(G, dim=1).transpose(0, 1)[None]
        o2, lse2 = _flash_cpu(q.transpose(0, 1)[None].contiguous(), kt.contiguous(), vt.contiguous(), causal=True)
        o2, lse2 = o2[0].transpose(0, 1), lse2[0].transpose(0, 1)
        if P == 0:
            return o2
        w1 = torch.sigmoid(lse1 - lse2)[..., None]   # exp(lse1) / (exp(lse1) + exp(lse2))
        return (w1 * o1.float() + (1 - w1) * o2.float()).to(q.dtype)


BACKENDS = ("torch", "triton", "flashinfer")


def default_backend(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> str:
    """FlashInfer on CUDA when installed, else our Triton kernels; the torch reference on CPU, and
    for float32 on CUDA (FlashInfer has no float32 kernels, and Triton's dots would round float32
    inputs to tf32, which is not the precision a float32 run asks for)."""
    if device.type != "cuda" or dtype == torch.float32:
        return "torch"
    try:
        import flashinfer  # noqa: F401
        return "flashinfer"
    except ImportError:
        return "triton"


def make_backend(name: str, pool: KVPool, num_heads: int, head_dim: int) -> AttentionBackend:
    if name == "torch":
        return TorchBackend(pool, num_heads, head_dim)
    if name == "triton":
        from lmbatch.kernels.backends import TritonBackend
        return TritonBackend(pool, num_heads, head_dim)
    if name == "flashinfer":
        from lmbatch.kernels.backends import FlashInferBackend
        return FlashInferBackend(pool, num_heads, head_dim)
    raise ValueError(f"unknown attention backend {name!r}; known: {', '.join(BACKENDS)}")
