"""Data parallelism: one engine per device, each in its own worker process, behind `Engine`'s calls.

`ParallelEngine.run` cuts each batch's radix tree into one part per worker along whole subtrees
(`scheduler.partition`), so a shared prefix is computed once per part that needs it, not once per
request as round-robin dispatch would; each worker plans and runs its part on its own engine, and
the results come back in the order of the requests, as from one engine. Requests of one group (a
multi-stage program's calls) go to one worker: its later calls find their prefix in that worker's
cache.

Workers (`engine/worker.py`) hand over their finished results every `WorkerSpec.relay_s` seconds,
so the caller's handover (the runner's result parts, and so a stop) and progress go on as with one
engine. A worker that fails raises here, naming it. Workers ignore SIGINT: Ctrl-C in a terminal
reaches the whole process group, and it is the parent that stops a run (`close` ends workers still
running).
"""
from __future__ import annotations

import multiprocessing as mp
import time
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any, Callable, Hashable, Sequence

from lmbatch.engine.worker import WorkerSpec, _counts, _pack, _serve
from lmbatch.errors import UserError
from lmbatch.requests import GenerateRequest, GenerateResult, RunStats, ScoreRequest, ScoreResult, TokenCounts
from lmbatch.scheduler.partition import partition
from lmbatch.scheduler.planner import posthoc_unique

if TYPE_CHECKING:
    from lmbatch.engine.engine import Handover
    from lmbatch.scheduler.planner import Plan


class ParallelEngine:
    """`n` engines in worker processes, used as one (`run`, `match_lens`, `kv_slots`, `cfg`). Each
    engine is `spec.tensor_parallel` processes (a tensor-parallel group, one device each)."""

    def __init__(self, spec: WorkerSpec, n: int, cfg: Any, gpus: Sequence[str] | None = None,
                 ray_address: str | None = None):
        """`gpus`: the CUDA_VISIBLE_DEVICES entry of each process (worker k's rank r: k * tp + r);
        `ray_address`: place the processes on that Ray cluster instead (engine/cluster.py)."""
        self.cfg, self.spec, self.data_parallel, self.tensor_parallel = cfg, spec, n, spec.tensor_parallel
        self.device = spec.device
        self.home: dict[Hashable, int] = {}       # group -> the worker that ran its earlier calls
        self.running = False
        self._prompts: list[list[list[int]]] = [[] for _ in range(n)]     # each worker's executed prompts
        self._generated: list[list[tuple[list[int], int]]] = [[] for _ in range(n)]  # and generations
        self.procs: list[Any] = []                 # local processes (none on Ray)
        self.cluster: Any = None
        if ray_address is not None:
            from lmbatch.engine.cluster import RayWorkers
            self.cluster = RayWorkers(ray_address, spec, n)
            groups = self.cluster.groups
        else:
            groups, self.procs = _launch(spec, n, gpus)
        self.conns = [g[0] for g in groups]               # rank 0 of each worker: requests and results
        self.side = [c for g in groups for c in g[1:]]    # the other ranks: only their errors
        self.names: dict[Any, str] = {}                   # a connection or process sentinel -> whose
        for k, g in enumerate(groups):
            for r, c in enumerate(g):
                name = f"data-parallel worker {k}" + (f" (tensor-parallel rank {r})" if len(g) > 1 else "")
                self.names[c] = name
                if self.procs:
                    self.names[self.procs[k * len(g) + r].sentinel] = name
        try:
            self.slots = [self._recv(c, "ready") for c in self.conns]
            for c in self.side:
                self._recv(c, "ready")
        except BaseException:
            self.close()
            raise

    @property
    def kv_slots(self) -> int:
        """Tokens the smallest worker's pool holds (what one request may take)."""
        return min(self.slots)

    def _recv(self, c: Connection, kind: str) -> Any:
        """The next message from `c`, which must be of `kind`; a worker's error or exit raises."""
        try:
            msg = c.recv()
        except (EOFError, OSError):
            msg = None
        if msg is None or msg[0] == "error":
            self._failed(c, msg)
        assert msg[0] == kind, msg[0]
        return msg[1] if len(msg) == 2 else msg[1:]

    def _failed(self, who: Any, msg: Any) -> None:
        name = self.names[who]
        if msg is not None:
            raise (UserError if msg[1] else RuntimeError)(f"{name}: {msg[2]}")
        proc = next((p for p in self.procs if self.names[p.sentinel] == name), None)
        if proc is None:
            raise RuntimeError(f"{name} closed its connection (it exited)")
        proc.join(5)
        raise RuntimeError(f"{name} exited (code {proc.exitcode})")

    def optimal_unique_tokens(self) -> int:
        """The fewest prompt tokens the workers had to compute, each over what it executed in every
        run so far (`planner.posthoc_unique` per worker: shared prefixes once per worker that needs
        them, text a worker generated free): the data-parallel counterpart of the run's optimum."""
        return sum(posthoc_unique(p, g) for p, g in zip(self._prompts, self._generated))

    def match_lens(self, seqs: list[list[int]]) -> list[int]:
        """Each sequence's longest cached prefix on any worker."""
        for c in self.conns:
            c.send(("match", seqs))
        got = [self._recv(c, "match") for c in self.conns]
        return [max(col) for col in zip(*got)] if seqs else []

    def run(self, requests: Sequence[Any], schedule: str = "dfs", seed: int = 0,
            progress: Callable[[int, RunStats], None] | None = None, plan: Plan | None = None,
            handover: Handover | None = None, groups: Sequence[Hashable] | None = None) -> tuple[list[Any], RunStats]:
        """As `Engine.run`, over the workers (`plan` is not used: each worker plans its part)."""
        t0 = time.perf_counter()
        part = partition([r.prompt for r in requests], len(self.conns), groups=groups,
                         pinned={g: self.home[g] for g in set(groups) if g in self.home} if groups else None,
                         mergeable=[isinstance(r, ScoreRequest) for r in requests])
        if groups is not None:
            for k, idx in enumerate(part.parts):
                self.home.update((groups[i], k) for i in idx)
        for k, idx in enumerate(part.parts):
            if idx:
                self.conns[k].send(("run", [_pack(requests[i]) for i in idx], schedule, seed))
        gather = _Gather(requests, part.parts, progress, handover)
        gather.stats.unique_tokens = sum(part.part_unique_tokens)
        gather.stats.optimal_hit_rate = gather.stats.engine_optimal_hit_rate = part.hit_rate
        t1 = time.perf_counter()
        self.running = True
        self._gather(gather, {k for k, idx in enumerate(part.parts) if idx})
        self.running = False
        gather.stats.plan_s, gather.stats.execute_s = t1 - t0, time.perf_counter() - t1
        for k, executed in enumerate(gather.executed):
            for j in executed:
                prompt, r = requests[j].prompt, gather.results[j]
                self._prompts[k].append(prompt)
                if isinstance(r, GenerateResult):
                    self._generated[k].append((prompt + r.token_ids[:-1], len(prompt)))
        return gather.results, gather.stats

    def _gather(self, gather: _Gather, busy: set[int]) -> None:
        """Take the workers' reports until each busy one is done; any worker's error or exit raises."""
        watch = list(self.side) + [p.sentinel for p in self.procs]
        while busy:
            ready = wait([self.conns[k] for k in busy] + watch)
            for k in [k for k in sorted(busy) if self.conns[k] in ready]:
                try:
                    msg = self.conns[k].recv()
                except (EOFError, OSError):
                    msg = None
                if msg is None or msg[0] == "error":
                    self._failed(self.conns[k], msg)
                elif msg[0] == "part":
                    gather.part(k, *msg[1:])
                else:
                    gather.done(k, msg[1], msg[2])
                    busy.discard(k)
            for who in [w for w in watch if w in ready]:
                if isinstance(who, Connection):
                    self._recv(who, "none")            # only an error comes from there
                elif not any(self.conns[k].poll() for k in busy):     # exited, its last words read
                    self._failed(who, None)

    def close(self) -> None:
        """End the workers: at once if a run was cut short (they are still working), else when they
        have read the close."""
        for c in self.conns:
            try:
                c.send(("close",))
            except OSError:
                pass
        for p in self.procs:
            p.join(0 if self.running else 10)
            if p.is_alive():
                p.terminate()
                p.join(5)
        if self.cluster is not None:
            self.cluster.close(at_once=self.running)


def _launch(spec: WorkerSpec, n: int, gpus: Sequence[str] | None) -> tuple[list[list[Connection]], list[Any]]:
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
            p = ctx.Process(target=_serve, args=(r, spec, child, gpus[k * t + r] if gpus else None, port),
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

    def __init__(self, requests: Sequence[Any], parts: list[list[int]],
                 progress: Callable[[int, RunStats], None] | None, handover: Handover | None):
        self.parts, self.progress, self.handover = parts, progress, handover
        self.results: list[Any] = [GenerateResult() if isinstance(r, GenerateRequest) else ScoreResult()
                                   for r in requests]
        self.stats = RunStats(requests=len(requests))
        self.counts = [TokenCounts() for _ in parts]
        self.handed = bytearray(len(requests))
        self.executed: list[list[int]] = [[] for _ in parts]     # each worker's executed requests

    def _merge(self, k: int, pairs: Sequence[tuple[int, Any]], members: dict[int, list[int]]) -> list[int]:
        idx, final = self.parts[k], []
        for i, r in pairs:
            self.results[idx[i]] = r
            final.append(idx[i])
        for j, ms in members.items():
            self.stats.members[idx[j]] = [idx[m] for m in ms]
            self.stats.order.append(idx[j])
            self.executed[k].append(idx[j])
        return final

    def _totals(self) -> None:
        s = self.stats
        s.prompt_tokens = sum(c.prompt_tokens for c in self.counts)
        s.cached_tokens = sum(c.cached_tokens for c in self.counts)
        s.computed_tokens = sum(c.computed_tokens for c in self.counts)
        s.decode_tokens = sum(c.decode_tokens for c in self.counts)

    def part(self, k: int, pairs: Sequence[tuple[int, Any]], members: dict[int, list[int]],
             counts: TokenCounts) -> None:
        """Worker k's results finished since its last report."""
        final = self._merge(k, pairs, members)
        self.counts[k] = counts
        self._totals()
        for g in final:
            self.handed[g] = 1
        if self.progress is not None and final:
            self.progress(final[-1], self.stats)
        if self.handover is not None and final:
            self.handover.take(final, self.results, self.stats)

    def done(self, k: int, results: list[Any], st: RunStats) -> None:
        """Worker k's run ended: the rest of its results and its counters."""
        idx = self.parts[k]
        pairs = [(i, results[i]) for i in range(len(idx)) if not self.handed[idx[i]]]
        members = {j: st.members[j] for j in st.order if idx[j] not in self.stats.members}
        self._merge(k, pairs, members)
        self.counts[k] = _counts(st)
        self._totals()
        s = self.stats
        s.executed += st.executed
        s.forward_batches += st.forward_batches
        s.evicted_tokens += st.evicted_tokens
        s.masked_rows += st.masked_rows
        s.resampled_rows += st.resampled_rows
        if self.progress is not None and idx:
            self.progress(idx[-1], s)
