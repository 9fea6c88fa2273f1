"""Decode rows' KV slot lists kept on the device from one step to the next.

A decode step's attention reads each row's keys through one flat index (`kv_indices`, row i's slots at
kv_indptr[i]:kv_indptr[i + 1]). Sent whole every step, that index is every running row's context: at
1,024 rows of ~1,000 tokens, 8 MB to join on the host and to copy before the step's graph can start.
But a row's slot list is one array from its admission to its end (its prompt's slots, then those
reserved for its output), of which each step reads one token more. So each array is sent once, into a
device arena, where it stays while it is in the steps; a step sends only each row's offset there and
its length, and the device gathers the flat index from the arena.

Arrays are known by identity (the same array object step after step; a caller that passes a new array
each step gets it sent each step), and held while they have a place, so that no other array takes their
id. An array a step no longer passes keeps its place until the arena is full; then every array of that
step is placed anew from the start and the others are let go (compacted). Position 0 holds the scratch
slot that padding rows read.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

ROOM = 4        # the arena holds this many times a compacted step's slots: placed anew rarely


class Placed(NamedTuple):
    offsets: np.ndarray         # int64: where each row's array begins in the arena
    sizes: np.ndarray           # int64: each row's array's length
    start: int                  # where the arrays new to the arena go, one after another
    fresh: list[np.ndarray]     # those arrays, to be written there before the step's gather


class SlotArena:
    """Where each array of slots sits in the device arena (host side), and the arena itself."""

    def __init__(self, scratch: int, device: torch.device | str) -> None:
        self.scratch, self.device = scratch, device
        self.capacity = 0
        self.top = 1                # the next free position (0: the scratch slot)
        self.offset: dict[int, int] = {}            # id(array) -> its place: arrays placed since the last compaction
        self.held: dict[int, np.ndarray] = {}       # id(array) -> the array (kept alive: its id stays its own)
        self.buffer = torch.empty(0, dtype=torch.int32, device=device)

    def place(self, seqs: list[np.ndarray]) -> Placed:
        """Offsets of `seqs`' arrays (in the arena already, or placed now after the last ones placed)."""
        keys = list(map(id, seqs))
        got = list(map(self.offset.get, keys))
        fresh: list[np.ndarray] = []
        if None in got:
            fresh = list({k: s for k, s, o in zip(keys, seqs, got) if o is None}.values())
            need = sum(map(len, fresh))
            if self.top + need > self.capacity:     # full: every array of this step placed anew
                fresh = list(dict(zip(keys, seqs)).values())
                self.capacity = max(self.capacity, ROOM * sum(map(len, fresh)) + 1)
                self.top, self.offset, self.held = 1, {}, {}
            start = self.top
            for a in fresh:
                self.offset[id(a)], self.held[id(a)] = self.top, a
                self.top += len(a)
            got = list(map(self.offset.__getitem__, keys))
        else:
            start = self.top
        return Placed(np.array(got, dtype=np.int64), np.fromiter(map(len, seqs), dtype=np.int64, count=len(seqs)),
                      start, fresh)

    def write(self, placed: Placed, staged: torch.Tensor) -> None:
        """Put the fresh arrays (`staged`: their slots one after another, on the device) in their places, after
        growing the arena where `place` did (nothing in it is kept then: every array was fresh)."""
        if len(self.buffer) < self.capacity:
            self.buffer = torch.full((self.capacity,), self.scratch, dtype=torch.int32, device=self.device)
        if len(staged):
            self.buffer[placed.start:placed.start + len(staged)] = staged


def row_deltas(offsets: np.ndarray, indptr: np.ndarray) -> np.ndarray:
    """Per row, where its keys' index in the arena runs ahead of its place in the flat index (the gather's
    input): rows past `offsets` are padding, reading position 0 (the scratch slot)."""
    delta = -indptr[:-1].copy()
    delta[:len(offsets)] += offsets
    return delta


def gather(arena: torch.Tensor, delta: torch.Tensor, lens: torch.Tensor, total: int, iota: torch.Tensor,
           out: torch.Tensor) -> None:
    """out[:total] = each row's first lens[i] slots, one row after another: flat position p of row i reads
    arena[p + delta[i]]. On the device, without a sync (`total` is known)."""
    src = torch.repeat_interleave(delta, lens, output_size=total)
    src += iota[:total]
    torch.index_select(arena, 0, src, out=out[:total])
