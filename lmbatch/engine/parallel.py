"""Data parallelism: one engine per device, each in its own worker process, behind `Engine`'s calls.

`ParallelEngine.run` cuts each batch's radix tree into one part per worker along whole subtrees
(`scheduler.partition`), so a shared prefix is computed once per part that needs it, not once per
request as round-robin dispatch would; each worker plans and runs its part on its own engine, and
the results come back in the order of the requests, as from one engine. Requests of one group (a
multi-stage program's calls) go to one worker: its later calls find their prefix in that worker's
cache.

Workers (`engine/worker.py`) hand their finished results back every `EngineSpec.relay_s` seconds,
so handovers to the caller (the run's result parts, and so a stop) and progress go on as with one
engine. A worker that fails raises here, naming it. Workers ignore SIGINT: Ctrl-C in a terminal
reaches the whole process group, and it is the parent that stops a run (`close` ends workers still
running).
"""
from __future__ import annotations

import multiprocessing as mp
import time
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any, Callable, Hashable, Iterator, Sequence

from lmbatch.engine.protocol import Handover, Progress, Request, Result, drain, remaining
from lmbatch.engine.worker import Close, Done, Failed, Matched, MatchQuery, Part, Ready, RunBatch, counts, pack, serve
from lmbatch.errors import UserError
from lmbatch.requests import GenerateRequest, GenerateResult, RunStats, ScoreRequest, ScoreResult, TokenCounts
from lmbatch.scheduler.partition import partition
from lmbatch.scheduler.planner import posthoc_unique

if TYPE_CHECKING:
    import torch

    from lmbatch.engine.options import EngineSpec
    from lmbatch.model.config import ModelConfig
    from lmbatch.scheduler.planner import Plan


class ParallelEngine:
    """`spec.workers` engines in worker processes, used as one (a `BatchEngine`). Each engine is
    `spec.tensor_parallel` processes (a tensor-parallel group, one device each)."""

    def __init__(self, spec: EngineSpec, cfg: ModelConfig, gpus: Sequence[str] | None = None):
        """`gpus`: the CUDA_VISIBLE_DEVICES entry of each process (worker k's rank r: k * tp + r);
        `spec.ray_address`: the processes are placed on that Ray cluster instead (engine/cluster.py)."""
        n = spec.workers
        self.cfg, self.spec, self.data_parallel, self.tensor_parallel = cfg, spec, n, spec.tensor_parallel
        self.group_worker: dict[Hashable, int] = {}     # group -> the worker that ran its earlier calls
        self.running = False
        self._prompts: list[list[list[int]]] = [[] for _ in range(n)]     # each worker's executed prompts
        self._generated: list[list[tuple[list[int], int]]] = [[] for _ in range(n)]  # and generations
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
            self.slots = [self._recv(c, Ready).kv_slots for c in self.conns]
            for c in self.other_ranks:
                self._recv(c, Ready)
        except BaseException:
            self.close()
            raise

    @property
    def device(self) -> torch.device:
        import torch
        return torch.device(self.spec.device)

    @property
    def kv_slots(self) -> int:
        """Tokens the smallest worker's pool holds (what one request may take)."""
        return min(self.slots)

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
            raise (UserError if msg.user_error else RuntimeError)(f"{name}: {msg.text}")
        if msg is not None:
            raise RuntimeError(f"{name} sent {type(msg).__name__} out of turn")
        proc = next((p for p in self.procs if self.names[p.sentinel] == name), None)
        if proc is None:
            raise RuntimeError(f"{name} closed its connection (it exited)")
        proc.join(5)
        raise RuntimeError(f"{name} exited (code {proc.exitcode})")

    def optimal_unique_tokens(self) -> int | None:
        """The fewest prompt tokens the workers had to compute, each over what it executed in every
        run so far (`planner.posthoc_unique` per worker: shared prefixes once per worker that needs
        them, text a worker generated free): the data-parallel counterpart of the run's optimum."""
        return sum(posthoc_unique(p, g) for p, g in zip(self._prompts, self._generated))

    def match_lens(self, seqs: list[list[int]]) -> list[int]:
        """Each sequence's longest cached prefix on any worker."""
        for c in self.conns:
            c.send(MatchQuery(seqs))
        got = [self._recv(c, Matched).lengths for c in self.conns]
        return [max(col) for col in zip(*got)] if seqs else []

    def run(self, requests: Sequence[Request], *, schedule: str = "dfs", seed: int = 0,
            progress: Progress | None = None) -> tuple[list[Result], RunStats]:
        return drain(self.stream(requests, schedule=schedule, seed=seed, progress=progress))

    def stream(self, requests: Sequence[Request], *, schedule: str = "dfs", seed: int = 0, plan: Plan | None = None,
               progress: Progress | None = None, handover_due: Callable[[], bool] | None = None,
               groups: Sequence[Hashable] | None = None) -> Iterator[Handover]:
        """As `Engine.stream`, over the workers (`plan` is not used: each worker plans its part)."""
        t0 = time.perf_counter()
        pinned = {g: self.group_worker[g] for g in set(groups) if g in self.group_worker} if groups else None
        part = partition([r.prompt for r in requests], len(self.conns), groups=groups, pinned=pinned,
                         mergeable=[isinstance(r, ScoreRequest) for r in requests])
        if groups is not None:
            for k, idx in enumerate(part.parts):
                self.group_worker.update((groups[i], k) for i in idx)
        for k, idx in enumerate(part.parts):
            if idx:
                self.conns[k].send(RunBatch([pack(requests[i]) for i in idx], schedule, seed))
        gather = _Gather(requests, part.parts, progress)
        gather.stats.unique_tokens = sum(part.part_unique_tokens)
        gather.stats.optimal_hit_rate = gather.stats.engine_optimal_hit_rate = part.hit_rate
        t1 = time.perf_counter()
        self.running = True
        final: list[int] = []
        handed = bytearray(len(requests))
        for got in self._reports(gather, {k for k, idx in enumerate(part.parts) if idx}):
            final += got
            if handover_due is not None and handover_due():
                for i in final:
                    handed[i] = 1
                yield Handover(final, gather.results, gather.stats, False)
                final = []
        self.running = False
        gather.stats.plan_s, gather.stats.execute_s = t1 - t0, time.perf_counter() - t1
        for k, executed in enumerate(gather.executed):
            for j in executed:
                prompt, r = requests[j].prompt, gather.results[j]
                self._prompts[k].append(prompt)
                if isinstance(r, GenerateResult):
                    self._generated[k].append((prompt + r.token_ids[:-1], len(prompt)))
        yield Handover(remaining(gather.stats, handed), gather.results, gather.stats, True)

    def _reports(self, gather: _Gather, busy: set[int]) -> Iterator[list[int]]:
        """The requests each worker report makes final (a `Part`), until each busy worker is `Done`;
        any worker's error or exit raises."""
        watch = list(self.other_ranks) + [p.sentinel for p in self.procs]
        while busy:
            ready = wait([self.conns[k] for k in busy] + watch)
            for k in [k for k in sorted(busy) if self.conns[k] in ready]:
                try:
                    msg = self.conns[k].recv()
                except (EOFError, OSError):
                    msg = None
                if isinstance(msg, Part):
                    yield gather.part(k, msg)
                elif isinstance(msg, Done):
                    gather.done(k, msg)
                    busy.discard(k)
                else:
                    self._failed(self.conns[k], msg)
            for who in [w for w in watch if w in ready]:
                if isinstance(who, Connection):
                    self._recv(who, type(None))       # only an error comes from there
                elif not any(self.conns[k].poll() for k in busy):     # exited, its last words read
                    self._failed(who, None)

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
    """`n` workers of `spec.tensor_parallel` local processes: each one's connections (rank 0 first),
    and the processes."""
    t = spec.tensor_parallel
    ctx = mp.get_context("spawn")              # CUDA cannot be forked; a fresh interpreter each
    groups: list[list[Connection]] = []
    procs = []
    for k in range(n):
        port = _free_port() if t > 1 else 0
        groups.append([])
        for r in range(t):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=serve, args=(r, spec, child, gpus[k * t + r] if gpus else None, port),
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


class _Gather:
    """One run's results and counts as the workers report them, in the requests' own indices."""

    def __init__(self, requests: Sequence[Request], parts: list[list[int]], progress: Progress | None):
        self.parts, self.progress = parts, progress
        self.results: list[Result] = [GenerateResult() if isinstance(r, GenerateRequest) else ScoreResult()
                                      for r in requests]
        self.stats = RunStats(requests=len(requests))
        self.counts = [TokenCounts() for _ in parts]
        self.merged = bytearray(len(requests))      # final results a worker sent in a Part
        self.executed: list[list[int]] = [[] for _ in parts]     # each worker's executed requests

    def _merge(self, k: int, pairs: Sequence[tuple[int, Result]], members: dict[int, list[int]]) -> list[int]:
        idx, final = self.parts[k], []
        for i, r in pairs:
            self.results[idx[i]] = r
            final.append(idx[i])
        for j, ms in members.items():
            self.stats.members[idx[j]] = [idx[m] for m in ms]
            self.stats.order.append(idx[j])
            self.executed[k].append(idx[j])
        return final

    def _count(self, k: int, c: TokenCounts) -> None:
        """Worker k's counts so far; the run's are every worker's added up."""
        self.counts[k] = c
        total = TokenCounts()
        for c in self.counts:
            total.add(c)
        s = self.stats
        s.prompt_tokens, s.cached_tokens = total.prompt_tokens, total.cached_tokens
        s.computed_tokens, s.decode_tokens = total.computed_tokens, total.decode_tokens

    def part(self, k: int, msg: Part) -> list[int]:
        """Worker k's results final since its last report."""
        final = self._merge(k, msg.results, msg.members)
        self._count(k, msg.counts)
        for g in final:
            self.merged[g] = 1
        if self.progress is not None and final:
            self.progress(final[-1], self.stats)
        return final

    def done(self, k: int, msg: Done) -> None:
        """Worker k's run ended: the rest of its results and its counters."""
        idx, st = self.parts[k], msg.stats
        pairs = [(i, msg.results[i]) for i in range(len(idx)) if not self.merged[idx[i]]]
        members = {j: st.members[j] for j in st.order if idx[j] not in self.stats.members}
        self._merge(k, pairs, members)
        self._count(k, counts(st))
        self.stats.add_engine_counts(st)
        if self.progress is not None and idx:
            self.progress(idx[-1], self.stats)
