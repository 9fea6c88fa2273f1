"""One `Engine.stream`: a batch's requests run in the plan's order, prompts first (Prefill), then generation
(Decode), their results handed over as they become final (`protocol.Handover`).

With `feed` the stream is open: requests join it while it runs (a program's next calls, as soon as its
last results are back). After a decode step that ended an eighth of the rows' worth of requests (or any,
when few are queued for rows), the requests whose results are final are handed over without waiting for
the device (scores whose logits are still on their way wait for the next handover), and `feed(False)` gives
the requests that join: planned by themselves (their own radix tree, in DFS order) and queued. Their
prompts are issued PREFILL_SLICE_S of host work at a time between decode steps, while the device computes
the step just launched, and all at once when nothing decodes; their generations then queue for decode rows.
With nothing left to run, `feed(True)` is asked, and the stream ends when it gives nothing.
"""
from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING, Iterator, Protocol, Sequence

import torch

from lmbatch.engine.decode import REFILL_DIVISOR, Decode
from lmbatch.engine.kv import KVSlots
from lmbatch.engine.logits import LogitCapture
from lmbatch.engine.prefill import Prefill
from lmbatch.engine.protocol import Handover, Request, StreamArgs, remaining
from lmbatch.engine.state import RunState
from lmbatch.requests import GenerateRequest
from lmbatch.scheduler.planner import plan_requests

if TYPE_CHECKING:
    from lmbatch.engine.model_runner import ModelRunner
    from lmbatch.engine.radix_cache import RadixTree
    from lmbatch.engine.sampler import Sampler

PREFILL_SLICE_S = 0.003     # host work on joined prompts between two decode steps (a 1.5B step: ~7 ms of device)


class EngineParts(Protocol):
    """What a stream uses of its engine (`Engine`): what outlives a run, and its sizes."""
    model_runner: ModelRunner
    tree: RadixTree | None
    sampler: Sampler
    rows: int                   # decode rows
    batch_tokens: int           # tokens a prefill batch holds


class Stream:
    def __init__(self, engine: EngineParts, requests: Sequence[Request], args: StreamArgs):
        t0 = time.perf_counter()
        self.schedule, self.seed = args.get("schedule", "dfs"), args.get("seed", 0)
        plan = args.get("plan") or plan_requests(requests, self.schedule, self.seed)
        self.handover_due, self.feed = args.get("handover_due"), args.get("feed")
        self.state = state = RunState(requests, plan, args.get("progress"))
        self.capture = capture = LogitCapture(state)    # registers every request's logit demands on the plan
        self.plan_s = time.perf_counter() - t0
        self.t0, self.device = t0, engine.model_runner.device
        kv = KVSlots(engine.model_runner.pool, engine.tree, state.stats)
        self.decode = Decode(state, engine.model_runner, kv, capture, engine.sampler, engine.rows)
        self.prefill = Prefill(state, engine.model_runner, kv, capture, self.decode, engine.batch_tokens)
        self.handed = bytearray(len(requests))
        self.pending: deque[int] = deque()      # joined requests whose prompts are not issued yet
        self.starts: set[int] = set()           # of those, the first of each joined batch
        self.feed_at = max(1, engine.rows // REFILL_DIVISOR)

    def run(self) -> Iterator[Handover]:
        state, decode = self.state, self.decode
        yield from self._issue(state.plan.order)
        self.prefill.flush()
        while True:
            for _ in decode.run_all():
                state.decoding(decode.decoded)
                if self.pending:
                    yield from self._issue_some(PREFILL_SLICE_S if decode.running else None)
                if due := self._due():
                    h = self._hand_over()
                elif self.feed is not None and (len(state.final) >= self.feed_at or state.final and decode.hungry):
                    h = self._hand_over_ready()
                else:
                    continue
                if due or h.final:
                    yield h
                if self.feed is not None and h.final:  # the caller resumed programs: their next calls join
                    self._join(self.feed(False))
            if self.pending:            # nothing decodes: the joined prompts at once (their gens queue)
                yield from self._issue_some(None)
                continue
            if self.feed is None:
                break
            yield self._hand_over(self._due())      # nothing left to run: the caller's next calls, or the end
            if not self._join(self.feed(True)):
                break
        self.capture.drain()
        self.capture.finish_scores()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        st = self.state.stats
        st.plan_s, st.execute_s = self.plan_s, time.perf_counter() - self.t0 - self.plan_s
        yield Handover(remaining(st, self.handed), self.state.results, st, True)

    def _due(self) -> bool:
        return self.handover_due is not None and self.handover_due()

    # ---- prompts ------------------------------------------------------------------------------------
    def _issue(self, order: Sequence[int]) -> Iterator[Handover]:
        """Issue the prompts of executed requests `order`, handing over whenever it is due."""
        for i in order:
            self.prefill.add(i)
            if self._due():
                yield self._hand_over()

    def _issue_some(self, slice_s: float | None) -> Iterator[Handover]:
        """Issue joined prompts for `slice_s` of host work (None: all of them, and run the batch)."""
        end = None if slice_s is None else time.perf_counter() + slice_s
        pending = self.pending
        while pending and (end is None or time.perf_counter() < end):
            if pending[0] in self.starts:       # each joined batch in prefill batches of its own, as a run of it
                self.starts.discard(pending[0])
                self.prefill.flush()
            self.prefill.add(pending.popleft())
            if self._due():
                yield self._hand_over()
        if not pending:
            self.prefill.flush()

    def _join(self, new: Sequence[Request]) -> bool:
        """Requests fed to the running stream: planned by themselves, queued for `_issue_some`."""
        if not new:
            return False
        t = time.perf_counter()
        joined = plan_requests(new, self.schedule, self.seed)
        first = self.state.extend(new, joined)
        self.capture.extend(first)
        self.handed.extend(bytes(len(new)))
        self.pending.extend(first + j for j in joined.order)
        self.starts.add(first + joined.order[0])
        self.plan_s += time.perf_counter() - t
        return True

    # ---- handovers ----------------------------------------------------------------------------------
    def _hand_over(self, due: bool = True) -> Handover:
        """The batch being built runs now and every logit in flight is recorded: each request reported
        done so far has its final result."""
        self.prefill.flush()
        self.capture.drain()
        final, self.state.final = self.state.final, []
        return self._handing(final, due)

    def _hand_over_ready(self) -> Handover:
        """The requests done so far whose results are final without waiting for the device: generations,
        and scores whose logits are recorded, up to the first that waits for a batch still computing (the
        scores done after it wait too: their batches were launched later)."""
        self.capture.drain(wait=False)
        state, scored = self.state, self.capture.scored
        ready: list[int] = []
        later: list[int] = []
        for i in state.final:
            if isinstance(state.requests[i], GenerateRequest) or not later and scored(i):
                ready.append(i)
            else:
                later.append(i)
        state.final = later
        return self._handing(ready, False)

    def _handing(self, final: list[int], due: bool) -> Handover:
        self.capture.finish_scores(final)
        for i in final:
            self.handed[i] = 1
        return Handover(final, self.state.results, self.state.stats, False, due)
