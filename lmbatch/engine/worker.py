"""A data-parallel worker process (or one rank of its tensor-parallel group): it fits and builds its own
`Engine` from the run's `EngineSpec` (its device, its free memory) and runs the chunks of each batch its
parent (`parallel.ParallelEngine`) sends, handing finished results back as it goes. Rank 0 of a group
reads the parent's messages and broadcasts them to the other ranks, which run the same engine steps so
that their collectives pair up.

A chunk crosses as its requests in sorted (DFS) order with each one's tokens past what it shares with
the one before (`chunk_message`): the radix tree's edges, not every prompt whole, and the common prefixes
that give the worker its plan without sorting or comparing anything. A worker alone on its model reads
and plans its next chunk on a thread while it runs the one before.

The parent may send instead a `Remote` work (a worker's share of a run's programs, run/spread.py): the worker
calls its `run_on` with its engine, which sends what it likes; then `Finished` with what `run_on` returned.

The messages, one dataclass each: the parent sends `RunChunk` (`Compressed` to a worker Ray placed),
`MatchQuery`, a `Remote` work and `Close`; a worker answers `Ready` once built, `Part`s and then `Done`
for a chunk, `Matched` for a query, `Finished` for a remote work, and `Failed` for any error (a user's or not).
"""
from __future__ import annotations

import gc
import os
import pickle
import queue
import signal
import threading
import time
import zlib
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Protocol, Sequence, Union, cast, runtime_checkable

from lmbatch.engine.driver import start_early
from lmbatch.engine.protocol import Request, Result
from lmbatch.errors import UserError
from lmbatch.requests import GenerateRequest, RunStats, ScoreRequest, TokenCounts

if TYPE_CHECKING:
    from lmbatch.engine.build import Attention
    from lmbatch.engine.engine import Engine
    from lmbatch.engine.options import EngineSpec
    from lmbatch.engine.precompile import Precompile
    from lmbatch.scheduler.partition import Chunk
    from lmbatch.scheduler.planner import Plan
    from lmbatch.timing import Phases

RELAY_TICKS = 1024      # in a tensor-parallel group: hand over every this many prefill adds and decode steps

# what a request is besides its tokens, as it crosses: a score request's continuation, or a generation's
# sampling parameters and grammar, (kind, source) and the steps its matcher has accepted, or None
Kind = Union[list[int], tuple[Any, Union[tuple[tuple[str, Any], list[Union[int, str]]], None]]]


# ---- parent -> worker --------------------------------------------------------------------------
@dataclass(frozen=True)
class RunChunk:
    chunk: int                  # its number in the batch (the parent's)
    shared: list[int]           # each request's context (a score's) or prompt: tokens shared with the one before's
    tails: list[list[int]]      # and its tokens past those
    kinds: list[Kind]
    lcps: list[int]             # the prompts' adjacent common prefixes: they come in sorted order
    schedule: str
    seed: int


@dataclass(frozen=True)
class Compressed:
    """A message pickled and compressed (to a worker placed by Ray, over the network)."""
    data: bytes

    @staticmethod
    def of(msg: Any) -> Compressed:
        return Compressed(zlib.compress(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL), 1))

    def open(self) -> Any:
        return pickle.loads(zlib.decompress(self.data))


@dataclass(frozen=True)
class MatchQuery:
    seqs: list[list[int]]


@dataclass(frozen=True)
class Close:
    pass


@runtime_checkable
class Remote(Protocol):
    """Work the parent hands a worker alone on its model (no tensor-parallel group), run by the worker
    with its engine: `send` gives the parent messages of its own as it goes, `due()` says when a handover
    is due; what it returns goes to the parent in `Finished`."""

    def run_on(self, engine: Engine, send: Callable[[Any], None], due: Callable[[], bool]) -> Any: ...


# ---- worker -> parent --------------------------------------------------------------------------
@dataclass(frozen=True)
class Hello:
    """A rank placed by Ray says who it is as it connects (engine/cluster.py)."""
    worker: int
    rank: int


@dataclass(frozen=True)
class Ready:
    kv_slots: int
    spec: EngineSpec            # as this worker fitted it: device, dtype, sizes, backend
    attention: Attention
    seconds: dict[str, float]   # its start by step: startup, imports, cuda_init, weights, compile, graphs


@dataclass(frozen=True)
class Part:
    """Results of a chunk final since the worker's last part: (index in the chunk, result) pairs, the
    executed requests among them with those each served, and the chunk's counts so far."""
    chunk: int
    results: list[tuple[int, Result]]
    members: dict[int, list[int]]
    counts: TokenCounts


@dataclass(frozen=True)
class Done:
    chunk: int
    results: list[Result]
    stats: RunStats
    busy_s: float               # from the chunk's start to its end on the worker


@dataclass(frozen=True)
class Matched:
    lengths: list[int]


@dataclass(frozen=True)
class Finished:
    """A `Remote` work ended: what its `run_on` returned."""
    payload: Any


@dataclass(frozen=True)
class Failed:
    user_error: bool
    text: str


def chunk_message(requests: Sequence[Request], chunk: Chunk, number: int, schedule: str, seed: int) -> RunChunk:
    """A chunk as it crosses: each request's context or prompt as the tokens past what it shares with
    the one before's (at least the common prefix of their prompts, which both begin with), and the rest."""
    shared, tails, kinds = [], [], []
    prev: list[int] = []
    for i, lcp in zip(chunk.requests, chunk.lcps):
        r = requests[i]
        base = r.context if isinstance(r, ScoreRequest) else r.prompt
        c = min(lcp, len(base), len(prev))
        shared.append(c)
        tails.append(base[c:])
        kinds.append(r.continuation if isinstance(r, ScoreRequest) else _generation(r))
        prev = base
    return RunChunk(number, shared, tails, kinds, list(chunk.lcps), schedule, seed)


def _generation(r: GenerateRequest) -> Kind:
    """A grammar goes as its source and the steps its matcher has accepted (text jump-forward put in the
    prompt), compiled and replayed in the worker."""
    if r.constraint is None:
        return r.params, None
    return r.params, (cast("tuple[str, Any]", r.constraint.spec), list(r.constraint.steps))


def counts(stats: RunStats) -> TokenCounts:
    return TokenCounts(stats.prompt_tokens, stats.cached_tokens, stats.computed_tokens, stats.decode_tokens)


class _Relay:
    """When a worker hands its finished results to the parent: every `seconds`. In a tensor-parallel
    group every rank must flush its batches at the same points (their collectives pair up), so there
    it is every `ticks` engine ticks instead, the same on each rank."""

    def __init__(self, seconds: float, ticks: int = 0):
        self.seconds, self.ticks = seconds, ticks
        self.next = time.monotonic() + seconds
        self.count = 0

    def __call__(self) -> bool:
        if self.ticks:
            self.count += 1
            return self.count % self.ticks == 0
        if time.monotonic() < self.next:
            return False
        self.next = time.monotonic() + self.seconds
        return True


class Job(NamedTuple):
    """A chunk read and planned, ready to run."""
    chunk: int
    requests: list[Request]
    plan: Plan
    schedule: str
    seed: int


class _Prepare:
    """A chunk's requests rebuilt (grammars compiled and replayed: the compiler made at the first that
    has one) and planned: from its sorted order as it came, under the dfs schedule."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.grammars: Any = None

    def __call__(self, msg: RunChunk) -> Job:
        from lmbatch.scheduler.planner import plan_requests

        requests: list[Request] = []
        base: list[int] = []
        for c, tail, kind in zip(msg.shared, msg.tails, msg.kinds):
            base = base[:c] + tail
            if isinstance(kind, list):
                requests.append(ScoreRequest(base, kind))
            else:
                params, grammar = kind
                requests.append(GenerateRequest(base, params, None if grammar is None else self._grammar(*grammar)))
        plan = plan_requests(requests, msg.schedule, msg.seed, presorted=msg.lcps if msg.schedule == "dfs" else None)
        return Job(msg.chunk, requests, plan, msg.schedule, msg.seed)

    def _grammar(self, spec: tuple[str, Any], steps: Sequence[int | str]) -> Any:
        """A constraint in the state its parent's was in."""
        if self.grammars is None:
            from lmbatch.grammar import GrammarCompiler
            from lmbatch.model.tokenizer import real_tokenizer
            self.grammars = GrammarCompiler(real_tokenizer(self.engine.tokenizer), self.engine.cfg.vocab_size)
        c = self.grammars.constraint(**{spec[0]: spec[1]})
        for step in steps:
            ok = c.accept(step) if isinstance(step, int) else c.accept_string(step)
            assert ok, f"replaying {step!r} of a {spec[0]} constraint"
        return c


class _Inbox:
    """Rank 0's messages, read on a thread of their own; a chunk is prepared there too where `prepare`
    is given (a worker alone on its model), so it is ready when the chunk before it ends."""

    def __init__(self, conn: Connection, prepare: _Prepare | None):
        self.conn, self.prepare = conn, prepare
        self.box: queue.Queue[Any] = queue.Queue()
        threading.Thread(target=self._read, name="lmbatch-worker-inbox", daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                msg = self.conn.recv()
                if isinstance(msg, Compressed):
                    msg = msg.open()
                if isinstance(msg, RunChunk) and self.prepare is not None:
                    msg = self.prepare(msg)
            except (EOFError, OSError):
                self.box.put(Close())       # the parent is gone
                return
            except BaseException as e:  # noqa: BLE001  raised on the worker's main thread
                self.box.put(e)
                return
            self.box.put(msg)
            if isinstance(msg, Close):
                return

    def get(self) -> Any:
        msg = self.box.get()
        if isinstance(msg, BaseException):
            raise msg
        return msg


def serve(rank: int, spec: EngineSpec, conn: Connection, gpu: str | None, port: int, worker: int = 0) -> None:
    """A worker process (`rank` of its tensor-parallel group, of data-parallel `worker`): build the engine,
    then run what the parent sends (rank 0 reads it and passes it to the other ranks) until it says close."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    if gpu is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu          # before torch starts CUDA: this worker's device
    try:
        engine, ctrl, ready = _build(rank, spec, port, worker)
        gc.freeze()         # the model's objects: never scanned again by the collector as chunks come and go
        conn.send(ready)
        prepare = _Prepare(engine)
        inbox = _Inbox(conn, prepare if ctrl is None else None) if rank == 0 else None
        relay_ticks = RELAY_TICKS if ctrl is not None else 0
        while True:
            msg = inbox.get() if inbox is not None else None
            if isinstance(msg, MatchQuery):       # each rank's cache is the same: rank 0 answers
                conn.send(Matched(engine.match_lens(msg.seqs)))
                continue
            if ctrl is not None:
                msg = _broadcast(msg, ctrl)
            if isinstance(msg, Close):
                return
            if isinstance(msg, Remote):
                if ctrl is not None:
                    raise RuntimeError("remote work needs a worker alone on its model")
                conn.send(Finished(msg.run_on(engine, conn.send, _Relay(spec.relay_s))))
                continue
            job = prepare(msg) if isinstance(msg, RunChunk) else msg
            assert isinstance(job, Job), msg
            _run(engine, job, conn if rank == 0 else None, _Relay(spec.relay_s, relay_ticks))
    except BaseException as e:  # noqa: BLE001  the parent raises it, naming this worker
        try:
            conn.send(Failed(isinstance(e, UserError), f"{type(e).__name__}: {e}"))
        except OSError:
            pass


def _run(engine: Engine, job: Job, conn: Connection | None, due: _Relay) -> None:
    """One chunk on the engine; rank 0 (`conn`) hands its results over as they become final."""
    t = time.perf_counter()
    for h in engine.stream(job.requests, schedule=job.schedule, seed=job.seed, plan=job.plan, handover_due=due):
        if conn is None:
            continue
        if h.last:
            conn.send(Done(job.chunk, list(h.results), h.stats, time.perf_counter() - t))
        else:
            members = {j: h.stats.members[j] for j in h.final if j in h.stats.members}
            conn.send(Part(job.chunk, [(i, h.results[i]) for i in h.final], members, counts(h.stats)))


def _build(rank: int, spec: EngineSpec, port: int, worker: int) -> tuple[Engine, Any, Ready]:
    """(engine, the group's control channel or None, what the worker tells its parent) of one process. Only the
    first worker starts helpers (engine/precompile.py): every worker's kernels are the same, in one cache."""
    from lmbatch.engine import precompile
    from lmbatch.timing import Phases

    clock = Phases()        # from the process's start: "startup" is the interpreter and lmbatch's modules
    helpers = precompile.Precompile(spec, precompile.helpers(1)) \
        if worker == 0 and spec.ranks == 1 and precompile.wanted(spec, spec.graphs_ahead) else None   # importing torch
    try:
        return _build_engine(rank, spec, port, clock, helpers)
    finally:
        if helpers is not None:
            helpers.close()


def _build_engine(rank: int, spec: EngineSpec, port: int, clock: Phases,
                  helpers: Precompile | None) -> tuple[Engine, Any, Ready]:
    """`_build`'s engine, timed by `clock`; `helpers` (or None) told of the fitted spec."""
    started = start_early(spec.device)       # CUDA's driver beside the imports
    with clock("imports"):
        import torch

        from lmbatch.engine.build import build_engine, fit, start_cuda
        from lmbatch.model.checkpoint import model_config
        from lmbatch.model.tokenizer import LazyTokenizer
        cfg = model_config(spec.model_dir)
    tp, ctrl = None, None
    with clock("cuda_init"):
        started()
        fitted, attention = fit(spec, cfg)
        if fitted.device == "cpu":
            torch.set_num_threads(spec.threads or spec.options.threads
                                  or max(1, (os.cpu_count() or 1) // (spec.workers * spec.ranks)))
        start_cuda(fitted.device)
        if spec.ranks > 1:
            import torch.distributed as dist

            from lmbatch.model.tensor_parallel import TensorParallel

            backend = "nccl" if fitted.device == "cuda" else "gloo"
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=spec.ranks)
            ctrl = dist.new_group(backend="gloo") if backend == "nccl" else dist.group.WORLD
            tp = TensorParallel(rank, spec.ranks)
            fitted = _agree(fitted, ctrl)
    if helpers is not None:
        with clock("helpers"):
            helpers.go(fitted, cfg)
    engine = build_engine(fitted, LazyTokenizer.of(spec.model_dir), clock, tp=tp)
    if helpers is not None and fitted.graphs_ahead:
        helpers.captured()
    return engine, ctrl, Ready(engine.kv_slots, fitted, attention, dict(clock.seconds))


def _agree(spec: EngineSpec, group: Any) -> EngineSpec:
    """The sizes every rank of a tensor-parallel group can hold (the least each fitted): their batches
    and evictions must fall at the same steps."""
    import torch
    import torch.distributed as dist

    o = spec.options
    assert o.kv_cache_tokens is not None and o.max_tokens_per_batch is not None, "fit the spec first"
    sizes = torch.tensor([o.kv_cache_tokens, o.max_tokens_per_batch], dtype=torch.int64)
    dist.all_reduce(sizes, op=dist.ReduceOp.MIN, group=group)
    return replace(spec, options=replace(o, kv_cache_tokens=int(sizes[0]), max_tokens_per_batch=int(sizes[1])))


def _broadcast(msg: Any, group: Any) -> Any:
    """Rank 0's message, on every rank of its tensor-parallel group."""
    import torch.distributed as dist

    box = [msg]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]
