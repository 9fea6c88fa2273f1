"""The shared levels of a decode step, found on the radix tree (kernels/cascade_attention.py reads them).

A running request's prompt is the path from the tree's root to its node, so two rows whose paths
pass through one node hold that node's KV slots at the same positions. A *level* is a run of nodes
on a path that the same rows pass through (two or more); a row's levels are its first keys, level
after level, and its own keys follow (its output tokens, and any deeper sharing past LEVELS).

The plan depends only on which node each row's prompt ends in, so a step whose rows are those of the
last step reuses it; only the levels' offsets into the step's key table are new each step.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from lmbatch.engine.radix_cache import Node

MIN_KEYS = 16       # a shorter run of shared keys is read as each row's own: a level costs a merge per row


@dataclass
class LevelPlan:
    """Shared levels of a set of rows: per row, the keys its levels cover (`skip`) and how many levels
    (`levels`); per block of rows of one level, a row holding it (`rep`), where the level starts in that
    row's keys (`start`), its keys, its level index and the block's rows (`rows`, padded with 0)."""
    skip: np.ndarray            # [n]
    levels: np.ndarray          # [n]
    rep: np.ndarray             # [blocks]
    start: np.ndarray           # [blocks]
    keys: np.ndarray            # [blocks]
    level: np.ndarray           # [blocks]
    count: np.ndarray           # [blocks] rows in the block
    rows: np.ndarray            # [blocks, per_block]

    @property
    def num_blocks(self) -> int:
        return len(self.rep)

    def table(self, kv_indptr: np.ndarray) -> np.ndarray:
        """The blocks as the kernel reads them ([blocks, 4]: start in the step's key table, keys, level,
        rows), for a step whose row i's keys start at kv_indptr[i]."""
        return np.stack([kv_indptr[self.rep] + self.start, self.keys, self.level, self.count], axis=1)


def _path(end: Node) -> list[Node]:
    nodes = []
    while end.parent is not None:
        nodes.append(end)
        end = end.parent
    return nodes[::-1]


def _levels(path: list[Node], rows: Counter, max_levels: int) -> list[tuple[Node, int, int]]:
    """A path's levels: (first node, first key, end key), top down."""
    out: list[tuple[Node, int, int]] = []
    depth, i = 0, 0
    while i < len(path) and rows[path[i]] >= 2 and len(out) < max_levels:
        n, first, start = rows[path[i]], path[i], depth
        while i < len(path) and rows[path[i]] == n:
            depth += len(path[i].value)
            i += 1
        if depth - start < MIN_KEYS:
            break
        out.append((first, start, depth))
    return out


def plan_levels(ends: Sequence[Node | None], per_block: int, max_levels: int, max_blocks: int) -> LevelPlan | None:
    """The levels of rows whose prompts end at `ends` (None: a row with no tree path), or None where no
    rows share; at most `max_levels` a row and `max_blocks` blocks of `per_block` rows in all."""
    paths: dict[int, list[Node]] = {}
    many: Counter = Counter()
    for end in ends:
        if end is not None:
            many[id(end)] += 1
            if id(end) not in paths:
                paths[id(end)] = _path(end)
    rows: Counter = Counter()
    for key, path in paths.items():
        for node in path:
            rows[node] += many[key]
    while max_levels > 0:
        plan = _blocks(ends, paths, rows, per_block, max_levels)
        if plan is None or plan.num_blocks <= max_blocks:
            return plan
        max_levels -= 1
    return None


def _blocks(ends: Sequence[Node | None], paths: dict[int, list[Node]], rows: Counter, per_block: int,
            max_levels: int) -> LevelPlan | None:
    n = len(ends)
    skip, count = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
    members: dict[int, list[int]] = {}         # a level's first node -> its rows
    where: dict[int, tuple[int, int, int]] = {}  # -> (first key, end key, level)
    cached: dict[int, list[tuple[Node, int, int]]] = {}
    for i, end in enumerate(ends):
        if end is None:
            continue
        levels = cached.get(id(end))
        if levels is None:
            levels = cached[id(end)] = _levels(paths[id(end)], rows, max_levels)
        for k, (node, begin, stop) in enumerate(levels):
            members.setdefault(id(node), []).append(i)
            where[id(node)] = (begin, stop, k)
        if levels:
            skip[i], count[i] = levels[-1][2], len(levels)
    if not members:
        return None
    block: list[tuple[int, int, int, int, list[int]]] = []
    for key, rs in members.items():
        first, stop, k = where[key]
        for lo in range(0, len(rs), per_block):
            block.append((rs[lo], first, stop - first, k, rs[lo:lo + per_block]))
    table = np.zeros((len(block), per_block), dtype=np.int64)
    for j, b in enumerate(block):
        table[j, :len(b[4])] = b[4]
    rep, starts, keys, level = (np.array([b[c] for b in block], dtype=np.int64) for c in range(4))
    return LevelPlan(skip, count, rep, starts, keys, level, np.array([len(b[4]) for b in block], dtype=np.int64),
                     table)
