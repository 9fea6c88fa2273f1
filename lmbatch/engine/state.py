"""What one `Engine.stream` works on: its requests and plan, their results and counters, and the records
its parts hand each other (queued and running generation requests).

Everything here lives for one run: the engine keeps only the model, the KV pool and the cache.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence, cast

from lmbatch.attention.kv_pool import Slots
from lmbatch.engine.protocol import Progress, Request, Result
from lmbatch.engine.radix_cache import Node
from lmbatch.requests import (
    GenerateRequest,
    GenerateResult,
    RunStats,
    SamplingParams,
    ScoreRequest,
    ScoreResult,
    optimal_hit_rate,
)
from lmbatch.scheduler.planner import Plan, PlanNode

if TYPE_CHECKING:      # lmbatch.grammar imports xgrammar: loaded only where a grammar is used
    from lmbatch.grammar import Constraint

PROGRESS_S = 0.1       # decode steps tell the progress callback their tokens at most this often


@dataclass
class Queued:
    """A generation request whose prompt is in the pool, waiting for a decode row."""
    index: int
    node: Node | None
    slots: Slots                    # prompt slots
    reserve: int                    # decode slots it takes when admitted
    key: int                        # LogitCapture's key of its prompt's last position (its first token's logits)
    run: Running | None = None      # made once its first token is sampled (or when it is admitted)


@dataclass
class Running:
    """A generation request between its prefill and its end."""
    index: int
    node: Node | None
    slots: Slots                    # prompt slots, then the reserved decode slots
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
    stop_seen: int = 0              # tokens of `out` searched for stop strings so far
    pending: int = 0                # a token sampled on the device, not in `out` yet (overlapped decode: 0 or 1)
    pending_src: int = 0            # its row in the step that sampled it


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
        self.stats.decode_budget = sum(r.params.most_tokens for r in requests if isinstance(r, GenerateRequest))
        self._report_at = 0.0           # when the next decode step reports its tokens to `progress`
        self._joined: list[Request] | None = None      # `requests`, once others joined (`extend`)

    def extend(self, requests: Sequence[Request], plan: Plan) -> int:
        """Requests that join the run while it runs (an open stream), with their own plan (indices into
        `requests`): they take the indices after the run's; returns the first. Their plan's figures add
        to the run's (the optimum of each joining batch: a later batch's prompts may hit what an earlier
        left in the cache)."""
        base = len(self.requests)
        st = self.stats
        if self._joined is None:        # copies: the caller's sequence and the plan's members stay theirs
            self._joined = list(self.requests)
            self.requests = self._joined
            st.members = dict(st.members)
        self._joined.extend(requests)
        self.paths += [plan.path(j) for j in range(len(requests))]
        self.results += [GenerateResult() if isinstance(r, GenerateRequest) else ScoreResult() for r in requests]
        st.requests += len(requests)
        st.executed += len(plan.order)
        st.prompt_tokens += plan.prompt_tokens
        st.unique_tokens += plan.unique_tokens
        st.optimal_hit_rate = st.engine_optimal_hit_rate = optimal_hit_rate(st.unique_tokens, st.prompt_tokens)
        st.order += [base + j for j in plan.order]
        st.members.update({base + j: [base + m for m in ms] for j, ms in plan.members.items()})
        st.decode_budget += sum(r.params.most_tokens for r in requests if isinstance(r, GenerateRequest))
        return base

    def done(self, i: int) -> None:
        """Request i needs nothing more from the engine (its score may still be summed at the end)."""
        self.final.append(i)
        r = self.requests[i]
        if isinstance(r, GenerateRequest):      # its tokens moved to decode_tokens; its unused budget goes
            n = cast(GenerateResult, self.results[i]).decode_tokens
            self.stats.decode_budget -= r.params.most_tokens - n
            self.stats.decoding_tokens = max(0, self.stats.decoding_tokens - n)
        if self.progress:
            self.progress(i, self.stats)

    def decoding(self, tokens: Callable[[], int]) -> None:
        """After a decode step: the tokens decoded so far by the requests that have not ended (`tokens()`), told
        to `progress` (as request -1) at most every PROGRESS_S, so that a bar moves while generations run."""
        if self.progress is None or (now := time.monotonic()) < self._report_at:
            return
        self._report_at = now + PROGRESS_S
        self.stats.decoding_tokens = tokens()
        self.progress(-1, self.stats)


def score_positions(r: ScoreRequest) -> range:
    """Positions whose logits score the continuation (each predicts the next token)."""
    return range(len(r.context) - 1, len(r.context) + len(r.continuation) - 1)
