"""The worker processes behind a data-parallel engine (`parallel.ParallelEngine`): started with the engine
(`spawn`: a fresh interpreter each, `worker.serve`; or placed on a Ray cluster, engine/cluster.py), each
fitting and building its own engine; what is said to each (a message to worker k), a worker's failure or
exit raised as `WorkerFailed` naming it, a `worker.Remote` work run on each (`spread`), and their end.
Workers ignore SIGINT: Ctrl-C in a terminal reaches the whole process group, and it is the parent that stops
a run (`close` ends workers still running)."""
from __future__ import annotations

import multiprocessing as mp
from dataclasses import replace
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any, Iterator, Sequence

from lmbatch.engine.worker import Close, Compressed, Failed, Finished, Matched, MatchQuery, Ready, serve
from lmbatch.errors import UserError, WorkerFailed

if TYPE_CHECKING:
    import torch

    from lmbatch.engine.build import Attention
    from lmbatch.engine.options import EngineSpec
    from lmbatch.model.config import ModelConfig


class Workers:
    """`spec.workers` workers of `spec.ranks` processes each, started now; ready once built."""

    def __init__(self, spec: EngineSpec, cfg: ModelConfig, gpus: Sequence[str] | None = None):
        """`gpus`: the CUDA_VISIBLE_DEVICES entry of each process (worker k's rank r: k * tp + r);
        `spec.ray_address`: the processes are placed on that Ray cluster instead (engine/cluster.py)."""
        n = spec.workers
        self.cfg, self.data_parallel, self.tensor_parallel = cfg, n, spec.ranks
        self.running = False
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
    def match_lens(self, seqs: list[list[int]]) -> list[int]:
        """Each sequence's longest cached prefix on any worker."""
        for c in self.conns:
            c.send(MatchQuery(seqs))
        got = [self._recv(c, Matched).lengths for c in self.conns]
        return [max(col) for col in zip(*got)] if seqs else []
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
