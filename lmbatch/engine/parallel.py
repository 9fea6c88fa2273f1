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

Workers (`engine/worker.py`) start as the engine is made, each fitting its own engine to its device, and
hand finished results back every `EngineSpec.relay_s` seconds, so handovers to the caller (the run's
result parts, and so a stop) and progress go on as with one engine. A worker that fails raises here,
naming it (`WorkerFailed`). Workers ignore SIGINT: Ctrl-C in a terminal reaches the whole process group,
and it is the parent that stops a run (`close` ends workers still running).
"""
from __future__ import annotations

import multiprocessing as mp
import queue
import threading
import time
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any, Hashable, Iterator, Sequence

from lmbatch.engine.dispatch import Dispatch, Gather
from lmbatch.engine.protocol import Handover, Progress, Request, Result, StreamArgs, drain, remaining
from lmbatch.engine.worker import (
    Close,
    Compressed,
    Done,
    Failed,
    Finished,
    Matched,
    MatchQuery,
    Part,
    Ready,
    chunk_message,
    serve,
)
from lmbatch.errors import UserError, WorkerFailed
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
    import torch
    from typing_extensions import Unpack

    from lmbatch.engine.build import Attention
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


class ParallelEngine:
    """`spec.workers` engines in worker processes, used as one (a `BatchEngine`). Each engine is
    `spec.ranks` processes (a tensor-parallel group, one device each)."""

    def __init__(self, spec: EngineSpec, cfg: ModelConfig, gpus: Sequence[str] | None = None):
        """`gpus`: the CUDA_VISIBLE_DEVICES entry of each process (worker k's rank r: k * tp + r);
        `spec.ray_address`: the processes are placed on that Ray cluster instead (engine/cluster.py)."""
        n = spec.workers
        self.cfg, self.data_parallel, self.tensor_parallel = cfg, n, spec.ranks
        self.group_worker: dict[Hashable, int] = {}     # group -> the worker that ran its earlier calls
        self.running = False
        self.loads = [WorkerLoad() for _ in range(n)]
        self._executed: list[list[tuple[Request, Result]]] = [[] for _ in range(n)]  # each worker's, with results
        self._first_wave: list[int] | None = None   # each worker's optimum, while one scoring batch has run
        self._spread_unique: list[int] | None = None    # each worker's optimum, where it ran programs (`spread`)
        self._batches = 0
        self.procs: list[Any] = []                 # local processes (none on Ray)
        self.cluster: Any = None
        if spec.ray_address is not None:
            from lmbatch.engine.cluster import RayWorkers
            self.cluster = RayWorkers(spec.ray_address, spec, n)
            groups = self.cluster.groups
        else:
            groups, self.procs = _launch(spec, n, gpus)
        self.conns = [g[0] for g in groups]                 # rank 0 of each worker: requests and results
        self.other_ranks = [c for g in groups for c in g[1:]]   # only their errors come from there
        self.names: dict[Any, str] = {}                     # a connection or process sentinel -> whose
        for k, g in enumerate(groups):
            for r, c in enumerate(g):
                name = f"data-parallel worker {k}" + (f" (tensor-parallel rank {r})" if len(g) > 1 else "")
                self.names[c] = name
                if self.procs:
                    self.names[self.procs[k * len(g) + r].sentinel] = name
        try:
            self.ready: list[Ready] = [self._recv(c, Ready) for c in self.conns]
            for c in self.other_ranks:
                self._recv(c, Ready)
        except BaseException:
            self.close()
            raise
        self.spec = replace(self.ready[0].spec, data_parallel=n, tensor_parallel=spec.ranks)

    @property
    def attention(self) -> Attention:
        return self.ready[0].attention

    @property
    def seconds(self) -> dict[str, float]:
        """The slowest worker's start, by step ("spawn": its interpreter and lmbatch's modules)."""
        slowest = max((r.seconds for r in self.ready), key=lambda s: sum(s.values()))
        return {("spawn" if k == "startup" else k): v for k, v in slowest.items()}

    @property
    def device(self) -> torch.device:
        import torch
        return torch.device(self.spec.device)

    @property
    def kv_slots(self) -> int:
        """Tokens the smallest worker's pool holds (what one request may take)."""
        return min(r.kv_slots for r in self.ready)

    def _recv(self, c: Connection, kind: type) -> Any:
        """The next message from `c`, which must be a `kind`; a worker's error or exit raises."""
        try:
            msg = c.recv()
        except (EOFError, OSError):
            msg = None
        if not isinstance(msg, kind):
            self._failed(c, msg)
        return msg

    def _failed(self, who: Any, msg: Any) -> None:
        name = self.names[who]
        if isinstance(msg, Failed):
            raise (UserError if msg.user_error else WorkerFailed)(f"{name}: {msg.text}")
        if msg is not None:
            raise WorkerFailed(f"{name} sent {type(msg).__name__} out of turn")
        proc = next((p for p in self.procs if self.names[p.sentinel] == name), None)
        if proc is None:
            raise WorkerFailed(f"{name} closed its connection (it exited)")
        proc.join(5)
        raise WorkerFailed(f"{name} exited (code {proc.exitcode})")

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

    def match_lens(self, seqs: list[list[int]]) -> list[int]:
        """Each sequence's longest cached prefix on any worker."""
        for c in self.conns:
            c.send(MatchQuery(seqs))
        got = [self._recv(c, Matched).lengths for c in self.conns]
        return [max(col) for col in zip(*got)] if seqs else []

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

    def spread(self, works: dict[int, Any], tick_s: float) -> Iterator[tuple[int, Any] | None]:
        """Run `works[k]` (a `worker.Remote`) on worker k: yield each (worker, message) it sends as it comes,
        and None every `tick_s` seconds without one (the caller may stop there); end once every work has
        `Finished` (yielded too). A worker's error or exit raises."""
        self.running = True
        for k, work in works.items():
            self._send_msg(k, work)
        left = set(works)
        watch = list(self.other_ranks) + [p.sentinel for p in self.procs]
        while left:
            ready = wait([self.conns[k] for k in left] + watch, timeout=tick_s)
            if not ready:
                yield None
            for k in [k for k in sorted(left) if self.conns[k] in ready]:
                try:
                    msg = self.conns[k].recv()
                except (EOFError, OSError):
                    msg = None
                if msg is None or isinstance(msg, Failed):
                    self._failed(self.conns[k], msg)
                if isinstance(msg, Finished):
                    left.discard(k)
                yield k, msg
            for who in [w for w in watch if w in ready]:
                if isinstance(who, Connection):
                    self._recv(who, type(None))
                elif not any(self.conns[k].poll() for k in left):
                    self._failed(who, None)
        self.running = False

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

    def _send_msg(self, k: int, msg: Any) -> None:
        try:
            self.conns[k].send(Compressed.of(msg) if self.cluster is not None else msg)
        except OSError:         # it exited: its last words, or its exit code
            last = None
            try:
                last = self.conns[k].recv() if self.conns[k].poll() else None
            except (EOFError, OSError):
                pass
            self._failed(self.conns[k], last)

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

    def close(self) -> None:
        """End the workers: at once if a run was cut short (they are still working), else when they
        have read the close."""
        for c in self.conns:
            try:
                c.send(Close())
            except OSError:
                pass
        for p in self.procs:
            p.join(0 if self.running else 10)
            if p.is_alive():
                p.terminate()
                p.join(5)
        if self.cluster is not None:
            self.cluster.close(at_once=self.running)


def _launch(spec: EngineSpec, n: int, gpus: Sequence[str] | None) -> tuple[list[list[Connection]], list[Any]]:
    """`n` workers of `spec.ranks` local processes: each one's connections (rank 0 first), and the processes."""
    t = spec.ranks
    ctx = mp.get_context("spawn")              # CUDA cannot be forked; a fresh interpreter each
    groups: list[list[Connection]] = []
    procs = []
    for k in range(n):
        port = _free_port() if t > 1 else 0
        groups.append([])
        for r in range(t):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=serve, args=(r, spec, child, gpus[k * t + r] if gpus else None, port, k),
                            name=f"lmbatch-dp{k}-tp{r}", daemon=True)
            p.start()
            child.close()
            groups[-1].append(parent)
            procs.append(p)
    return groups, procs


def _free_port() -> int:
    """A TCP port on the loopback address for a tensor-parallel group's rendezvous."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
