"""Data parallelism's bookkeeping for one batch, on the parent's side (lmbatch/engine/parallel.py): which
chunks each worker runs (`Dispatch`: its own in order, a few ahead; with none of its own left, it takes one from
the worker with the most left, so that workers end together), and the results and counts as workers report
them, back in the requests' own order (`Gather`)."""
from __future__ import annotations

from collections import deque
from typing import Sequence

from lmbatch.engine.protocol import Progress, Request, Result
from lmbatch.engine.worker import Done, Part, counts
from lmbatch.requests import GenerateRequest, GenerateResult, RunStats, ScoreResult, TokenCounts
from lmbatch.scheduler.partition import Chunk, Chunking

AHEAD = 2           # chunks a worker holds: the one it runs and the next, read and planned meanwhile


class Dispatch:
    """Which chunks each worker runs: its own in order, AHEAD at a time; with none of its own left, the
    last chunk not yet started of the worker with the most cost left (not one pinned there)."""

    def __init__(self, chunks: list[Chunk], n: int):
        self.chunks = chunks
        self.queues: list[deque[int]] = [deque() for _ in range(n)]
        for c, ch in enumerate(chunks):         # a worker's pinned chunk comes before its share
            self.queues[ch.home].append(c)
        self.inflight: list[list[int]] = [[] for _ in range(n)]
        self.taken = [0] * n

    def start(self) -> list[list[int]]:
        """Each worker's first chunks: its own first, then, all given theirs, any taken from another."""
        first = [self.take(k, steal=False) for k in range(len(self.queues))]
        return [got + self.take(k) for k, got in enumerate(first)]

    def take(self, k: int, steal: bool = True) -> list[int]:
        """The chunks worker k gets now (none: it has AHEAD already, or nothing is left to give)."""
        out = []
        while len(self.inflight[k]) < AHEAD:
            c = self.queues[k].popleft() if self.queues[k] else self._steal(k) if steal else None
            if c is None:
                break
            self.inflight[k].append(c)
            out.append(c)
        return out

    def _steal(self, k: int) -> int | None:
        left = [(sum(self.chunks[c].cost for c in q), v) for v, q in enumerate(self.queues)
                if v != k and q and not self.chunks[q[-1]].pinned]
        if not left:
            return None
        self.taken[k] += 1
        return self.queues[max(left)[1]].pop()

    def done(self, k: int, c: int) -> None:
        self.inflight[k].remove(c)

    def busy(self) -> list[int]:
        """Workers running a chunk."""
        return [k for k, f in enumerate(self.inflight) if f]


class Gather:
    """One batch's results and counts as the workers report them, in the requests' own indices."""

    def __init__(self, requests: Sequence[Request], cut: Chunking, progress: Progress | None, workers: int):
        self.cut, self.progress = cut, progress
        self.results: list[Result] = [GenerateResult() if isinstance(r, GenerateRequest) else ScoreResult()
                                      for r in requests]
        self.stats = RunStats(requests=len(requests))
        self.counts: dict[int, TokenCounts] = {}                  # each chunk's so far
        self.merged = bytearray(len(requests))                    # final results a worker sent in a Part
        self.executed: dict[int, list[int]] = {}                  # each chunk's executed requests
        self.ran: list[list[int]] = [[] for _ in range(workers)]  # chunks each worker ran
        self.busy = [0.0] * workers

    def _merge(self, c: int, pairs: Sequence[tuple[int, Result]], members: dict[int, list[int]]) -> list[int]:
        idx, final = self.cut.chunks[c].requests, []
        for i, r in pairs:
            self.results[idx[i]] = r
            final.append(idx[i])
        executed = self.executed.setdefault(c, [])
        for j, ms in members.items():
            self.stats.members[idx[j]] = [idx[m] for m in ms]
            self.stats.order.append(idx[j])
            executed.append(idx[j])
        return final

    def _count(self, c: int, got: TokenCounts) -> None:
        """Chunk c's counts so far; the batch's are every chunk's added up."""
        self.counts[c] = got
        total = TokenCounts()
        for x in self.counts.values():
            total.add(x)
        s = self.stats
        s.prompt_tokens, s.cached_tokens = total.prompt_tokens, total.cached_tokens
        s.computed_tokens, s.decode_tokens = total.computed_tokens, total.decode_tokens

    def part(self, msg: Part) -> list[int]:
        """A chunk's results final since its last report."""
        final = self._merge(msg.chunk, msg.results, msg.members)
        self._count(msg.chunk, msg.counts)
        for g in final:
            self.merged[g] = 1
        if self.progress is not None and final:
            self.progress(final[-1], self.stats)
        return final

    def done(self, k: int, msg: Done) -> list[int]:
        """Worker k ran chunk `msg.chunk` to its end: the rest of its results (final now) and its counters."""
        c, st = msg.chunk, msg.stats
        idx = self.cut.chunks[c].requests
        pairs = [(i, msg.results[i]) for i in range(len(idx)) if not self.merged[idx[i]]]
        members = {j: st.members[j] for j in st.order if idx[j] not in self.stats.members}
        final = self._merge(c, pairs, members)
        for g in final:
            self.merged[g] = 1
        self._count(c, counts(st))
        self.stats.add_engine_counts(st)
        self.ran[k].append(c)
        self.busy[k] += msg.busy_s
        if self.progress is not None and idx:
            self.progress(idx[-1], self.stats)
        return final
