"""Continuous-batching decode.

A generation request's prompt is prefilled ahead, in the same large batches as every other prompt,
and the request waits in a queue until a decode row is free. Admitting it costs no forward pass:
its first token comes from its prompt's logits (those of every queued request are sampled together,
as soon as they are computed), so a row that finishes is refilled at the next step. A finished
request is released (its output inserted into the tree) while the device computes the next step.
"""
from __future__ import annotations

from collections import deque
from typing import Iterator, cast

import numpy as np
import torch

from lmbatch.engine.kv import KVSlots
from lmbatch.engine.logits import LogitCapture
from lmbatch.engine.model_runner import ModelRunner
from lmbatch.engine.sampler import Launched, Sampler
from lmbatch.engine.state import Queued, Running, RunState
from lmbatch.requests import GenerateRequest, GenerateResult

REFILL_DIVISOR = 8  # a full decode batch admits new requests once 1/8 of its requests have finished
FIRST_TOKEN_ROWS = 1024  # queued requests' first tokens sampled per round (bounds the stacked logits)


class Decode:
    def __init__(self, state: RunState, model_runner: ModelRunner, kv: KVSlots, capture: LogitCapture, sampler: Sampler,
                 max_running: int):
        self.state, self.model_runner, self.kv, self.capture, self.sampler = state, model_runner, kv, capture, sampler
        self.max_running = max_running
        self.running: list[Running] = []
        self.queue: deque[Queued] = deque()
        self._unsampled: list[Queued] = []      # queued requests without their first token
        self._finished: list[Running] = []      # ended, released during the next step's forward
        self._inflight: Launched | None = None  # the overlapped step whose tokens the host has not seen
        self.overlap = model_runner.graphs is not None

    # ---- the queue -------------------------------------------------------------------------------
    def enqueue(self, q: Queued) -> None:
        """Queue a request whose prompt KV is held (its decode slots are promised already)."""
        self.queue.append(q)
        self._unsampled.append(q)
        self.admit()

    @property
    def can_admit(self) -> bool:
        return bool(self.queue) and len(self.running) < self.max_running

    def admit(self) -> None:
        """Give free decode rows to queued requests whose prompt logits have been computed (those in
        the prefill batch being built wait for it, rather than run it small)."""
        while self.can_admit:
            q = self.queue[0]
            if self.capture.unlaunched[q.key]:
                break
            self.queue.popleft()
            self.kv.promised -= q.reserve
            extra = self.kv.alloc(q.reserve)
            assert extra is not None, "queued requests' decode slots are kept free"
            if q.run is None:
                q.run = self._new_run(q)
            q.run.slots = np.concatenate([q.slots, extra])
            self.running.append(q.run)

    def _new_run(self, q: Queued) -> Running:
        req = cast(GenerateRequest, self.state.requests[q.index])
        return Running(q.index, q.node, q.slots, len(q.slots), req.params, req.constraint,
                       thinking=bool(req.params.think_end))

    def decoded(self) -> int:
        """Tokens the requests that have not been released hold (their results do not count them yet)."""
        return sum(len(r.out) for r in self.running) + sum(len(r.out) for r in self._finished)

    # ---- steps -----------------------------------------------------------------------------------
    def run_all(self) -> Iterator[None]:
        """Decode until every queued and running request has ended, pausing after each step (where the
        engine may hand results over)."""
        while self.running or self.queue:
            self.admit()
            self.step()
            yield
        self._release_finished()

    def decode_some(self) -> None:
        """Decode until a share of the running requests has finished (to free pool space): refilling
        after every single finish would add a prefill forward to nearly every step."""
        want = max(1, len(self.running) // REFILL_DIVISOR)
        done = 0
        while self.running and done < want:
            done += self.step()
            self.admit()
        self._land()
        self._drop_finished()
        self._release_finished()

    def step(self) -> int:
        """One decode step of every running request (after the first tokens of those that have none,
        from their prompt's logits); returns how many requests finished.

        Overlapped where every running row is `Sampler.plain` and the device runs graphs: the step is
        launched with the last step's tokens still on the device (fed from there), and only then
        does the host wait for those tokens, append them and see who finished, while the device
        computes. A row that ended at the last step runs once more for nothing (its token dropped);
        one that reaches its token limit with the last step's token is left out."""
        self._first_tokens()
        live = [r for r in self.running if not r.finish]
        if self.overlap and all(self.sampler.plain(r) for r in live):
            rows = [r for r in live if len(r.out) + r.pending < r.params.max_new_tokens]
            if rows:
                self.state.stats.forward_batches += 1
                logits = self.model_runner.decode(rows, self._inflight.tokens if self._inflight else None)
            self._land()
            if rows:
                self._inflight = self.sampler.launch(rows, logits)
            self._release_finished()    # host work while the device computes the step
        else:
            self._land()
            live = [r for r in self.running if not r.finish]
            if live:
                self.state.stats.forward_batches += 1
                logits = self.model_runner.decode(live)
            self._release_finished()
            if live:
                self._pick(live, logits.float())     # grammar masks and rows picked again: float32 (exact)
        return self._drop_finished()

    def _land(self) -> None:
        """The tokens of the step in flight, appended to its rows."""
        if self._inflight is not None:
            launched, self._inflight = self._inflight, None
            self.sampler.land(launched)

    def _drop_finished(self) -> int:
        """Requests that ended (and wait for no token in flight) leave the batch, to be released during
        the next step; how many."""
        done = [r for r in self.running if r.finish and not r.pending]
        if done:
            self._finished += done
            self.running = [r for r in self.running if not (r.finish and not r.pending)]
        return len(done)

    def _pick(self, rows: list[Running], logits: torch.Tensor) -> None:
        picked = self.sampler.pick(rows, logits)
        self.state.stats.masked_rows += picked.masked
        self.state.stats.resampled_rows += picked.resampled

    def _first_tokens(self) -> None:
        """Sample the first token of every request whose prompt logits are computed and that has
        none yet, running or still queued (FIRST_TOKEN_ROWS queued ones at most), in one call: a
        wave's first step samples them all, and a later step that admits a request runs no extra
        sampling round (and device sync)."""
        fresh = [r for r in self.running if not r.out]
        queued: list[Queued] = []
        if self._unsampled:
            pending = self.capture.unlaunched    # logits of the prefill batch not launched yet
            waiting = [q for q in self._unsampled if q.run is None]
            ready = [q for q in waiting if not pending[q.key]]
            queued = ready[:FIRST_TOKEN_ROWS]
            self._unsampled = ready[FIRST_TOKEN_ROWS:] + [q for q in waiting if pending[q.key]]
        if not fresh and not queued:
            return
        self.capture.drain()        # their prompts' logits were launched already
        for q in queued:
            q.run = self._new_run(q)
        rows = fresh + [cast(Running, q.run) for q in queued]
        # a prompt's last position keeps its whole row: it is there
        logits = [self.capture.row(self.capture.prompt_key(r.index)) for r in rows]
        self._pick(rows, torch.stack(logits).to(self.model_runner.device))

    # ---- the end of a request ---------------------------------------------------------------------
    def _release_finished(self) -> None:
        for r in self._finished:
            self._release(r)
        self._finished = []

    def _release(self, r: Running) -> None:
        """Keep the output's KV in the cache, free the rest, and fill the request's result."""
        fed = min(r.fed, len(r.out) - 1)    # the last token was never run
        self.kv.keep(list(self.state.requests[r.index].prompt) + r.out[:fed], r.slots, r.prompt_len, r.node)
        res = cast(GenerateResult, self.state.results[r.index])
        res.token_ids, res.finish_reason, res.decode_tokens = r.out, r.finish, len(r.out)
        res.steps, res.jumped_tokens = r.steps, r.jumped
        res.think_tokens, res.thinking = r.think_len, self.sampler.thinking(r)
        if r.constraint is not None:
            res.grammar_complete = r.constraint.is_terminated() or r.constraint.is_completed()
        res.text = self.sampler.text(r)
        self.state.stats.decode_tokens += len(r.out)
        self.state.done(r.index)
