"""GPU attention backends: FlashInfer (the default on CUDA) and our Triton kernel."""
from __future__ import annotations

from typing import Any

import torch

from lmbatch.attention.base import AttentionBackend, to_device


class _DeviceMeta(AttentionBackend):
    """Copies the batch's ragged metadata to the device once per batch."""

    def plan(self, batch):
        super().plan(batch)
        dev = self.pool.k.device
        self.qo_indptr = torch.tensor(batch.qo_indptr, dtype=torch.int32)
        self.kv_indptr = torch.tensor(batch.kv_indptr, dtype=torch.int32)
        self.kv_indices = to_device(batch.kv_indices.to(torch.int32), dev)
        self.max_q_len = max(b - a for a, b in zip(batch.qo_indptr, batch.qo_indptr[1:]))


class TritonBackend(_DeviceMeta):
    def plan(self, batch):
        super().plan(batch)
        dev = self.pool.k.device
        self.qo_dev = to_device(self.qo_indptr, dev)
        self.kv_dev = to_device(self.kv_indptr, dev)

    def forward(self, layer, q, k, v, window=None):
        from lmbatch.kernels.extend_attention import extend_attention

        self.store(layer, k, v)
        return extend_attention(q, self.pool.k[layer], self.pool.v[layer], self.kv_indices, self.qo_dev,
                                self.kv_dev, self.max_q_len, self.scale, window, self.softcap)


class FlashInferBackend(_DeviceMeta):
    """Paged prefill (new tokens over the cached prefix, causal, bottom-right aligned) with page size 1;
    planned once per batch, workspace reused. Decode batches go through the same kernel with q_len 1.
    A sliding window is part of FlashInfer's plan (`window_left`: keys before the query's own), so a
    model with global and sliding-window layers keeps one planned wrapper per window."""

    def __init__(self, pool, num_heads, head_dim, scale=None, softcap=0.0):
        super().__init__(pool, num_heads, head_dim, scale, softcap)
        self.wrappers: dict[int | None, Any] = {}     # flashinfer's wrappers (untyped)
        self._planned: set[int | None] = set()

    def _wrapper(self, window: int | None) -> Any:
        if window not in self.wrappers:
            import flashinfer

            workspace = torch.empty(128 << 20, dtype=torch.uint8, device=self.pool.k.device)
            self.wrappers[window] = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, kv_layout="NHD")
        return self.wrappers[window]

    def plan(self, batch):
        super().plan(batch)
        self._planned = set()

    def _plan(self, window: int | None):
        n = len(self.batch.qo_indptr) - 1
        self._wrapper(window).plan(
            self.qo_indptr, self.kv_indptr, self.kv_indices, torch.ones(n, dtype=torch.int32), self.num_heads,
            self.pool.k.shape[2], self.head_dim, 1, causal=True, sm_scale=self.scale,
            window_left=-1 if window is None else window - 1, logits_soft_cap=self.softcap or None,
            q_data_type=self.pool.k.dtype, kv_data_type=self.pool.k.dtype)
        self._planned.add(window)

    def forward(self, layer, q, k, v, window=None):
        if window not in self._planned:      # each window's plan once per batch, at its first layer
            self._plan(window)
        self.store(layer, k, v)
        kv = (self.pool.k[layer].unsqueeze(1), self.pool.v[layer].unsqueeze(1))
        q = q.contiguous()
        return self.wrappers[window].run(q, kv, out=torch.empty_like(q))
