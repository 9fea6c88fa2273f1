"""A run's use of the KV pool: matching prompts against the radix cache, allocating and evicting.

Queued generation requests are promised their decode slots when they are queued: allocations for
anything else leave that many slots free. Without a cache (`--no-cache`), each request keeps its own
slots, which die with it.
"""
from __future__ import annotations

from typing import NamedTuple, cast

import numpy as np

from lmbatch.attention.kv_pool import KVPool, Slots
from lmbatch.engine.radix_cache import Node, RadixTree
from lmbatch.requests import RunStats

EVICT_SHARE = 16    # evict at least 1/16 of the pool at once: one scan of the tree per share, not per request
_NONE: Slots = np.empty(0, dtype=np.int64)


class Match(NamedTuple):
    slots: Slots            # KV slots of the matched prefix
    node: Node | None       # the tree node it ends in (None without a cache)
    length: int


class KVSlots:
    def __init__(self, pool: KVPool, tree: RadixTree | None, stats: RunStats):
        self.pool, self.tree, self.stats = pool, tree, stats
        self.promised = 0                               # slots kept free for queued requests' decode
        self.own: dict[int, Slots] = {}                 # without a cache: each request's own KV

    def match(self, i: int, toks: list[int]) -> Match:
        """The longest prefix of request i's tokens whose KV is in the pool."""
        if self.tree is None:
            own = self.own.get(i, _NONE)
            return Match(own, None, len(own))
        slots, node = self.tree.match_prefix(toks)
        return Match(slots, node, len(slots))

    def lock(self, node: Node | None) -> None:
        if node is not None:        # a node comes only from the tree
            cast(RadixTree, self.tree).lock(node)

    def unlock(self, node: Node | None) -> None:
        if node is not None:
            cast(RadixTree, self.tree).unlock(node)

    def alloc(self, n: int) -> Slots | None:
        """n slots, leaving free those promised to queued requests."""
        return self.pool.alloc(n) if self.make_free(n + self.promised) else None

    def make_free(self, n: int) -> bool:
        """Whether n slots are free, after evicting unlocked cache if needed."""
        short = n - self.pool.num_free
        if short > 0 and self.tree is not None:
            # In DFS order every node a later request needs is on the current (locked) path, so
            # evicting in bulk loses no hit.
            self.stats.evicted_tokens += self.tree.evict(max(short, self.pool.num_slots // EVICT_SHARE))
        return self.pool.num_free >= n

    def free(self, slots: Slots) -> None:
        self.pool.free(slots)

    def keep(self, toks: list[int], slots: Slots, prompt_len: int, node: Node | None) -> None:
        """A generation request has ended: insert its prompt and the output tokens whose KV was computed
        (`toks`, on the first len(toks) of `slots`) into the tree, so later calls extending it hit, and
        free the rest. Without a cache, free it all."""
        if self.tree is None:
            self.pool.free(slots)
            return
        present, _ = self.tree.insert(toks, slots[:len(toks)])
        self.pool.free(slots[prompt_len:present])
        self.pool.free(slots[len(toks):])
        self.tree.unlock(cast(Node, node))   # with a tree, match() always gives a node
