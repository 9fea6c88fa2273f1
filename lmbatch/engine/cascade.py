"""The shared levels of a decode step, found on the radix tree (kernels/cascade_attention.py reads them).

A running request's prompt is the path from the tree's root to its node, so two rows whose paths
pass through one node hold that node's KV slots at the same positions. A *level* is a run of nodes
on a path that the same rows pass through (two or more); a row's levels are its first keys, level
after level, and its own keys follow (its output tokens, and any deeper sharing past LEVELS).

The plan depends only on which node each row's prompt ends in, so a step whose rows are those of the
last step reuses it; only the levels' offsets into the step's key table are new each step.
"""
from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from lmbatch.engine.radix_cache import Node

MIN_KEYS = 16       # a shorter run of shared keys is read as each row's own: a level costs a merge per row
# a step whose rows changed takes the last plan's levels for the rows that end where its rows did (the others
# read all their keys as their own) until more than this share of its rows are new: then it plans anew
REPLAN_NEW = 1 / 8
Levels = list[tuple[Node, int, int]]     # a row's levels: (first node, first key, end key), top down


@dataclass
class EndLevels:
    """The levels planned for the rows that end at each node (`replan` reads them): the node's row of
    `table` (level numbers, -1 past its last; the table's last row: a row with no end), `skip` and `count`
    (a row's skip and levels) by that row, and each level's (first key, keys, level index) in `info`."""
    rows: dict[Node, int]
    table: np.ndarray           # [ends + 1, levels]
    skip: np.ndarray            # [ends + 1]
    count: np.ndarray           # [ends + 1]
    info: np.ndarray            # [level numbers, 3]


@dataclass
class LevelPlan:
    """Shared levels of a set of rows: per row, the keys its levels cover (`skip`) and how many levels
    (`levels`); per block of rows of one level, a row holding it (`rep`), where the level starts in that
    row's keys (`start`), its keys, its level index and the block's rows (`rows`, padded with 0); `by_end`,
    the levels it gave each end node."""
    skip: np.ndarray            # [n]
    levels: np.ndarray          # [n]
    rep: np.ndarray             # [blocks]
    start: np.ndarray           # [blocks]
    keys: np.ndarray            # [blocks]
    level: np.ndarray           # [blocks]
    count: np.ndarray           # [blocks] rows in the block
    rows: np.ndarray            # [blocks, per_block]
    by_end: EndLevels

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


def _levels(path: list[Node], rows: Counter, max_levels: int) -> Levels:
    """A path's levels: (first node, first key, end key), top down."""
    out: Levels = []
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


def _end_levels(paths: dict[int, list[Node]], rows: Counter, max_levels: int, end: Node) -> Levels:
    return _levels(paths[id(end)], rows, max_levels)


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
        plan = _blocks(ends, functools.partial(_end_levels, paths, rows, max_levels), per_block)
        if plan is None or plan.num_blocks <= max_blocks:
            return plan
        max_levels -= 1
    return None


def replan(ends: Sequence[Node | None], last: LevelPlan, per_block: int, max_blocks: int) -> LevelPlan | None:
    """A plan for rows whose prompts end at `ends` made from `last`, another set of rows': a row that ends
    where one of last's did takes its levels, whatever rows share them now (they hold the same slots: a
    level is a stretch of their common path), the others none; None where more than REPLAN_NEW of the
    rows are new, no row has a level, or the blocks are more than `max_blocks` (`plan_levels` then)."""
    known = last.by_end
    u = np.fromiter((-2 if e is None else known.rows.get(e, -1) for e in ends), dtype=np.int64, count=len(ends))
    if np.count_nonzero(u == -1) > REPLAN_NEW * len(ends):
        return None
    u[u < 0] = len(known.table) - 1
    plan = _assemble(u, known, per_block)
    return plan if plan is not None and plan.num_blocks <= max_blocks else None


def _blocks(ends: Sequence[Node | None], levels_of: Callable[[Node], Levels], per_block: int) -> LevelPlan | None:
    """The plan of rows whose prompts end at `ends`, an end's levels being `levels_of(end)`: each level's
    rows in row order, cut into blocks of `per_block`, the levels in the order of the first row holding
    them (Python once an end, numpy on the rows)."""
    index: dict[Node, int] = {}            # distinct ends, in the order of their first row
    u = np.empty(len(ends), dtype=np.int64)
    for i, end in enumerate(ends):
        if end is None:
            u[i] = -1
            continue
        j = index.get(end)
        if j is None:
            j = index[end] = len(index)
        u[i] = j
    first: dict[Node, int] = {}             # a level's first node -> its number
    info: list[tuple[int, int, int]] = []   # a level's (first key, keys, level index)
    lid: list[list[int]] = []               # an end's levels' numbers
    skip = np.zeros(len(index) + 1, dtype=np.int64)
    for j, end in enumerate(index):
        ids = []
        levels = levels_of(end)
        for k, (node, begin, stop) in enumerate(levels):
            t = first.get(node)
            if t is None:
                t = first[node] = len(info)
                info.append((begin, stop - begin, k))
            ids.append(t)
        lid.append(ids)
        if levels:
            skip[j] = levels[-1][2]
    if not info:
        return None
    count = np.array([len(ids) for ids in lid] + [0], dtype=np.int64)
    table = np.full((len(lid) + 1, int(count.max())), -1, dtype=np.int64)    # the last row: no end
    for j, ids in enumerate(lid):
        table[j, :len(ids)] = ids
    u[u < 0] = len(lid)
    return _assemble(u, EndLevels(index, table, skip, count, np.array(info, dtype=np.int64)), per_block)


def _assemble(u: np.ndarray, ends: EndLevels, per_block: int) -> LevelPlan | None:
    """The plan of rows whose ends are rows `u` of `ends`: each level's rows in row order, cut into blocks
    of `per_block`, the levels in the order of their numbers."""
    row_levels = ends.table[u]
    held = row_levels >= 0
    r = np.nonzero(held)[0]                 # each (row, level) held, rows ascending
    if not len(r):
        return None
    lv = row_levels[held]
    order = np.argsort(lv, kind="stable")   # by level, rows ascending within one
    lv, r = lv[order], r[order]
    new_level = np.concatenate([[True], lv[1:] != lv[:-1]])
    rank = np.arange(len(lv)) - np.flatnonzero(new_level)[np.cumsum(new_level) - 1]
    new_block = rank % per_block == 0
    block = np.cumsum(new_block) - 1
    rows = np.zeros((int(block[-1]) + 1, per_block), dtype=np.int64)
    rows[block, rank % per_block] = r
    heads = np.flatnonzero(new_block)
    meta = ends.info[lv[heads]]
    return LevelPlan(ends.skip[u], ends.count[u], r[heads], meta[:, 0], meta[:, 1], meta[:, 2],
                     np.bincount(block, minlength=len(heads)).astype(np.int64), rows, ends)
