"""One `Engine.stream`: a batch's requests run in the plan's order, prompts first (Prefill), then generation
(Decode), their results handed over as they become final (`protocol.Handover`).

With `feed` the stream is open: requests join it while it runs (a program's next calls, as soon as its
last results are back). After a decode step that ended requests while the decode batch, queue included,
fills at most half its rows (the device underused: a wave's tail), the requests whose results are final
are handed over without waiting for the device (scores whose logits are still on their way wait for the
next handover), and `feed(False)` gives the requests that join: planned by themselves (their own radix
tree, in DFS order), their prompts issued at once (their generations queue for decode rows). With nothing
left to run, `feed(True)` is asked, and the stream ends when it gives nothing.

Joining more often cost more than it saved (BENCHMARKS.md, "Figures behind rules in the code": tree of
thought 1.3-2.1x slower joining at every step's results): each join is a small prefill batch of its own
and a round of first tokens, where a wave's are few and large.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Iterator, Protocol, Sequence

import torch

from lmbatch.engine.decode import Decode
from lmbatch.engine.kv import KVSlots
from lmbatch.engine.logits import LogitCapture
from lmbatch.engine.options import WIDE_FROM
from lmbatch.engine.prefill import Prefill
from lmbatch.engine.protocol import Handover, Request, StreamArgs, remaining
from lmbatch.engine.state import RunState
from lmbatch.requests import GenerateRequest
from lmbatch.scheduler.planner import plan_requests

if TYPE_CHECKING:
    from lmbatch.engine.model_runner import ModelRunner
    from lmbatch.engine.radix_cache import RadixTree
    from lmbatch.engine.sampler import Sampler

ROOM_SHARE = 2      # requests join while the decode batch fills at most 1/ROOM_SHARE of its rows


class EngineParts(Protocol):
    """What a stream uses of its engine (`Engine`): what outlives a run, and its sizes."""
    model_runner: ModelRunner
    tree: RadixTree | None
    sampler: Sampler
    rows: int                   # decode rows
    wide_rows: int              # ... of a stream of WIDE_FROM generations or more
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
        rows = self.rows(engine, requests)
        if rows > engine.rows:      # the decode graphs of such steps, captured now (none for a run that never widens)
            engine.model_runner.capture_graphs(rows)
        self.decode = Decode(state, engine.model_runner, kv, capture, engine.sampler, rows)
        self.prefill = Prefill(state, engine.model_runner, kv, capture, self.decode, engine.batch_tokens)
        self.handed = bytearray(len(requests))

    @staticmethod
    def rows(engine: EngineParts, requests: Sequence[Request]) -> int:
        """Decode rows: the engine's wide rows where the stream starts with WIDE_FROM generations or more (k
        samples of every question: rounds of full steps, whose weights' read more rows share), else its rows.
        Requests that join later keep them."""
        wide = engine.wide_rows > engine.rows and \
            sum(isinstance(r, GenerateRequest) for r in requests) >= WIDE_FROM
        return engine.wide_rows if wide else engine.rows

    def run(self) -> Iterator[Handover]:
        state, decode = self.state, self.decode
        yield from self._issue(state.plan.order)
        self.prefill.flush()
        while True:
            for _ in decode.run_all():
                state.decoding(decode.decoded)
                if due := self._due():
                    h = self._hand_over()
                elif self.feed is not None and state.final and self._room(decode):
                    h = self._hand_over_ready()
                else:
                    continue
                if due or h.final:
                    yield h
                if self.feed is not None and h.final:  # the caller resumed programs: their next calls join
                    yield from self._join(self.feed(False))
            if self.feed is None:
                break
            yield self._hand_over(self._due())      # nothing left to run: the caller's next calls, or the end
            if not (new := self.feed(True)):
                break
            yield from self._join(new)
        self.capture.drain()
        self.capture.finish_scores()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        st = self.state.stats
        st.plan_s, st.execute_s = self.plan_s, time.perf_counter() - self.t0 - self.plan_s
        yield Handover(remaining(st, self.handed), self.state.results, st, True)

    @staticmethod
    def _room(decode: Decode) -> bool:
        """Whether the decode batch, queue included, fills at most half its rows (ROOM_SHARE): the device is
        underused, and requests that join cost it little."""
        return (len(decode.running) + len(decode.queue)) * ROOM_SHARE < decode.max_running

    def _due(self) -> bool:
        return self.handover_due is not None and self.handover_due()

    # ---- prompts ------------------------------------------------------------------------------------
    def _issue(self, order: Sequence[int]) -> Iterator[Handover]:
        """Issue the prompts of executed requests `order`, handing over whenever it is due."""
        for i in order:
            self.prefill.add(i)
            if self._due():
                yield self._hand_over()

    def _join(self, new: Sequence[Request]) -> Iterator[Handover]:
        """Requests fed to the running stream: planned by themselves and issued now, in their plan's order
        (their generations queue for decode rows)."""
        if not new:
            return
        t = time.perf_counter()
        joined = plan_requests(new, self.schedule, self.seed)
        first = self.state.extend(new, joined)
        self.capture.extend(first)
        self.handed.extend(bytes(len(new)))
        self.plan_s += time.perf_counter() - t
        yield from self._issue([first + j for j in joined.order])
        self.prefill.flush()

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
