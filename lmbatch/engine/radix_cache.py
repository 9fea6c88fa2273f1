"""Radix tree over token ids whose edges map to KV slots (the runtime prefix cache).

Nodes on the path of an in-flight request are locked (lock_ref > 0) and never evicted. Eviction
frees the least recently used unlocked leaves and hands their slots back to the pool.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Callable, Iterator, cast

import numpy as np

from lmbatch.attention.kv_pool import Slots


@dataclass(eq=False)
class Node:
    key: list[int]                       # the edge's token ids
    value: Slots                         # their KV slots (same length)
    parent: "Node | None" = None
    children: dict[int, "Node"] = field(default_factory=dict)
    lock_ref: int = 0
    last_access: int = 0

    def __lt__(self, other: "Node") -> bool:  # heap order for eviction
        return self.last_access < other.last_access


def _common_len(a: list[int], b: list[int], start: int) -> int:
    """Length of the common prefix of a and b[start:] (whole edges compare at C speed)."""
    n = min(len(a), len(b) - start)
    if a[:n] == b[start:start + n]:
        return n
    lo, hi = 0, n            # a[:lo] matches, a[:hi] does not
    while hi - lo > 8:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[start + lo:start + mid]:
            lo = mid
        else:
            hi = mid
    while a[lo] == b[start + lo]:
        lo += 1
    return lo


class RadixTree:
    def __init__(self, free_slots: Callable[[Slots], None]):
        self.root = Node(key=[], value=np.empty(0, dtype=np.int64))
        self.root.lock_ref = 1  # the root is never evicted
        self._free_slots = free_slots
        self._clock = 0
        self.total_size = 0      # tokens held in the tree
        self.locked_size = 0     # tokens on locked paths

    @property
    def evictable_size(self) -> int:
        return self.total_size - self.locked_size

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def match_prefix(self, tokens: list[int]) -> tuple[Slots, Node]:
        """Slots of the longest cached prefix of tokens, and the node that ends exactly there."""
        node, pos, now = self.root, 0, self._tick()
        pieces = []
        node.last_access = now
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                break
            n = _common_len(child.key, tokens, pos)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            pieces.append(child.value)
            node, pos = child, pos + n
        slots = (pieces[0] if len(pieces) == 1 else np.concatenate(pieces)) if pieces else self.root.value
        return slots, node

    def match_len(self, tokens: list[int]) -> int:
        """Length of the longest cached prefix of tokens, without touching the tree (no split, no LRU)."""
        node, pos = self.root, 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                break
            n = _common_len(child.key, tokens, pos)
            pos += n
            if n < len(child.key):
                break
            node = child
        return pos

    def _split(self, child: Node, n: int) -> Node:
        """Split child's edge after n tokens; returns the new upper node."""
        upper = Node(key=child.key[:n], value=child.value[:n], parent=child.parent,
                     lock_ref=child.lock_ref, last_access=child.last_access)
        upper.children[child.key[n]] = child
        cast(Node, child.parent).children[child.key[0]] = upper     # a split edge is never the root
        child.key, child.value, child.parent = child.key[n:], child.value[n:], upper
        return upper

    def insert(self, tokens: list[int], slots: Slots) -> tuple[int, Node]:
        """Insert tokens -> slots. Returns (length of the prefix that was already cached, end node).

        Slots of that already-cached prefix stay owned by the caller (who frees the duplicates).
        """
        assert len(tokens) == len(slots)
        node, pos, now = self.root, 0, self._tick()
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                new = Node(key=list(tokens[pos:]), value=slots[pos:].copy(), parent=node, last_access=now)
                node.children[tokens[pos]] = new
                self.total_size += len(new.key)
                return pos, new
            n = _common_len(child.key, tokens, pos)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            node, pos = child, pos + n
        return pos, node

    def lock(self, node: Node) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self.locked_size += len(node.key)
            node.lock_ref += 1
            node = cast(Node, node.parent)      # not the root: it has a parent

    def unlock(self, node: Node) -> None:
        while node is not self.root:
            assert node.lock_ref > 0, "unlock of an unlocked node"
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.locked_size -= len(node.key)
            node = cast(Node, node.parent)      # not the root: it has a parent

    def evict(self, num_tokens: int) -> int:
        """Evict LRU unlocked leaves until num_tokens slots are freed (or nothing is left). Returns freed."""
        leaves = [n for n in self._nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(leaves)
        freed = 0
        while freed < num_tokens and leaves:
            leaf = heapq.heappop(leaves)
            parent = cast(Node, leaf.parent)    # a leaf is never the root: it has a parent
            del parent.children[leaf.key[0]]
            self._free_slots(leaf.value)
            freed += len(leaf.key)
            self.total_size -= len(leaf.key)
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(leaves, parent)
        return freed

    def _nodes(self) -> Iterator[Node]:
        stack = [self.root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node is not self.root:
                yield node
