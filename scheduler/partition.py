"""Data parallelism's plan: a batch's radix tree cut into parts along whole subtrees.

Requests are taken in sorted order (a DFS of the radix tree, `planner.sorted_lcps`); a part is a
contiguous range of that order, so it is a union of whole subtrees plus the path down to its first
one, and the only tokens two parts both compute are the prefix their boundary requests share (the
common prefix of the last request of one part and the first of the next). Cuts are placed where
the parts' computed tokens balance, moved to where the shared prefix is short enough to pay for the
imbalance: each cut minimizes |its distance from the balanced point| + |the prefix it duplicates|,
both in tokens the slower part computes. So a few-shot prefix of 500 tokens is split between two
parts rather than moving thousands of tokens of questions, and a cut lands between subjects where
that costs less.

Requests of one group (a program's calls) stay in one part; a group already placed (`pinned`: a
multi-stage program whose earlier calls ran on one worker, whose KV is cached there) keeps its part,
and the rest are cut around that load.
"""
from __future__ import annotations

from typing import Hashable, NamedTuple, Sequence

import numpy as np

from lmbatch.requests import optimal_hit_rate
from lmbatch.scheduler.planner import sorted_lcps, summarize_sorted

WINDOW = 1.0        # a cut may move up to this share of a part's target to find a shallower boundary


class Partition(NamedTuple):
    parts: list[list[int]]          # request indices of each part, ascending
    unique_tokens: int              # of the whole batch's tree (one device computes these)
    part_unique_tokens: list[int]   # of each part's own tree (what each part computes)
    prompt_tokens: int              # over executed requests (equal mergeable prompts once), whole batch

    @property
    def duplicated_tokens(self) -> int:
        """Tokens computed by more than one part: shared prefixes of the boundaries."""
        return sum(self.part_unique_tokens) - self.unique_tokens

    @property
    def optimal_hit_rate(self) -> float:
        """Theorem 3.1's optimum of the whole batch on one device."""
        return optimal_hit_rate(self.unique_tokens, self.prompt_tokens)

    @property
    def hit_rate(self) -> float:
        """The best the parts reach together: each computes its own tree once."""
        return optimal_hit_rate(sum(self.part_unique_tokens), self.prompt_tokens)


def partition(prompts: Sequence[Sequence[int]], n: int, groups: Sequence[Hashable] | None = None,
              pinned: dict[Hashable, int] | None = None, mergeable: Sequence[bool] | None = None,
              load: Sequence[int] | None = None) -> Partition:
    """Cut a batch into `n` parts (some may be empty when there are fewer groups than parts).

    `groups[i]`: request i's group (default: each request its own); `pinned`: group -> part for
    groups that must go to a given part; `mergeable`: as `make_plan` (equal prompts execute once);
    `load`: tokens each part has to compute already (its pinned requests' are added here)."""
    if n < 1:
        raise ValueError("n must be at least 1")
    count = len(prompts)
    keys: Sequence[Hashable] = groups if groups is not None else range(count)
    pinned = pinned or {}
    order, lcps = sorted_lcps(prompts)
    lens = np.fromiter((len(prompts[i]) for i in order), dtype=np.int64, count=count)
    new = lens - lcps                   # each request's tokens past the one before it: the tree's edges
    # groups in the order of their first request in the tree; each costs the edges of its requests
    unit_of: dict[Hashable, int] = {}
    units: list[list[int]] = []
    cost: list[int] = []
    boundary: list[int] = []            # shared prefix with the tree before the group's first request
    for k, i in enumerate(order):
        g = keys[i]
        u = unit_of.get(g)
        if u is None:
            u = unit_of[g] = len(units)
            units.append([])
            cost.append(0)
            boundary.append(int(lcps[k]))
        units[u].append(i)
        cost[u] += int(new[k])
    parts: list[list[int]] = [[] for _ in range(n)]
    base = [int(x) for x in load] if load is not None else [0] * n
    free: list[int] = []
    for u, g in enumerate(unit_of):
        if g in pinned:
            parts[pinned[g]].extend(units[u])
            base[pinned[g]] += cost[u]
        else:
            free.append(u)
    fill = sorted(range(n), key=lambda k: (base[k], k))     # the least loaded part takes the first range
    ranges = _cuts([cost[u] for u in free], [boundary[u] for u in free], [base[k] for k in fill])
    for part, (a, b) in zip(fill, ranges):
        for u in free[a:b]:
            parts[part].extend(units[u])
    for p in parts:
        p.sort()
    whole = summarize_sorted(prompts, order, lcps, mergeable)
    rank = np.empty(count, dtype=np.int64)
    rank[np.asarray(order, dtype=np.int64)] = np.arange(count)
    per = []
    for p in parts:         # each part's own tree, from the whole one's sorted order: no sort again
        ranks = np.sort(rank[np.asarray(p, dtype=np.int64)])
        per.append(summarize_sorted(prompts, [order[r] for r in ranks], _sub_lcps(lcps, ranks), mergeable).unique_tokens
                   if len(p) else 0)
    return Partition(parts, whole.unique_tokens, per, whole.prompt_tokens)


def _sub_lcps(lcps: np.ndarray, ranks: np.ndarray) -> np.ndarray:
    """Adjacent common prefixes of the sorted prompts at `ranks` (ascending) of the whole sorted
    order: two sorted prompts share the least of the adjacent common prefixes between them."""
    out = np.zeros(len(ranks), dtype=np.int64)
    if len(ranks) > 1:
        out[1:] = np.minimum.reduceat(lcps[:ranks[-1] + 1], ranks[:-1] + 1)
    return out


def _cuts(cost: list[int], boundary: list[int], base: list[int]) -> list[tuple[int, int]]:
    """Contiguous ranges of the units, one per part (`base`: each part's load already, ascending),
    balanced by cost, each cut placed (within WINDOW of the balanced point) where its distance from
    that point plus the prefix it duplicates is least."""
    n, m = len(base), len(cost)
    if m == 0:
        return [(0, 0)] * n
    acc = np.cumsum(np.asarray(cost, dtype=np.int64))       # acc[u]: cost of units 0..u
    total = int(acc[-1])
    share = (total + sum(base)) / n
    need = [max(0.0, share - b) for b in base]              # what each part takes to reach the share
    scale = total / sum(need) if sum(need) else 0.0
    slack = max(1.0, WINDOW * share)
    bounds = np.asarray(boundary, dtype=np.int64)
    cuts, target = [0], 0.0
    for k in range(1, n):
        target += need[k - 1] * scale                       # tokens before cut k
        lo = max(int(np.searchsorted(acc, target - slack, side="left")) + 1, cuts[-1])
        hi = int(np.searchsorted(acc, target + slack, side="right")) + 1
        if lo >= m:
            cuts.append(m)
            continue
        c = np.arange(lo, max(min(hi, m), lo + 1))          # cut c: units [c:] go on; c < m
        before = np.where(c > 0, acc[np.maximum(c - 1, 0)], 0)
        cuts.append(int(c[np.argmin(np.abs(before - target) + bounds[c])]))
    cuts.append(m)
    return [(cuts[k], cuts[k + 1]) for k in range(n)]
