"""Data parallelism: one engine per device, each in its own worker process, behind `Engine`'s calls.

`ParallelEngine.stream` cuts each batch's radix tree into chunks along whole subtrees
(`scheduler.partition`): each worker's share of the cost, in chunks of falling size. The cut takes the
plan's own sorted order where a plan was made (nothing is sorted twice), and a chunk crosses as the
tree's edges (`worker.chunk_message`), which its worker plans as they come. A worker runs its own chunks
in order, one queued behind the one it runs; a worker with none left takes the last not yet started of
the worker with the most left (`dispatch.Dispatch`), so workers end together. Chunks are handed out on a thread
of their own (`_feed`), and results handed over as they arrive (`Handover.due` False), so that neither
waits on what the caller does with results. A shared prefix is computed once
per worker that needs it, not once per request as round-robin dispatch would; requests of one group (a
multi-stage program's calls) go to one worker, and its later calls to the worker that ran its earlier
ones, whose cache holds their prefix. The results come back in the order of the requests, as from one
engine.

Workers (`engine/worker.py`, started and ended by `pool.Workers`) start as the engine is made, each fitting
its own engine to its device, and hand finished results back every `EngineSpec.relay_s` seconds, so
handovers to the caller (the run's result parts, and so a stop) and progress go on as with one engine. A
worker that fails raises here, naming it (`WorkerFailed`). A run's programs may instead go to the workers
whole (`shares` cuts them, `pool.Workers.spread` runs them: lmbatch/run/spread.py).
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any, Hashable, Iterator, Sequence

from lmbatch.engine.dispatch import Dispatch, Gather
from lmbatch.engine.pool import Workers
from lmbatch.engine.protocol import Handover, Progress, Request, Result, StreamArgs, drain, remaining
from lmbatch.engine.worker import (
    Done,
    Part,
    chunk_message,
)
from lmbatch.requests import (
    GenerateRequest,
    GenerateResult,
    RunStats,
    ScoreRequest,
    optimal_hit_rate,
)
from lmbatch.scheduler.partition import DECODE_COST, Batch, Chunking, chunk_batch
from lmbatch.scheduler.planner import posthoc_unique

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from lmbatch.engine.options import EngineSpec
    from lmbatch.model.config import ModelConfig
    from lmbatch.scheduler.planner import Plan

CHUNKS = 8          # chunks of each worker's share of a scoring batch (a generating one: 1, decode rows stay together)


@dataclass
class WorkerLoad:
    """One worker's work over the run: seconds running chunks and waiting, tokens computed, chunks run
    and how many of them it took from another worker."""
    busy_s: float = 0.0
    idle_s: float = 0.0
    computed_tokens: int = 0
    chunks: int = 0
    taken: int = 0


class ParallelEngine(Workers):
    """`spec.workers` engines in worker processes, used as one (a `BatchEngine`). Each engine is
    `spec.ranks` processes (a tensor-parallel group, one device each)."""
    open_stream = False     # a batch is cut across the workers before it runs: no request joins it

    def __init__(self, spec: EngineSpec, cfg: ModelConfig, gpus: Sequence[str] | None = None):
        """`gpus`: the CUDA_VISIBLE_DEVICES entry of each process (worker k's rank r: k * tp + r);
        `spec.ray_address`: the processes are placed on that Ray cluster instead (engine/cluster.py)."""
        super().__init__(spec, cfg, gpus)
        n = spec.workers
        self.group_worker: dict[Hashable, int] = {}     # group -> the worker that ran its earlier calls
        self.loads = [WorkerLoad() for _ in range(n)]
        self._executed: list[list[tuple[Request, Result]]] = [[] for _ in range(n)]  # each worker's, with results
        self._first_wave: list[int] | None = None   # each worker's optimum, while one scoring batch has run
        self._spread_unique: list[int] | None = None    # each worker's optimum, where it ran programs (`spread`)
        self._batches = 0

    def optimal_unique_tokens(self) -> int | None:
        """The fewest prompt tokens the workers had to compute, each over what it executed in every
        run so far (`planner.posthoc_unique` per worker: shared prefixes once per worker that needs
        them, text a worker generated free; after one batch of scoring, from its cut): the data-parallel
        counterpart of the run's optimum."""
        if self._spread_unique is not None:
            return sum(self._spread_unique)
        if self._first_wave is not None:
            return sum(self._first_wave)
        total = 0
        for executed in self._executed:
            prompts = [q.prompt for q, _ in executed]
            generated = [(p + r.token_ids[:-1], len(p)) for p, (_, r) in zip(prompts, executed)
                         if isinstance(r, GenerateResult)]
            total += posthoc_unique(prompts, generated)
        return total

    def run(self, requests: Sequence[Request], *, schedule: str = "dfs", seed: int = 0,
            progress: Progress | None = None) -> tuple[list[Result], RunStats]:
        return drain(self.stream(requests, schedule=schedule, seed=seed, progress=progress))

    def stream(self, requests: Sequence[Request], **args: Unpack[StreamArgs]) -> Iterator[Handover]:
        """As `Engine.stream`, over the workers (`plan`: its sorted order is cut; each worker plans its
        chunks from it)."""
        t0 = time.perf_counter()
        plan, progress, handover_due, groups = (args.get("plan"), args.get("progress"), args.get("handover_due"),
                                                args.get("groups"))
        schedule, seed = args.get("schedule", "dfs"), args.get("seed", 0)
        cut = self._cut(requests, plan, groups)
        dispatch = Dispatch(cut.chunks, len(self.conns))
        gather = Gather(requests, cut, progress, len(self.conns))
        gather.stats.unique_tokens = cut.unique_tokens          # the whole tree's: what one engine computes
        gather.stats.optimal_hit_rate = gather.stats.engine_optimal_hit_rate = \
            optimal_hit_rate(cut.unique_tokens, cut.prompt_tokens)
        t1 = time.perf_counter()
        self.running = True
        final: list[int] = []
        handed = bytearray(len(requests))
        reports: queue.Queue[Any] = queue.Queue()
        threading.Thread(target=self._feed, args=(dispatch, requests, cut, (schedule, seed), reports),
                         name="lmbatch-dispatch", daemon=True).start()
        while (report := reports.get()) is not None:
            if isinstance(report, BaseException):
                raise report
            k, msg = report
            got = gather.part(msg) if isinstance(msg, Part) else gather.done(k, msg)
            final += got        # handed over as they come (the caller works while the workers do)
            due = handover_due is not None and handover_due()
            if final or due:
                for i in final:
                    handed[i] = 1
                yield Handover(final, gather.results, gather.stats, False, due)
                final = []
        self.running = False
        gather.stats.plan_s, gather.stats.execute_s = t1 - t0, time.perf_counter() - t1
        self._account(requests, gather, cut, groups, dispatch.taken)
        yield Handover(remaining(gather.stats, handed), gather.results, gather.stats, True)

    def shares(self, requests: Sequence[Request], groups: Sequence[Hashable]) -> list[list[Hashable]]:
        """The groups of each worker's share of a batch (cut as `stream` cuts it: along whole subtrees, by
        cost), each worker's in the batch's sorted order."""
        out: list[dict[Hashable, None]] = [{} for _ in self.conns]
        for chunk in self._cut(requests, None, groups).chunks:
            out[chunk.home].update((groups[i], None) for i in chunk.requests)
        return [list(d) for d in out]

    def account_spread(self, k: int, busy_s: float, idle_s: float, computed_tokens: int, unique_tokens: int) -> None:
        """Worker k's load and optimum over programs it ran (`spread`)."""
        load = self.loads[k]
        load.busy_s += busy_s
        load.idle_s += idle_s
        load.computed_tokens += computed_tokens
        load.chunks += 1
        if self._spread_unique is None:
            self._spread_unique = [0] * len(self.conns)
        self._spread_unique[k] += unique_tokens

    def _cut(self, requests: Sequence[Request], plan: Plan | None, groups: Sequence[Hashable] | None) -> Chunking:
        """The batch's chunks: by cost (a generation's most new tokens count too), along the plan's sorted
        order where it has one, groups that ran before on the worker that ran them."""
        pinned = {g: self.group_worker[g] for g in set(groups) if g in self.group_worker} if groups else None
        generates = any(isinstance(r, GenerateRequest) for r in requests)
        extra = [DECODE_COST * r.params.most_tokens if isinstance(r, GenerateRequest) else 0.0 for r in requests] \
            if generates else None
        presorted = (plan.dfs, plan.lcps) if plan is not None and len(plan.dfs) == len(requests) else None
        mergeable = [isinstance(r, ScoreRequest) for r in requests]
        batch = Batch([r.prompt_len for r in requests], groups, mergeable, extra, lengths=True) if presorted \
            else Batch([r.prompt for r in requests], groups, mergeable, extra)
        return chunk_batch(batch, len(self.conns), 1 if generates else CHUNKS, pinned=pinned, presorted=presorted)

    def _send(self, k: int, chunks: list[int], requests: Sequence[Request], cut: Chunking,
              how: tuple[str, int]) -> None:
        """Chunks to worker k, run under `how` (schedule, seed)."""
        schedule, seed = how
        for c in chunks:
            self._send_msg(k, chunk_message(requests, cut.chunks[c], c, schedule, seed))

    def _feed(self, dispatch: Dispatch, requests: Sequence[Request], cut: Chunking, how: tuple[str, int],
              out: queue.Queue[Any]) -> None:
        """On a thread of its own, so that no worker waits on what the caller does with results: give each
        worker its chunks, the next as one ends, and put every (worker, `Part` or `Done`) in `out` as it
        comes; then None. A worker's error or exit goes in `out` as the exception it raises."""
        try:
            for k, chunks in enumerate(dispatch.start()):
                self._send(k, chunks, requests, cut, how)
            watch = list(self.other_ranks) + [p.sentinel for p in self.procs]
            while busy := dispatch.busy():
                ready = wait([self.conns[k] for k in busy] + watch)
                for k in [k for k in busy if self.conns[k] in ready]:
                    try:
                        msg = self.conns[k].recv()
                    except (EOFError, OSError):
                        msg = None
                    if isinstance(msg, Done):
                        dispatch.done(k, msg.chunk)
                        self._send(k, dispatch.take(k), requests, cut, how)
                    elif not isinstance(msg, Part):
                        self._failed(self.conns[k], msg)
                    out.put((k, msg))
                for who in [w for w in watch if w in ready]:
                    if isinstance(who, Connection):
                        self._recv(who, type(None))       # only an error comes from there
                    elif not any(self.conns[k].poll() for k in busy):     # exited, its last words read
                        self._failed(who, None)
            out.put(None)
        except BaseException as e:  # noqa: BLE001  raised on the caller's thread
            out.put(e)

    def _account(self, requests: Sequence[Request], gather: Gather, cut: Chunking,
                 groups: Sequence[Hashable] | None, taken: list[int]) -> None:
        """After a batch: where each group ran, each worker's load, and what each executed (its optimum)."""
        wall = gather.stats.execute_s
        generated = False
        for k, ran in enumerate(gather.ran):
            load = self.loads[k]
            load.busy_s += gather.busy[k]
            load.idle_s += max(0.0, wall - gather.busy[k])
            load.chunks += len(ran)
            load.taken += taken[k]
            load.computed_tokens += sum(gather.counts[c].computed_tokens for c in ran)
            for c in ran:
                self._executed[k] += [(requests[j], gather.results[j]) for j in gather.executed[c]]
                generated = generated or any(isinstance(requests[j], GenerateRequest) for j in gather.executed[c])
                if groups is not None:
                    self.group_worker.update((groups[i], k) for i in cut.chunks[c].requests)
        self._batches += 1
        self._first_wave = [cut.unique_of(ran) for ran in gather.ran] \
            if self._batches == 1 and not generated else None

    def load_report(self) -> list[dict[str, float | int]]:
        """Each worker's load over the run (summary.json `data_parallel.workers_load`)."""
        return [{"busy_s": round(w.busy_s, 3), "idle_s": round(w.idle_s, 3), "computed_tokens": w.computed_tokens,
                 "chunks": w.chunks, "chunks_taken": w.taken} for w in self.loads]
