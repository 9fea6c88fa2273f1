"""One preallocated pool of KV token slots per layer.

Page size is 1 token: the radix tree splits edges at arbitrary token boundaries, and with one-token
pages a split never copies or wastes KV (SGLang's default for the same reason). FlashInfer's paged
kernels take page_size=1 directly, so the GPU backends address the same layout.
"""
from __future__ import annotations

import torch


class KVPool:
    def __init__(self, num_slots: int, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        self.num_slots = num_slots
        shape = (num_layers, num_slots, num_kv_heads, head_dim)
        # attention reads only written slots, so on CPU the pool needs no zero fill (4 GiB: seconds);
        # on CUDA zeros keep the CUDA-graph scratch slot finite
        alloc = torch.zeros if torch.device(device).type == "cuda" else torch.empty
        self.k = alloc(shape, dtype=dtype, device=device)
        self.v = alloc(shape, dtype=dtype, device=device)
        self._free = torch.arange(num_slots, dtype=torch.int64)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> torch.Tensor | None:
        """n free slot ids (CPU int64), or None when fewer than n are free."""
        if n > len(self._free):
            return None
        out, self._free = self._free[:n], self._free[n:]
        return out

    def reserve(self, n: int) -> torch.Tensor:
        """Take n slots out of circulation for good (e.g. a scratch slot for padded rows)."""
        out, self._free = self._free[-n:], self._free[:-n]
        return out

    def free(self, slots: torch.Tensor) -> None:
        if len(slots):
            self._free = torch.cat([self._free, slots.to(torch.int64)])
