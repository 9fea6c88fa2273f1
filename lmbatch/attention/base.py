"""Attention over the paged KV pool: the batch layout, the backends' interface and their registry.

A batch is ragged (no padding): sequence b owns query rows qo_indptr[b]:qo_indptr[b+1] (its new
tokens, which are the last tokens of the sequence) and reads KV slots kv_indices[kv_indptr[b]:kv_indptr[b+1]]
(the whole sequence, new tokens included). This is FlashInfer's paged layout with page_size=1, so
the GPU backends can take the same metadata.
"""
from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from lmbatch.attention.kv_pool import KVPool
from lmbatch.attention.registry import BACKENDS, DEFAULT_CUDA, REFERENCE, REGISTRY


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

    def to(self, device: torch.device | str) -> "ForwardBatch":
        move = lambda t: to_device(t, device)  # noqa: E731
        return ForwardBatch(move(self.input_ids), move(self.positions), move(self.out_slots),
                            self.qo_indptr, self.kv_indptr, move(self.kv_indices), move(self.logit_rows))


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """Host -> device without blocking the host: a copy from pageable memory would wait for all work
    queued on the stream, which would serialize scheduling with the batch in flight."""
    if torch.device(device).type != "cuda" or t.is_cuda:
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class AttentionBackend(ABC):
    """Interface: `plan` once per batch, then `forward` per layer (store new KV, attend).

    `scale` multiplies q.k (default head_dim ** -0.5); with a `softcap` (Gemma 2) each scaled score s
    becomes softcap * tanh(s / softcap) before the mask and softmax, as transformers does."""

    def __init__(self, pool: KVPool, num_heads: int, head_dim: int, scale: float | None = None,
                 softcap: float = 0.0):
        self.pool, self.num_heads, self.head_dim = pool, num_heads, head_dim
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.softcap = softcap
        # deterministic mode: a query's output depends on its own keys alone, not on how its sequence was cut
        # into batches, what was cached, or what else the batch holds (each backend says how it keeps that)
        self.deterministic = False

    def plan(self, batch: ForwardBatch) -> None:
        self.batch = batch

    def store(self, layer: int, k: torch.Tensor | None, v: torch.Tensor | None) -> None:
        """The new tokens' keys and values into the pool (None: `rope_store` put them there already)."""
        if k is None or v is None:
            return
        slots = self.batch.out_slots
        self.pool.k[layer, slots] = k
        self.pool.v[layer, slots] = v

    def rope_store(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   rope: tuple[torch.Tensor, torch.Tensor]) -> None:
        """RoPE on q (in place) and k, and k and v into the pool, in one kernel (CUDA): `forward` then
        takes k = v = None. The same bits as rotating, then storing."""
        from lmbatch.kernels.fused import rope_store_

        rope_store_(q, k, v, rope[0], rope[1], self.pool.k[layer], self.pool.v[layer], self.batch.out_slots)

    @abstractmethod
    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Attention output of the batch's new tokens at `layer` ([T, heads, head_dim]). With a
        `window`, a token sees only the last `window` positions up to its own (sliding-window layers);
        with `sinks` ([heads], gpt-oss), each head's learned logit joins its softmax's denominator (the
        torch and Triton backends; FlashInfer and the cascade kernel refuse them). k = v = None: the new
        tokens' KV is in the pool already (`rope_store`)."""


def no_sinks(backend: str, sinks: torch.Tensor | None) -> None:
    """A backend without a sink term refuses a model with attention sinks rather than leave them out (never
    reached from the command line: engine/build.py and the model runner give such a model triton or torch)."""
    if sinks is not None:
        raise ValueError(f"the {backend} attention backend has no attention sinks (gpt-oss)")


def default_backend(device: torch.device, dtype: torch.dtype = torch.bfloat16, torch_only: bool = False) -> str:
    """Our Triton kernels on CUDA (FlashInfer compiles its kernels at first use: engine/build.py picks
    it only where they are built); the torch reference on CPU, and for float32 on CUDA (FlashInfer has
    no float32 kernels, and Triton's dots would round float32 inputs to tf32, which is not the
    precision a float32 run asks for), and for a model whose attention the GPU kernels do not compute
    (`torch_only`: ModelConfig.torch_attention_only says why)."""
    if device.type != "cuda" or dtype == torch.float32 or torch_only:
        return REFERENCE
    return DEFAULT_CUDA


def make_backend(name: str, pool: KVPool, num_heads: int, head_dim: int, scale: float | None = None,
                 softcap: float = 0.0) -> AttentionBackend:
    if name not in REGISTRY:
        raise ValueError(f"unknown attention backend {name!r}; known: {', '.join(BACKENDS)}")
    entry = REGISTRY[name]
    backend: AttentionBackend = getattr(importlib.import_module(entry.module), entry.cls)(pool, num_heads, head_dim,
                                                                                          scale, softcap)
    return backend
