"""Data parallelism's plan: a batch's radix tree cut into chunks along whole subtrees, each worker's
share a run of chunks that idle workers can take from.

Requests are taken in sorted order (a DFS of the radix tree: the plan's own order where a plan was
made, else `planner.sorted_lcps`); a chunk is a contiguous range of that order, so it is a union of
whole subtrees plus the path down to its first one, and the only tokens two chunks both compute are
the prefix their boundary requests share (the common prefix of the last request of one and the first
of the next). Each worker's share is cut where the workers' costs balance, moved to where the shared
prefix is short enough to pay for the imbalance: each cut minimizes |its distance from the balanced
point| + |the prefix it duplicates|, both in cost units. So a few-shot prefix of 500 tokens is split
between two workers rather than moving thousands of tokens of questions, and a cut lands between
subjects where that costs less. A share is then cut again into `per_worker` chunks of falling size:
a worker runs its own from the first, and one that runs out takes the last chunk not yet started from
the worker with the most left (engine/parallel.py), so workers end together whatever the cost model
missed, and what moves is small. (The first chunk is small too: a worker starts on it while it reads and
plans the next.)

The cost of a request is the tokens it computes (its edge of the tree) plus, for a generation, its
most new tokens times DECODE_COST.

Requests of one group (a program's calls) stay in one chunk; a group already placed (`pinned`: a
multi-stage program whose earlier calls ran on one worker, whose KV is cached there) is a chunk of
that worker's that no other worker takes, and the rest are cut around that load.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Iterable, NamedTuple, Sequence

import numpy as np

from lmbatch.requests import optimal_hit_rate
from lmbatch.scheduler.planner import sorted_lcps, sub_lcps, summarize_sorted

WINDOW = 1.0        # a cut may move up to this share of a part's target to find a shallower boundary
FALLING = 0.75      # each chunk of a worker's share is this much the size of the one before it
DECODE_COST = 2.0   # a generated token costs about two prompt tokens (a decode step reads the weights and its KV)


class Chunk(NamedTuple):
    requests: list[int]     # request indices, in sorted (DFS) order
    lcps: list[int]         # each one's common prefix with the one before it in the chunk (the first: 0)
    cost: float             # computed tokens, and generation weighted by DECODE_COST
    home: int               # the worker whose share it is
    pinned: bool            # its groups ran on `home` before: it runs there only


@dataclass
class Chunking:
    """A batch cut into chunks, with what each worker's or each set of chunks' optimum needs."""
    chunks: list[Chunk]
    unique_tokens: int              # of the whole batch's tree (one device computes these)
    prompt_tokens: int              # over executed requests (equal mergeable prompts once), whole batch
    ranks: list[np.ndarray]         # each chunk's requests' places in the whole sorted order
    lens: np.ndarray                # prompt lengths in sorted order
    lcps: np.ndarray                # and each one's common prefix with the one before it

    def unique_of(self, chunk_ids: Iterable[int]) -> int:
        """Tokens the tree of these chunks' requests together has: what one engine running them computes."""
        picked = [self.ranks[c] for c in chunk_ids]
        if not picked:
            return 0
        ranks = np.sort(np.concatenate(picked))
        return int((self.lens[ranks] - sub_lcps(self.lcps, ranks)).sum())


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
    """Cut a batch into `n` parts, one per worker (some may be empty when there are fewer groups than
    parts): `chunk_batch` with one chunk a worker, as request sets."""
    cut = chunk_batch(Batch(prompts, groups, mergeable), n, pinned=pinned, load=load)
    parts: list[list[int]] = [[] for _ in range(n)]
    owned: list[list[int]] = [[] for _ in range(n)]
    for c, ch in enumerate(cut.chunks):
        parts[ch.home] += ch.requests
        owned[ch.home].append(c)
    return Partition([sorted(p) for p in parts], cut.unique_tokens, [cut.unique_of(cs) for cs in owned],
                     cut.prompt_tokens)


class Batch(NamedTuple):
    """A batch as `chunk_batch` cuts it: its requests' prompts (or, where their sorted order is given,
    just their lengths), groups and costs beyond their edges."""
    prompts: Sequence[Sequence[int]] | Sequence[int]
    groups: Sequence[Hashable] | None = None        # request i's group (default: each request its own)
    mergeable: Sequence[bool] | None = None         # as `make_plan`: equal prompts execute once
    extra: Sequence[float] | None = None            # cost of each request beyond its edge (generation)
    lengths: bool = False                           # `prompts` holds lengths

    def lens(self, order: Sequence[int]) -> np.ndarray:
        """The prompts' lengths, in `order`."""
        p = self.prompts
        return np.fromiter((p[i] if self.lengths else len(p[i]) for i in order),  # type: ignore[arg-type]
                           dtype=np.int64, count=len(order))


def chunk_batch(batch: Batch, n: int, per_worker: int = 1, *, pinned: dict[Hashable, int] | None = None,
                load: Sequence[float] | None = None, presorted: tuple[Sequence[int], np.ndarray] | None = None
                ) -> Chunking:
    """Cut a batch into chunks: each of the `n` workers' shares in up to `per_worker` chunks, and a
    chunk of each worker's pinned groups (`pinned`: group -> worker). `load`: cost each worker has to
    run already; `presorted`: the prompts' sorted order and adjacent common prefixes, where a plan has
    them (nothing is sorted again)."""
    if n < 1:
        raise ValueError("n must be at least 1")
    if presorted is None and batch.lengths:
        raise ValueError("a batch of lengths must come with its sorted order")
    order, lcps = presorted if presorted is not None else sorted_lcps(batch.prompts)  # type: ignore[arg-type]
    keys, members, cost, boundary = _units(batch, order, lcps)
    pinned = pinned or {}
    base = [float(x) for x in load] if load is not None else [0.0] * n
    held: dict[int, list[int]] = {}             # worker -> units pinned there
    free = []
    for u, g in enumerate(keys):
        if g in pinned:
            held.setdefault(pinned[g], []).append(u)
            base[pinned[g]] += cost[u]
        else:
            free.append(u)
    shares = [(worker, us, True) for worker, us in sorted(held.items())]
    fill = sorted(range(n), key=lambda k: (base[k], k))     # the least loaded worker takes the first range
    fcost, fbound = [cost[u] for u in free], [boundary[u] for u in free]
    for worker, (a, b) in zip(fill, _cuts(fcost, fbound, [base[k] for k in fill])):
        shares += [(worker, free[a + c:a + d], False) for c, d in _falling(fcost[a:b], fbound[a:b], per_worker)]
    return _chunks(shares, members, cost, order, lcps, batch)


def _units(batch: Batch, order: Sequence[int], lcps: np.ndarray
           ) -> tuple[list[Hashable], list[list[int]], list[float], list[int]]:
    """Groups in the order of their first request in the tree: each one's key, requests and cost (the
    edges of its requests, and their extra), and the prefix it shares with the tree before it."""
    keys: Sequence[Hashable] = batch.groups if batch.groups is not None else range(len(batch.prompts))
    new = (batch.lens(order) - lcps).tolist()        # each request's tokens past the one before it: the tree's edges
    index: dict[Hashable, int] = {}
    names: list[Hashable] = []
    members: list[list[int]] = []
    cost: list[float] = []
    boundary: list[int] = []
    extra = batch.extra
    for k, i in enumerate(order):
        g = keys[i]
        u = index.get(g)
        if u is None:
            u = index[g] = len(cost)
            names.append(g)
            members.append([])
            cost.append(0.0)
            boundary.append(int(lcps[k]))
        members[u].append(i)
        cost[u] += new[k] + (extra[i] if extra is not None else 0.0)
    return names, members, cost, boundary


def _chunks(shares: list[tuple[int, list[int], bool]], members: list[list[int]], cost: list[float],
            order: Sequence[int], lcps: np.ndarray, batch: Batch) -> Chunking:
    """The chunks of `shares` (worker, units, pinned), each's requests in sorted order, with the batch's figures."""
    count = len(order)
    order_a = np.asarray(order, dtype=np.int64)
    rank = np.empty(count, dtype=np.int64)
    rank[order_a] = np.arange(count)
    chunks, ranks = [], []
    for worker, us, pinned in shares:
        if not us:
            continue
        r = np.sort(rank[np.asarray([i for u in us for i in members[u]], dtype=np.int64)])
        chunks.append(Chunk(order_a[r].tolist(), sub_lcps(lcps, r).tolist(), sum(cost[u] for u in us), worker,
                            pinned))
        ranks.append(r)
    whole = summarize_sorted(batch.prompts, order, lcps, batch.mergeable, lengths=batch.lengths)
    return Chunking(chunks, whole.unique_tokens, whole.prompt_tokens, ranks, batch.lens(order),
                    np.asarray(lcps, dtype=np.int64))


def _cuts(cost: list[float], boundary: list[int], base: list[float]) -> list[tuple[int, int]]:
    """Contiguous ranges of the units, one per part (`base`: each part's load already, ascending),
    balanced by cost, each cut placed (within WINDOW of the balanced point) where its distance from
    that point plus the prefix it duplicates is least."""
    n = len(base)
    total = float(sum(cost))
    share = (total + sum(base)) / n
    need = [max(0.0, share - b) for b in base]              # what each part takes to reach the share
    scale = total / sum(need) if sum(need) else 0.0
    targets = np.cumsum([x * scale for x in need[:-1]]).tolist()
    return _cuts_at(cost, boundary, targets, [max(1.0, WINDOW * share)] * (n - 1))


def _falling(cost: list[float], boundary: list[int], k: int) -> list[tuple[int, int]]:
    """A share's units in up to `k` contiguous chunks (empty ones left out): a small one first (its worker
    starts on it while it reads the next), then each FALLING times the one before."""
    if k <= 1 or len(cost) <= 1:
        return [(0, len(cost))] if cost else []
    weights = np.asarray([FALLING ** (k - 1)] + [FALLING ** j for j in range(k - 1)])
    weights *= float(sum(cost)) / weights.sum()
    slacks = [max(1.0, WINDOW * min(a, b)) for a, b in zip(weights[:-1], weights[1:])]
    return [(a, b) for a, b in _cuts_at(cost, boundary, np.cumsum(weights[:-1]).tolist(), slacks) if b > a]


def _cuts_at(cost: list[float], boundary: list[int], targets: list[float],
             slacks: list[float]) -> list[tuple[int, int]]:
    """Contiguous ranges of the units, cut near each target (cost before the cut), each cut placed within
    its slack where its distance from the target plus the prefix it duplicates is least."""
    m = len(cost)
    if m == 0:
        return [(0, 0)] * (len(targets) + 1)
    acc = np.cumsum(np.asarray(cost, dtype=np.float64))     # acc[u]: cost of units 0..u
    bounds = np.asarray(boundary, dtype=np.int64)
    cuts = [0]
    for target, slack in zip(targets, slacks):
        lo = max(int(np.searchsorted(acc, target - slack, side="left")) + 1, cuts[-1])
        hi = int(np.searchsorted(acc, target + slack, side="right")) + 1
        if lo >= m:
            cuts.append(m)
            continue
        c = np.arange(lo, max(min(hi, m), lo + 1))          # cut c: units [c:] go on; c < m
        before = np.where(c > 0, acc[np.maximum(c - 1, 0)], 0)
        cuts.append(int(c[np.argmin(np.abs(before - target) + bounds[c])]))
    cuts.append(m)
    return [(cuts[k], cuts[k + 1]) for k in range(len(cuts) - 1)]
