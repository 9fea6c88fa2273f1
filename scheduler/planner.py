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
from dataclasses import dataclass, field

import numpy as np

SCHEDULES = ("dfs", "fcfs", "random")


@dataclass(eq=False)
class PlanNode:
    start: int                      # depth of the edge's first token
    end: int                        # depth after its last token
    owner: int                      # a request whose prompt runs through this node
    parent: "PlanNode | None" = None
    children: list["PlanNode"] = field(default_factory=list)
    demands: dict[int, set] = field(default_factory=dict)  # position -> wanted next-token ids

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

    @property
    def optimal_hit_rate(self) -> float:
        return 1 - self.unique_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    engine_optimal_hit_rate = optimal_hit_rate  # equal for one planned batch on a cold cache (see above)

    def path(self, i: int) -> list[PlanNode]:
        """Nodes from the root's first child down to request i's end node."""
        out, node = [], self.ends[i]
        while node.parent is not None:
            out.append(node)
            node = node.parent
        return out[::-1]


def _lcp(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


def build_tree(prompts: list[list[int]]) -> tuple[PlanNode, list[PlanNode], list[int]]:
    """Radix tree of all prompts, built from their sorted order and adjacent common prefixes.

    Returns (root, end node per prompt, sorted order). The sorted order is a DFS of the tree in
    which a prompt comes before its extensions.
    """
    order = sorted(range(len(prompts)), key=lambda i: prompts[i])
    root = PlanNode(0, 0, owner=-1)
    ends: list[PlanNode] = [root] * len(prompts)
    stack = [root]                  # the path of the previous prompt
    prev = None
    for i in order:
        s = np.asarray(prompts[i], dtype=np.int64)
        lcp = 0 if prev is None else _lcp(prev, s)
        while len(stack) > 1 and stack[-1].start >= lcp:
            stack.pop()
        node = stack[-1]
        if lcp < node.end:          # split: the new prompt leaves this edge part-way
            upper = PlanNode(node.start, lcp, node.owner, parent=node.parent)
            siblings = node.parent.children
            siblings[siblings.index(node)] = upper
            upper.children.append(node)
            node.start, node.parent = lcp, upper
            stack[-1] = node = upper
        if len(s) > lcp:
            leaf = PlanNode(lcp, len(s), owner=i, parent=node)
            node.children.append(leaf)
            stack.append(leaf)
            node = leaf
        ends[i] = node
        prev = s
    return root, ends, order


def make_plan(prompts: list[list[int]], schedule: str = "dfs", seed: int = 0,
              mergeable: list[bool] | None = None) -> Plan:
    """Plan a batch. Requests flagged mergeable whose prompts are equal execute once (as lm-eval
    runs one forward per context for one-token choices); the hit rates count executed requests."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; known: {', '.join(SCHEDULES)}")
    root, ends, dfs_order = build_tree(prompts)
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
    return Plan(order, members, root, ends, sum(len(prompts[i]) for i in executed), unique)


def posthoc_unique(prompts: list[list[int]], generated: list[tuple[list[int], int]]) -> int:
    """Least number of prompt tokens any order must compute, after the fact, for a multi-stage run.

    `prompts` are every executed prompt; `generated` holds (prompt + the output tokens fed back, the
    prompt's length) for each generation. A prefix costs one computation if some prompt needs it,
    unless a generation produced it by decoding (its KV exists then without prefill). Without
    generations this is the sum of edge lengths of the prompts' radix tree (Theorem 3.1).
    """
    seqs = list(prompts) + [s for s, _ in generated]
    if not seqs:
        return 0
    root, ends, _ = build_tree(seqs)
    n = len(prompts)
    has_prompt: dict[int, bool] = {}
    gen_start: dict[int, float] = {}
    for i, node in enumerate(ends):  # mark where each sequence ends, then fold up the tree below
        if i < n:
            has_prompt[id(node)] = True
        else:
            g = generated[i - n][1]
            gen_start[id(node)] = min(gen_start.get(id(node), float("inf")), g)
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
