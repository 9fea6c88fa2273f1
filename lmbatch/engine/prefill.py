"""Prefill: each request's uncached prompt tokens go into ragged forward batches of at most
`max_tokens` tokens, in the plan's order.

A request's prompt is inserted into the tree as soon as its slots are allocated, so a later request
of the same batch already matches it and reads KV that the same forward pass writes: siblings batched
together compute their shared prefix once. Prefill runs ahead of decode while the pool keeps room for
the decode slots of every queued request; when it does not, running requests decode until an eighth
of them have finished.
"""
from __future__ import annotations

import numpy as np

from lmbatch.attention.kv_pool import Slots
from lmbatch.engine.decode import Decode
from lmbatch.engine.kv import KVSlots
from lmbatch.engine.logits import LogitCapture
from lmbatch.engine.model_runner import ModelRunner, TokenBatch
from lmbatch.engine.radix_cache import Node
from lmbatch.engine.state import Queued, RunState
from lmbatch.requests import GenerateRequest


class Prefill:
    def __init__(self, state: RunState, model_runner: ModelRunner, kv: KVSlots, capture: LogitCapture, decode: Decode,
                 max_tokens: int):
        self.state, self.model_runner, self.kv, self.capture, self.decode = state, model_runner, kv, capture, decode
        self.max_tokens = max_tokens
        self._new_batch()

    def _new_batch(self) -> None:
        self.batch = TokenBatch()
        self._locks: list[Node] = []                # tree nodes the batch writes under
        self._to_free: list[Slots] = []             # recomputed copies of KV the tree holds already

    def add(self, i: int) -> None:
        """Issue executed request i's uncached prompt tokens (over as many batches as they take)."""
        s = self.state
        req, res = s.requests[i], s.results[i]
        toks = req.prompt
        n = len(toks)
        res.prompt_tokens = n
        first = True
        while True:
            m_slots, node, matched = self.kv.match(i, toks)
            m = self.capture.first_missing(i, matched)
            if first:
                res.cached_tokens, first = m, False
                s.stats.cached_tokens += m
            if m == n:
                break
            self.kv.lock(node)
            chunk = min(n - m, self.max_tokens - self.batch.num_tokens)
            new = self.kv.alloc(chunk) if chunk > 0 else None
            self.kv.unlock(node)
            if new is None:
                self._wait_for_room(f"request {i} ({n} tokens)")
                continue
            self._issue(i, toks, m, m + chunk, np.concatenate([m_slots[:m], new]))
            res.computed_tokens += chunk
            s.stats.computed_tokens += chunk
            if m + chunk == n:
                break
        if isinstance(req, GenerateRequest):
            self._enqueue(i, req)
        else:
            for member in s.stats.members[i]:
                s.done(member)

    def _issue(self, i: int, toks: list[int], start: int, end: int, full: Slots) -> None:
        positions, keys = self.capture.wanted(i, start, end)
        self.capture.issue(keys)
        tree = self.kv.tree
        if tree is not None:
            present, node = tree.insert(toks[:end], full)
            if present > start:  # we recompute tokens the tree already holds: free our copies after
                self._to_free.append(full[start:present])
            tree.lock(node)
            self._locks.append(node)
        else:
            self.kv.own[i] = full
        self.batch.add(toks[start:end], start, full[start:end], full, positions, keys)

    def _enqueue(self, i: int, req: GenerateRequest) -> None:
        """Hold the prompt's KV, promise its decode slots, and queue it for a decode row."""
        n = len(req.prompt)
        reserve = max(req.params.most_tokens - 1, 0)
        while True:
            slots, node, _ = self.kv.match(i, req.prompt)
            self.kv.lock(node)
            if self.kv.make_free(self.kv.promised + reserve):
                break
            self.kv.unlock(node)
            self._wait_for_room(f"request {i} ({n} prompt + {reserve} new tokens)")
        if self.kv.tree is None:
            slots = self.kv.own.pop(i)
        assert len(slots) >= n, "prompt KV must be in the pool"
        self.kv.promised += reserve
        self.decode.enqueue(Queued(i, node, slots[:n], reserve, self.capture.prompt_key(i)))

    def _wait_for_room(self, what: str) -> None:
        """Free pool space: run the pending prefill batch, admit queued requests, or decode."""
        if self.batch.num_tokens:
            self.flush()
        elif self.decode.can_admit:
            self.decode.admit()
        elif self.decode.running:
            self.decode.decode_some()
        else:
            raise RuntimeError(f"KV pool of {self.kv.pool.num_slots} tokens cannot hold {what}; "
                               "raise kv_cache_tokens")

    def flush(self) -> None:
        """Launch the batch. One batch stays in flight: the host builds the next batch while the device
        runs this one, and unlocking now is safe, as later batches run after it on the same stream."""
        b = self.batch
        if b.num_tokens == 0:
            return
        logits = self.model_runner.forward(b)
        self.state.stats.forward_batches += 1
        self.capture.launch(np.concatenate(b.logit_keys), logits)      # a prefill row always has a key
        for node in self._locks:
            self.kv.unlock(node)
        for slots in self._to_free:
            self.kv.free(slots)
        self._new_batch()
        if self.kv.tree is None:  # without a cache, a scored request's slots die with its batch
            s = self.state
            for i in [i for i in self.kv.own if not isinstance(s.requests[i], GenerateRequest)
                      and s.results[i].computed_tokens == len(s.requests[i].prompt)]:
                self.kv.free(self.kv.own.pop(i))

