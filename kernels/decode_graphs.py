"""CUDA graphs for decode steps, one per batch-size bucket.

A decode step of B sequences (one new token each) is launch-bound: dozens of small kernels per layer.
Each bucket's whole forward is captured once over static input buffers and replayed; attention
inside the graph is our Triton kernel, which reads its metadata (kv_indptr, kv_indices) from device
buffers refreshed before each replay. A batch is padded up to its bucket: padding rows read and
write one scratch KV slot that the pool never hands out.
"""
from __future__ import annotations

import torch

from lmbatch.attention import AttentionBackend, ForwardBatch

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class _GraphAttention(AttentionBackend):
    """Triton decode attention over static device buffers (no host work inside the graph)."""

    def __init__(self, pool, num_heads, head_dim, qo_indptr, kv_indptr, kv_indices):
        super().__init__(pool, num_heads, head_dim)
        self.qo, self.kv, self.kv_indices = qo_indptr, kv_indptr, kv_indices

    def plan(self, batch):
        self.batch = batch

    def forward(self, layer, q, k, v):
        from lmbatch.kernels.extend_attention import extend_attention

        self.store(layer, k, v)
        return extend_attention(q, self.pool.k[layer], self.pool.v[layer], self.kv_indices, self.qo, self.kv, 1,
                                self.scale)


class DecodeGraphs:
    def __init__(self, model, pool, scratch_slot: int, max_batch: int):
        self.model, self.pool, self.scratch = model, pool, scratch_slot
        dev = pool.k.device
        self.buckets = [b for b in BUCKETS if b <= max(max_batch, 1)]
        n = self.buckets[-1]
        self.ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.pos = torch.zeros(n, dtype=torch.int64, device=dev)
        self.out_slots = torch.full((n,), scratch_slot, dtype=torch.int64, device=dev)
        self.kv_indptr = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.kv_indices = torch.full((pool.num_slots,), scratch_slot, dtype=torch.int32, device=dev)
        self.qo_indptr = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.rows = torch.arange(n, dtype=torch.int64, device=dev)  # every graph input must outlive capture
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool_handle = None

    def _capture(self, b: int):
        cfg = self.model.cfg
        attn = _GraphAttention(self.pool, cfg.num_heads, cfg.head_dim, self.qo_indptr[:b + 1],
                               self.kv_indptr[:b + 1], self.kv_indices)
        batch = ForwardBatch(self.ids[:b], self.pos[:b], self.out_slots[:b], [], [], self.kv_indices, self.rows[:b])
        self.kv_indptr[:b + 1] = torch.arange(b + 1, dtype=torch.int32, device=self.ids.device)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up: Triton JIT and allocator, outside the capture
                self.model(batch, attn)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool_handle):
            logits = self.model(batch, attn)
        self.pool_handle = graph.pool()
        self.graphs[b] = (graph, logits)

    def run(self, tokens: list[int], positions: list[int], seqs: list[torch.Tensor]) -> torch.Tensor:
        """One decode step: token t of sequence i sits at positions[i]; seqs[i] are its KV slots up to
        and including that position. Returns float32 logits [len(tokens), vocab]."""
        n = len(tokens)
        b = next(x for x in self.buckets if x >= n)
        if b not in self.graphs:
            self._capture(b)
        pad = b - n
        dev = self.ids.device
        lens = [len(s) for s in seqs] + [1] * pad
        indptr = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        flat = torch.cat(list(seqs) + [torch.full((pad,), self.scratch, dtype=torch.int64)]).to(torch.int32)
        host = torch.cat([torch.tensor(tokens + [0] * pad), torch.tensor(positions + [0] * pad),
                          torch.cat([torch.stack([s[-1] for s in seqs]), torch.full((pad,), self.scratch)])])
        host = host.pin_memory().to(dev, non_blocking=True)
        self.ids[:b], self.pos[:b], self.out_slots[:b] = host[:b], host[b:2 * b], host[2 * b:]
        self.kv_indptr[:b + 1] = indptr.pin_memory().to(dev, non_blocking=True)
        if len(flat) > len(self.kv_indices):  # shared prefixes counted per sequence: grow, recapture
            self.kv_indices = torch.full((2 * len(flat),), self.scratch, dtype=torch.int32, device=dev)
            self.graphs.clear()
            return self.run(tokens, positions, seqs)
        self.kv_indices[:len(flat)] = flat.pin_memory().to(dev, non_blocking=True)
        graph, logits = self.graphs[b]
        graph.replay()
        return logits[:n]
