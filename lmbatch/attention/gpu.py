"""GPU attention backends: our Triton kernel and FlashInfer, and whether FlashInfer's kernels are built."""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from pathlib import Path
from typing import Any

import torch

from lmbatch.attention.base import AttentionBackend, ForwardBatch, no_sinks, to_device
from lmbatch.attention.kv_pool import KVPool


class _DeviceMeta(AttentionBackend):
    """Copies the batch's ragged metadata to the device once per batch."""

    def plan(self, batch: ForwardBatch) -> None:
        super().plan(batch)
        dev = self.pool.k.device
        self.qo_indptr = torch.tensor(batch.qo_indptr, dtype=torch.int32)
        self.kv_indptr = torch.tensor(batch.kv_indptr, dtype=torch.int32)
        self.kv_indices = to_device(batch.kv_indices.to(torch.int32), dev)
        self.max_q_len = max(b - a for a, b in zip(batch.qo_indptr, batch.qo_indptr[1:]))


class TritonBackend(_DeviceMeta):
    def plan(self, batch: ForwardBatch) -> None:
        super().plan(batch)
        dev = self.pool.k.device
        self.qo_dev = to_device(self.qo_indptr, dev)
        self.kv_dev = to_device(self.kv_indptr, dev)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """One new token per sequence (a decode step): the split decode kernel, as the decode graphs run it;
        otherwise, and in deterministic mode, the extend kernel (a query's keys in blocks from its first key,
        whatever the batch). Both take gpt-oss's attention sinks."""
        from lmbatch.kernels.decode_attention import decode_attention
        from lmbatch.kernels.extend_attention import extend_attention

        self.store(layer, k, v)
        if self.max_q_len == 1 and not self.deterministic:     # the split kernel's ranges depend on the batch
            return decode_attention(q, self.pool.k[layer], self.pool.v[layer], self.kv_indices, self.kv_dev,
                                    self.scale, window, self.softcap, sinks=sinks)
        return extend_attention(q, self.pool.k[layer], self.pool.v[layer], self.kv_indices, self.qo_dev,
                                self.kv_dev, self.max_q_len, self.scale, window, self.softcap, self.deterministic,
                                sinks)


class FlashInferBackend(_DeviceMeta):
    """Paged prefill (new tokens over the cached prefix, causal, bottom-right aligned) with page size 1;
    planned once per batch, workspace reused. Decode batches go through the same kernel with q_len 1.
    A sliding window is part of FlashInfer's plan (`window_left`: keys before the query's own), so a
    model with global and sliding-window layers keeps one planned wrapper per window."""

    def __init__(self, pool: KVPool, num_heads: int, head_dim: int, scale: float | None = None,
                 softcap: float = 0.0) -> None:
        super().__init__(pool, num_heads, head_dim, scale, softcap)
        self.wrappers: dict[int | None, Any] = {}     # flashinfer's wrappers (untyped)
        self._planned: set[int | None] = set()

    def _wrapper(self, window: int | None) -> Any:
        if window not in self.wrappers:
            import flashinfer

            workspace = torch.empty(128 << 20, dtype=torch.uint8, device=self.pool.k.device)
            self.wrappers[window] = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, kv_layout="NHD")
        return self.wrappers[window]

    def plan(self, batch: ForwardBatch) -> None:
        super().plan(batch)
        self._planned = set()

    def _plan(self, window: int | None) -> None:
        n = len(self.batch.qo_indptr) - 1
        self._wrapper(window).plan(
            self.qo_indptr, self.kv_indptr, self.kv_indices, torch.ones(n, dtype=torch.int32), self.num_heads,
            self.pool.k.shape[2], self.head_dim, 1, causal=True, sm_scale=self.scale,
            window_left=-1 if window is None else window - 1, logits_soft_cap=self.softcap or None,
            q_data_type=self.pool.k.dtype, kv_data_type=self.pool.k.dtype)
        self._planned.add(window)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        no_sinks("flashinfer", sinks)
        if window not in self._planned:      # each window's plan once per batch, at its first layer
            self._plan(window)
        self.store(layer, k, v)
        kv = (self.pool.k[layer].unsqueeze(1), self.pool.v[layer].unsqueeze(1))
        q = q.contiguous()
        return self.wrappers[window].run(q, kv, out=torch.empty_like(q))


_DTYPES = {"bfloat16": "bf16", "float16": "f16"}


def _flashinfer_arch() -> str:
    """FlashInfer's folder for this machine's GPUs: their capabilities joined, 9.0 as "90a"."""
    archs = sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
    return "_".join(f"{major}{minor}{'a' if major >= 9 else ''}" for major, minor in archs)


def flashinfer_built(head_dim: int, dtype: str, windowed: bool, softcap: bool) -> tuple[bool, str]:
    """Whether FlashInfer's batch-prefill module for this model is compiled already (its first use
    compiles it, a minute or two), without importing FlashInfer (seconds): (built, where, or "not
    installed"). Read from FlashInfer 0.7's JIT cache layout, `$FLASHINFER_WORKSPACE_BASE/.cache/
    flashinfer/<version>/<arch>/cached_ops/<uri>/<uri>.so`, the uri as its `get_batch_prefill_uri`
    names the module (the sm90 "fa3" variant for head dims 64, 128 and 256 on Hopper, as its auto
    backend picks). A layout or version this does not know reads as not built: Triton runs."""
    if importlib.util.find_spec("flashinfer") is None:
        return False, "not installed"
    short = _DTYPES.get(dtype)
    if short is None or not torch.cuda.is_available():
        return False, f"no kernels for {dtype}"
    arch = _flashinfer_arch()
    fa3 = arch == "90a" and head_dim in (64, 128, 256)
    uri = (f"batch_prefill_with_kv_cache_dtype_q_{short}_dtype_kv_{short}_dtype_o_{short}_dtype_idx_i32_"
           f"head_dim_qk_{head_dim}_head_dim_vo_{head_dim}_posenc_0_use_swa_{windowed}_use_logits_cap_{softcap}"
           f"_f16qk_False" + ("_sm90" if fa3 else "_kv_stride_equal"))
    try:
        version = importlib.metadata.version("flashinfer-python")
    except importlib.metadata.PackageNotFoundError:
        return False, "not installed"
    base = Path(os.environ.get("FLASHINFER_WORKSPACE_BASE") or Path.home())
    so = base / ".cache" / "flashinfer" / version / arch / "cached_ops" / uri / f"{uri}.so"
    return so.is_file(), str(so.parent)
