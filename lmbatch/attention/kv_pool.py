"""One preallocated pool of KV token slots per layer.

Page size is 1 token: the radix tree splits edges at arbitrary token boundaries, and with one-token
pages a split never copies or wastes KV (SGLang's default for the same reason). FlashInfer's paged
kernels take page_size=1 directly, so the GPU backends address the same layout.

Slot ids live on the host as numpy int64 arrays: a run moves them per request (allocating, matching,
inserting), and a numpy op costs a tenth of a torch one on CPU tensors; they become a tensor once per
forward batch.
"""
from __future__ import annotations

import numpy as np
import torch

Slots = np.ndarray      # KV slot ids (int64)


class KVPool:
    keys_are_values = False         # LatentKVPool: the values are the keys

    def __init__(self, num_slots: int, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        self.num_slots = num_slots
        shape = (num_layers, num_slots, num_kv_heads, head_dim)
        # attention reads only written slots, so on CPU the pool needs no zero fill (4 GiB: seconds);
        # on CUDA zeros keep the CUDA-graph scratch slot finite
        alloc = torch.zeros if torch.device(device).type == "cuda" else torch.empty
        self.k = alloc(shape, dtype=dtype, device=device)
        self.v = self.k if self.keys_are_values else alloc(shape, dtype=dtype, device=device)
        # Free slot ids as a stack: alloc pops from the top, free pushes; each moves only its own
        # slots (a free that concatenated the whole list cost a copy of the pool's ids per release).
        # The top holds the next ids in descending order, so an allocation comes out ascending.
        self._stack = np.arange(num_slots - 1, -1, -1, dtype=np.int64)
        self._top = num_slots

    @property
    def num_free(self) -> int:
        return self._top

    def free_slots(self) -> list[int]:
        """The free slot ids (for checks; the next to be handed out last)."""
        return self._stack[:self._top].tolist()

    def alloc(self, n: int) -> Slots | None:
        """n free slot ids (an array of their own), or None when fewer than n are free."""
        if n > self._top:
            return None
        self._top -= n
        return self._stack[self._top:self._top + n][::-1].copy()

    def reserve(self, n: int) -> Slots:
        """Take n slots out of circulation for good (e.g. a scratch slot for padded rows)."""
        out, self._stack = self._stack[:n].copy(), self._stack[n:]
        self._top -= n
        return out

    def free(self, slots: Slots) -> None:
        n = len(slots)
        if self._top + n > len(self._stack):
            raise RuntimeError(f"KV pool: freeing {n} slots would exceed its {len(self._stack)} (a double free)")
        self._stack[self._top:self._top + n] = slots[::-1]
        self._top += n


class LatentKVPool(KVPool):
    """Latent attention's pool (DeepSeek-V3: model/network.py's LatentAttention): a token's one entry per layer
    (its normalized latent and rotated shared key) is both its key and its value, held once."""
    keys_are_values = True
