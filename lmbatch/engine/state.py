"""What one `Engine.run` works on: its requests and plan, their results and counters, and the records
its parts hand each other (captured logits, queued and running generation requests).

Everything here lives for one run: the engine keeps only the model, the KV pool and the cache.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import torch

from lmbatch.engine.protocol import Progress, Request, Result
from lmbatch.engine.radix_cache import Node
from lmbatch.requests import GenerateRequest, GenerateResult, RunStats, SamplingParams, ScoreRequest, ScoreResult
from lmbatch.scheduler.planner import Plan, PlanNode

if TYPE_CHECKING:      # lmbatch.grammar imports xgrammar: loaded only where a grammar is used
    from lmbatch.grammar import Constraint
Key = tuple[PlanNode, int]      # a position of the plan's tree: logits there are captured once for all
FULL_ROW = -1  # demand marker: keep the whole logits row (to sample from it)


@dataclass
class Captured:
    """What a position's logits were reduced to: the argmax, the demanded tokens' logprobs, and the
    whole row where some request samples from it."""
    argmax: int
    logprobs: dict[int, float]
    row: torch.Tensor | None = None


@dataclass
class Queued:
    """A generation request whose prompt is in the pool, waiting for a decode row."""
    index: int
    node: Node | None
    slots: torch.Tensor             # prompt slots
    reserve: int                    # decode slots it takes when admitted
    key: Key                        # where its prompt's last logits are captured
    run: Running | None = None      # made once its first token is sampled (or when it is admitted)


@dataclass
class Running:
    """A generation request between its prefill and its end."""
    index: int
    node: Node | None
    slots: torch.Tensor             # prompt slots, then the reserved decode slots
    prompt_len: int
    params: SamplingParams
    constraint: Constraint | None = None
    out: list[int] = field(default_factory=list)
    fed: int = 0                    # tokens of `out` whose KV is in the pool
    steps: int = 0                  # forward passes that sampled a token for it
    jumped: int = 0                 # tokens appended by jump-forward
    rejected: bool = False          # its grammar rejected its last unconstrained pick
    finish: str = ""
    thinking: bool = False          # in its thinking: no constraint, no stop strings yet
    think_start: int = 0            # where the end-of-thinking marker begins in `out`
    think_len: int = 0              # tokens of `out` before the answer (thinking and marker)


class RunState:
    """One run's requests, plan, results and counters, and the plan path of each request."""

    def __init__(self, requests: Sequence[Request], plan: Plan, progress: Progress | None = None):
        self.requests, self.plan, self.progress = requests, plan, progress
        self.final: list[int] = []      # requests done since the last handover
        self.paths: list[list[PlanNode]] = [plan.path(i) for i in range(len(requests))]
        self.results: list[Result] = [GenerateResult() if isinstance(r, GenerateRequest) else ScoreResult()
                                      for r in requests]
        self.stats = RunStats(requests=len(requests), executed=len(plan.order), prompt_tokens=plan.prompt_tokens,
                              unique_tokens=plan.unique_tokens, optimal_hit_rate=plan.optimal_hit_rate,
                              engine_optimal_hit_rate=plan.engine_optimal_hit_rate, order=list(plan.order),
                              members=plan.members)

    def done(self, i: int) -> None:
        """Request i needs nothing more from the engine (its score may still be summed at the end)."""
        self.final.append(i)
        if self.progress:
            self.progress(i, self.stats)

    def node_at(self, i: int, pos: int) -> PlanNode:
        for node in self.paths[i]:
            if node.start <= pos < node.end:
                return node
        raise IndexError(pos)

    def nodes_at(self, i: int, positions: Sequence[int]) -> list[PlanNode]:
        """The node of request i's path holding each of `positions` (ascending), in one walk of the
        path (a scored continuation's ~25 positions looked up one by one walked it ~25 times)."""
        path, out, k = self.paths[i], [], 0
        for p in positions:
            while path[k].end <= p:
                k += 1
            out.append(path[k])
        return out

    def prompt_key(self, i: int) -> Key:
        """Where generation request i's first token is sampled from: its prompt's last position."""
        p = len(self.requests[i].prompt) - 1
        return self.node_at(i, p), p


def score_positions(r: ScoreRequest) -> range:
    """Positions whose logits score the continuation (each predicts the next token)."""
    return range(len(r.context) - 1, len(r.context) + len(r.continuation) - 1)
