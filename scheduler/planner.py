"""Offline planner: the full radix tree of a batch's prompts, its optimal hit rate, the execution order.

Definitions (reported by every run):
- Theorem-3.1 optimum (SGLang paper): 1 - sum(|edge|) / sum(prompt tokens) over the radix tree of
  all prompts: every distinct prefix is computed exactly once.
- Engine optimum: the best this engine can reach. It computes every edge once and captures logits
  at any position while that position is computed, also for requests whose prompt is wholly a
  prefix (or a duplicate) of another, so with a cold cache and one planned batch the two are equal.
  They differ only when a prompt's logits are needed at positions another call already left in the
  cache (logits are not stored in the cache): then at least the last of those tokens is recomputed.
"""
from __future__ import annotations

import random
import sys
from array import array
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Sequence, cast

import numpy as np

from lmbatch.requests import GenerateRequest, ScoreRequest, optimal_hit_rate

SCHEDULES = ("dfs", "fcfs", "random")
TOKEN_BYTES = array("I").itemsize     # a token id in a sort key (`sort_key`): 4 on every platform we know
_LITTLE_ENDIAN = sys.byteorder == "little"


@dataclass(eq=False)
class PlanNode:
    start: int                      # depth of the edge's first token
    end: int                        # depth after its last token
    owner: int                      # a request whose prompt runs through this node
    parent: "PlanNode | None" = None
    children: list["PlanNode"] = field(default_factory=list)

    @property
    def length(self) -> int:
        return self.end - self.start


@dataclass
class Plan:
    order: list[int]                # executed requests (indices into the prompts), in execution order
    members: dict[int, list[int]]   # executed request -> the requests it serves (itself first)
    root: PlanNode
    ends: list[PlanNode]            # node where each request's prompt ends
    prompt_tokens: int              # over executed requests
    unique_tokens: int              # sum of edge lengths
    # every request in sorted order (a DFS of the tree) and each one's common prefix with the one before:
    # what data parallelism cuts into parts without sorting the prompts again (scheduler/partition.py)
    dfs: list[int] = field(default_factory=list)
    lcps: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    @property
    def optimal_hit_rate(self) -> float:
        return optimal_hit_rate(self.unique_tokens, self.prompt_tokens)

    engine_optimal_hit_rate = optimal_hit_rate  # equal for one planned batch on a cold cache (see above)

    def summary(self, logit_rows: Sequence[int]) -> PlanSummary:
        """`summarize`'s figures of the planned batch, from its tree (`logit_rows`: of each request)."""
        attended, stack = 0, [self.root]
        while stack:
            node = stack.pop()
            attended += (node.end * (node.end + 1) - node.start * (node.start + 1)) // 2
            stack.extend(node.children)
        return PlanSummary(len(self.ends), len(self.order), self.prompt_tokens, self.unique_tokens, attended,
                           sum(logit_rows[j] for j in self.order))

    def path(self, i: int) -> list[PlanNode]:
        """Nodes from the root's first child down to request i's end node."""
        out, node = [], self.ends[i]
        while node.parent is not None:
            out.append(node)
            node = node.parent
        return out[::-1]


def sorted_lcps(prompts: Sequence[Sequence[int]]) -> tuple[list[int], np.ndarray]:
    """The prompts' sorted order (equal prompts by index) and, for each prompt in that order, the length of
    its longest common prefix with the one before (0 for the first). A prompt object at several places (a
    select's one-token choices share their context's list) is sorted and compared once."""
    n = len(prompts)
    if n == 0:
        return [], np.zeros(0, dtype=np.int64)
    first: dict[int, int] = {}
    rep = [first.setdefault(id(p), i) for i, p in enumerate(prompts)]
    keys = {i: sort_key(prompts[i]) for i in first.values()}
    distinct = sorted(first.values(), key=keys.__getitem__)     # lexicographic, equal ones by index (stable)
    if len(distinct) == n:
        order = distinct
    else:
        places: dict[int, list[int]] = {}
        for i, r in enumerate(rep):
            places.setdefault(r, []).append(i)
        order = [i for r in distinct for i in places[r]]
    lcps = np.fromiter((len(prompts[i]) for i in order), dtype=np.int64, count=n)   # a repeat's: its length
    starts = [k for k in range(n) if rep[order[k]] == order[k]]                     # each object's first place
    lcps[starts] = _adjacent_lcps([keys[order[k]] for k in starts]) // TOKEN_BYTES
    if len(distinct) < n:       # equal prompts of different objects: by index, as a stable sort of all gives
        lens = np.fromiter((len(prompts[i]) for i in order), np.int64, n)
        same = np.zeros(n, dtype=bool)
        same[1:] = (lcps[1:] == lens[1:]) & (lens[1:] == lens[:-1])
        at = np.asarray(order, dtype=np.int64)
        order = at[np.lexsort((at, np.cumsum(~same)))].tolist()
    return order, lcps


def sub_lcps(lcps: np.ndarray, ranks: np.ndarray) -> np.ndarray:
    """Adjacent common prefixes of the sorted prompts at `ranks` (ascending) of a whole sorted order
    whose adjacent common prefixes are `lcps`: two sorted prompts share the least of the adjacent
    common prefixes between them (the first at `ranks` gets 0)."""
    out = np.zeros(len(ranks), dtype=np.int64)
    if len(ranks) > 1:
        out[1:] = np.minimum.reduceat(lcps[:ranks[-1] + 1], ranks[:-1] + 1)
    return out


def sort_key(tokens: Sequence[int]) -> bytes:
    """Token ids (0 <= id < 2**32) as bytes that sort as the ids do, lexicographically (each id big-endian in
    TOKEN_BYTES bytes; their common prefix in bytes, floored to TOKEN_BYTES, is the sequences' in tokens): two
    compare at memcmp speed, where lists compare id by id. Tree of thought's post-hoc optimum (62k sequences):
    sort and common prefixes 2.2 s as lists, 1.7 s as bytes, 0.9 s of it making the keys (py-spy, H200 host);
    6.1 s against 1.6 on this project's 2-core CPU (benchmarks/bench_posthoc_merge.py)."""
    a = array("I", tokens)
    if _LITTLE_ENDIAN:
        a.byteswap()
    return a.tobytes()


def _adjacent_lcps(seqs: list[bytes]) -> np.ndarray:
    """For each sort key, its longest common prefix in bytes with the one before it (0 for the first): slices
    compared (no Python work per byte)."""
    lcps = np.zeros(len(seqs), dtype=np.int64)
    for k in range(1, len(seqs)):
        lcps[k] = common_prefix(seqs[k - 1], seqs[k])
    return lcps


def common_prefix(a: Sequence[int], b: Sequence[int], start: int = 0) -> int:
    """The length of the common prefix of two sequences, known to be at least `start`: slices compared,
    each twice as long as the last, then the differing one halved down to the token."""
    n = min(len(a), len(b))
    if a is b:
        return n
    lo, step = start, 64
    while lo < n:
        hi = min(n, lo + step)
        if a[lo:hi] != b[lo:hi]:
            while hi - lo > 8:          # the first difference is in [lo, hi)
                mid = (lo + hi) // 2
                if a[lo:mid] == b[lo:mid]:
                    lo = mid
                else:
                    hi = mid
            while a[lo] == b[lo]:
                lo += 1
            return lo
        lo, step = hi, 2 * step
    return n


def build_tree(prompts: Sequence[Sequence[int]]) -> tuple[PlanNode, list[PlanNode], list[int]]:
    """Radix tree of all prompts, built from their sorted order and adjacent common prefixes.

    Returns (root, end node per prompt, sorted order). The sorted order is a DFS of the tree in
    which a prompt comes before its extensions.
    """
    order, lcps = sorted_lcps(prompts)
    root, ends = tree_from_sorted([len(p) for p in prompts], order, lcps.tolist())
    return root, ends, order


def tree_from_sorted(lens: Sequence[int], order: Sequence[int], lcps: Sequence[int]) -> tuple[PlanNode, list[PlanNode]]:
    """The radix tree of prompts of lengths `lens` given in sorted order (`order`), each with its common
    prefix with the one before it (`lcps`, aligned with `order`): (root, end node of each prompt)."""
    root = PlanNode(0, 0, owner=-1)
    ends: list[PlanNode] = [root] * len(lens)
    stack = [root]                  # the path of the previous prompt
    for i, lcp in zip(order, lcps):
        n = lens[i]
        while len(stack) > 1 and stack[-1].start >= lcp:
            stack.pop()
        node = stack[-1]
        if lcp < node.end:          # split: the new prompt leaves this edge part-way
            upper = PlanNode(node.start, lcp, node.owner, parent=node.parent)
            siblings = cast(PlanNode, node.parent).children     # node is not the root (lcp >= 0 = root.end)
            siblings[siblings.index(node)] = upper
            upper.children.append(node)
            node.start, node.parent = lcp, upper
            stack[-1] = node = upper
        if n > lcp:
            leaf = PlanNode(lcp, n, owner=i, parent=node)
            node.children.append(leaf)
            stack.append(leaf)
            node = leaf
        ends[i] = node
    return root, ends


class PlanSummary(NamedTuple):
    """What a batch's plan costs, without building its tree (a dry run's figures)."""
    requests: int
    executed: int                   # distinct executed requests (equal mergeable prompts run once)
    prompt_tokens: int              # over executed requests
    unique_tokens: int              # sum of edge lengths of the radix tree (computed tokens, Theorem 3.1)
    attended_keys: int              # over computed tokens, the keys each attends to (its position + 1)
    logit_rows: int                 # over executed requests, the positions whose logits they need

    @property
    def optimal_hit_rate(self) -> float:
        return optimal_hit_rate(self.unique_tokens, self.prompt_tokens)


def summarize(prompts: Sequence[Sequence[int]], mergeable: Sequence[bool] | None = None,
              logit_rows: Sequence[int] | None = None) -> PlanSummary:
    """The figures of `make_plan(prompts, mergeable=...)`, from sorted prompts and adjacent common
    prefixes in numpy: the tree's edges are each prompt's tokens past its common prefix with the
    prompt before it in sorted order (a DFS of the trie)."""
    order, lcps = sorted_lcps(prompts)
    return summarize_sorted(prompts, order, lcps, mergeable, logit_rows)


def summarize_sorted(prompts: Sequence[Sequence[int]] | Sequence[int], order: Sequence[int], lcps: np.ndarray,
                     mergeable: Sequence[bool] | None = None, logit_rows: Sequence[int] | None = None,
                     lengths: bool = False) -> PlanSummary:
    """`summarize` of the prompts `order` names (in sorted order; others are left out), given each
    one's common prefix with the one before it (`sorted_lcps`). `lengths`: `prompts` holds each
    prompt's length only (all the figures need)."""
    n = len(order)
    lens = np.fromiter((prompts[i] if lengths else len(prompts[i]) for i in order),  # type: ignore[arg-type]
                       dtype=np.int64, count=n)
    flags = np.fromiter((bool(mergeable[i]) for i in order) if mergeable is not None else iter(()),
                        dtype=bool, count=n if mergeable is not None else 0)
    if not len(flags):
        flags = np.zeros(n, dtype=bool)
    # equal prompts are adjacent in sorted order; the mergeable ones of a run execute once
    same = np.zeros(n, dtype=bool)
    same[1:] = (lcps[1:] == lens[1:]) & (lens[:-1] == lens[1:])    # sorted: a prefix comes first
    run = np.cumsum(~same)
    runs, first = np.unique(run[flags], return_index=True)
    executed = int((~flags).sum()) + len(runs)
    prompt_tokens = int(lens[~flags].sum() + lens[flags][first].sum())
    rows = np.fromiter((logit_rows[i] for i in order), dtype=np.int64, count=n) if logit_rows is not None \
        else np.ones(n, dtype=np.int64)
    rows_total = int(rows[~flags].sum() + rows[flags][first].sum())
    new = lens - lcps
    keys = (lens * (lens + 1) - lcps * (lcps + 1)) // 2
    return PlanSummary(n, executed, prompt_tokens, int(new.sum()), int(keys.sum()), rows_total)


def make_plan(prompts: list[list[int]], schedule: str = "dfs", seed: int = 0,
              mergeable: list[bool] | None = None, presorted: Sequence[int] | None = None) -> Plan:
    """Plan a batch. Requests flagged mergeable whose prompts are equal execute once (as lm-eval
    runs one forward per context for one-token choices); the hit rates count executed requests.
    `presorted`: the prompts are in sorted order already and these are their adjacent common prefixes
    (a data-parallel worker's part, cut from its parent's plan): nothing is sorted or compared."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; known: {', '.join(SCHEDULES)}")
    if presorted is None:
        dfs_order, lcps = sorted_lcps(prompts)
    else:
        dfs_order, lcps = list(range(len(prompts))), np.asarray(presorted, dtype=np.int64)
    root, ends = tree_from_sorted([len(p) for p in prompts], dfs_order, lcps.tolist())
    mergeable = mergeable or [False] * len(prompts)
    rep: dict[int, int] = {}                 # id(end node) -> executed request
    members: dict[int, list[int]] = {}
    for i in range(len(prompts)):
        j = rep.setdefault(id(ends[i]), i) if mergeable[i] else i
        members.setdefault(j, []).append(i)
    executed = set(members)
    unique, stack = 0, [root]
    while stack:
        node = stack.pop()
        unique += node.length
        stack.extend(node.children)
    if schedule == "dfs":
        order = [i for i in dfs_order if i in executed]
    else:
        order = sorted(executed)
        if schedule == "random":
            random.Random(seed).shuffle(order)
    return Plan(order, members, root, ends, sum(len(prompts[i]) for i in executed), unique, dfs_order, lcps)


def plan_requests(requests: Sequence[ScoreRequest | GenerateRequest], schedule: str = "dfs", seed: int = 0,
                  presorted: Sequence[int] | None = None) -> Plan:
    """The plan `Engine.run` executes: scored requests with equal prompts run once (`presorted`: as
    `make_plan`)."""
    prompts = [r.prompt for r in requests]
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"request {i} has an empty prompt")
    return make_plan(prompts, schedule, seed, mergeable=[isinstance(r, ScoreRequest) for r in requests],
                     presorted=presorted)


def posthoc_unique(prompts: list[list[int]], generated: list[tuple[list[int], int]]) -> int:
    """Least number of prompt tokens any order must compute, after the fact, for a multi-stage run.

    `prompts` are every executed prompt; `generated` holds (prompt + the output tokens fed back, the
    prompt's length) for each generation. A prefix costs one computation if some prompt needs it,
    unless a generation produced it by decoding (its KV exists then without prefill). Without
    generations this is the sum of edge lengths of the prompts' radix tree (Theorem 3.1).
    """
    return posthoc_figures(prompts, generated)[0]


def posthoc_figures(prompts: list[list[int]], generated: list[tuple[list[int], int]],
                    presorted: tuple[Sequence[int], np.ndarray] | None = None) -> tuple[int, int]:
    """`posthoc_unique`, and the unique tokens of the prompts' own tree (`summarize(prompts)`'s), from
    one sort of every sequence (`posthoc_seqs`; `presorted`: their sorted order and adjacent common
    prefixes, made already): the prompts' adjacent common prefixes are the least of the sorted
    sequences' between them (`sub_lcps`)."""
    seqs = posthoc_seqs(prompts, generated)
    if not seqs:
        return 0, 0
    order, lcps = presorted if presorted is not None else sorted_lcps(seqs)
    root, ends = tree_from_sorted([len(s) for s in seqs], order, lcps.tolist())
    n = len(prompts)
    at = np.asarray(order, dtype=np.int64)
    ranks = np.flatnonzero(at < n)
    lens = np.fromiter((len(seqs[i]) for i in at[ranks]), dtype=np.int64, count=len(ranks))
    plain = int((lens - sub_lcps(lcps, ranks)).sum())
    return _fold_posthoc(root, ends, n, generated), plain


def posthoc_seqs(prompts: list[list[int]], generated: list[tuple[list[int], int]]) -> list[list[int]]:
    """Every sequence the post-hoc optimum sorts: the prompts, then each generation's prompt and output."""
    return list(prompts) + [s for s, _ in generated]


def _fold_posthoc(root: PlanNode, ends: list[PlanNode], n: int, generated: list[tuple[list[int], int]]) -> int:
    """Over the tree of every sequence (the first `n` prompts, then the generations): each edge's tokens
    that some prompt below it needs and no generation below it decoded."""
    has_prompt: dict[int, bool] = {}
    gen_start: dict[int, float] = {}
    for i, node in enumerate(ends):  # mark where each sequence ends, then fold up the tree below
        if i < n:
            has_prompt[id(node)] = True
        else:
            g = generated[i - n][1]
            gen_start[id(node)] = min(gen_start.get(id(node), float("inf")), g)
    total: float
    total, post, stack = 0, [], [root]
    while stack:
        node = stack.pop()
        post.append(node)
        stack.extend(node.children)
    for node in reversed(post):       # children before parents
        for c in node.children:
            has_prompt[id(node)] = has_prompt.get(id(node), False) or has_prompt.get(id(c), False)
            gen_start[id(node)] = min(gen_start.get(id(node), float("inf")), gen_start.get(id(c), float("inf")))
        if has_prompt.get(id(node), False):
            total += max(0, min(node.end, gen_start.get(id(node), float("inf"))) - node.start)
    return int(total)


def plan_to_arrays(plan: Plan) -> dict[str, Any]:
    """A plan as flat arrays (a cached workload keeps its first wave's): its tree's nodes in preorder
    (start, end, owner, parent), each request's end node, the order and who each executed request serves."""
    nodes: list[PlanNode] = []
    index: dict[int, int] = {}
    stack = [plan.root]
    while stack:
        node = stack.pop()
        index[id(node)] = len(nodes)
        nodes.append(node)
        stack.extend(reversed(node.children))
    members = [(j, plan.members[j]) for j in sorted(plan.members)]
    return {
        "start": np.fromiter((n.start for n in nodes), np.int64, len(nodes)),
        "end": np.fromiter((n.end for n in nodes), np.int64, len(nodes)),
        "owner": np.fromiter((n.owner for n in nodes), np.int64, len(nodes)),
        "parent": np.fromiter((-1 if n.parent is None else index[id(n.parent)] for n in nodes), np.int64, len(nodes)),
        "ends": np.fromiter((index[id(n)] for n in plan.ends), np.int64, len(plan.ends)),
        "order": np.asarray(plan.order, dtype=np.int64),
        "member_of": np.asarray([j for j, ms in members for _ in ms], dtype=np.int64),
        "members": np.asarray([m for _, ms in members for m in ms], dtype=np.int64),
        "tokens": np.asarray([plan.prompt_tokens, plan.unique_tokens], dtype=np.int64),
        "dfs": np.asarray(plan.dfs, dtype=np.int64),
        "lcps": np.asarray(plan.lcps, dtype=np.int64),
    }


def plan_from_arrays(a: dict[str, Any]) -> Plan:
    """The plan `plan_to_arrays` wrote (a tree of new nodes: a run registers its logit demands on them)."""
    start, end, owner, parent = (a[k].tolist() for k in ("start", "end", "owner", "parent"))
    nodes = [PlanNode(s, e, o) for s, e, o in zip(start, end, owner)]
    for node, p in zip(nodes, parent):
        if p >= 0:
            node.parent = nodes[p]
            nodes[p].children.append(node)
    members: dict[int, list[int]] = {}
    for j, m in zip(a["member_of"].tolist(), a["members"].tolist()):
        members.setdefault(j, []).append(m)
    prompt_tokens, unique_tokens = a["tokens"].tolist()
    return Plan(a["order"].tolist(), members, nodes[0], [nodes[k] for k in a["ends"].tolist()], prompt_tokens,
                unique_tokens, a["dfs"].tolist(), a["lcps"])
