"""GPU attention backends: FlashInfer (the default on CUDA) and our Triton kernel."""
from __future__ import annotations

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

        self.full_view(window, layer)
        self.store(layer, k, v)
        return extend_attention(q, self.pool.k[layer], self.pool.v[layer], self.kv_indices, self.qo_dev,
                                self.kv_dev, self.max_q_len, self.scale)


class FlashInferBackend(_DeviceMeta):
    """Paged prefill (new tokens over the cached prefix, causal, bottom-right aligned) with page size 1;
    planned once per batch, workspace reused. Decode batches go through the same kernel with q_len 1."""

    def __init__(self, pool, num_heads, head_dim):
        super().__init__(pool, num_heads, head_dim)
        import flashinfer

        self.workspace = torch.empty(256 << 20, dtype=torch.uint8, device=pool.k.device)
        self.wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, kv_layout="NHD")

    def plan(self, batch):
        super().plan(batch)
        n = len(batch.qo_indptr) - 1
        self.wrapper.plan(self.qo_indptr, self.kv_indptr, self.kv_indices, torch.ones(n, dtype=torch.int32),
                          self.num_heads, self.pool.k.shape[2], self.head_dim, 1, causal=True,
                          sm_scale=self.scale, q_data_type=self.pool.k.dtype, kv_data_type=self.pool.k.dtype)

    def forward(self, layer, q, k, v, window=None):
        self.full_view(window, layer)
        self.store(layer, k, v)
        kv = (self.pool.k[layer].unsqueeze(1), self.pool.v[layer].unsqueeze(1))
        q = q.contiguous()
        return self.wrapper.run(q, kv, out=torch.empty_like(q))  # no zero-fill of a fresh output
