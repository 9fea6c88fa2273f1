"""A data-parallel worker process (or one rank of its tensor-parallel group): it builds its own
`Engine` from the run's `EngineSpec` and runs the batches its parent (`parallel.ParallelEngine`)
sends, handing finished results back as it goes. Rank 0 of a group reads the parent's messages and
broadcasts them to the other ranks, which run the same engine steps so that their collectives pair up.

The messages, one dataclass each: the parent sends `RunBatch`, `MatchQuery` and `Close`; a worker
answers `Ready` once built, `Part`s and then `Done` for a batch, `Matched` for a query, and `Failed`
for any error (a user's or not).
"""
from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, Sequence, Union, cast

from lmbatch.engine.protocol import Request, Result
from lmbatch.errors import UserError
from lmbatch.requests import GenerateRequest, RunStats, TokenCounts

if TYPE_CHECKING:
    from lmbatch.engine.engine import Engine
    from lmbatch.engine.options import EngineSpec

RELAY_TICKS = 1024      # in a tensor-parallel group: hand over every this many prefill adds and decode steps

# a request as it crosses to a worker, and the grammar it carries: (kind, source) and the steps its
# matcher has accepted, or None (see `pack`)
Packed = tuple[Request, Union[tuple[tuple[str, Any], list[Union[int, str]]], None]]


# ---- parent -> worker --------------------------------------------------------------------------
@dataclass(frozen=True)
class RunBatch:
    requests: list[Packed]
    schedule: str
    seed: int


@dataclass(frozen=True)
class MatchQuery:
    seqs: list[list[int]]


@dataclass(frozen=True)
class Close:
    pass


# ---- worker -> parent --------------------------------------------------------------------------
@dataclass(frozen=True)
class Hello:
    """A rank placed by Ray says who it is as it connects (engine/cluster.py)."""
    worker: int
    rank: int


@dataclass(frozen=True)
class Ready:
    kv_slots: int


@dataclass(frozen=True)
class Part:
    """Results final since the worker's last part: (index in the batch, result) pairs, the executed
    requests among them with those each served, and the worker's counts so far."""
    results: list[tuple[int, Result]]
    members: dict[int, list[int]]
    counts: TokenCounts


@dataclass(frozen=True)
class Done:
    results: list[Result]
    stats: RunStats


@dataclass(frozen=True)
class Matched:
    lengths: list[int]


@dataclass(frozen=True)
class Failed:
    user_error: bool
    text: str


def pack(r: Request) -> Packed:
    """A request as it crosses to a worker: a grammar goes as its source and the steps its matcher
    has accepted (text jump-forward put in the prompt), compiled and replayed there."""
    if isinstance(r, GenerateRequest) and r.constraint is not None:
        return replace(r, constraint=None), (cast("tuple[str, Any]", r.constraint.spec), list(r.constraint.steps))
    return r, None


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


def serve(rank: int, spec: EngineSpec, conn: Connection, gpu: str | None, port: int) -> None:
    """A worker process (`rank` of its tensor-parallel group): build the engine, then run what the
    parent sends (rank 0 reads it and passes it to the other ranks) until it says close."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    if gpu is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu          # before torch starts CUDA: this worker's device
    try:
        engine, ctrl = _build(rank, spec, port)
        conn.send(Ready(engine.kv_slots))
        grammars: Any = None
        while True:
            msg = conn.recv() if rank == 0 else None
            if isinstance(msg, MatchQuery):       # each rank's cache is the same: rank 0 answers
                conn.send(Matched(engine.match_lens(msg.seqs)))
                continue
            if ctrl is not None:
                msg = _broadcast(msg, ctrl)
            if isinstance(msg, Close):
                return
            assert isinstance(msg, RunBatch), msg
            if grammars is None and any(c is not None for _, c in msg.requests):
                from lmbatch.grammar import GrammarCompiler
                from lmbatch.model.tokenizer import real_tokenizer
                grammars = GrammarCompiler(real_tokenizer(engine.tokenizer), engine.cfg.vocab_size)
            requests = [r if c is None else replace(r, constraint=_rebuild(grammars, *c)) for r, c in msg.requests]
            due = _Relay(spec.relay_s, RELAY_TICKS if ctrl is not None else 0)
            for h in engine.stream(requests, schedule=msg.schedule, seed=msg.seed, handover_due=due):
                if rank != 0:
                    continue
                if h.last:
                    conn.send(Done(list(h.results), h.stats))
                else:
                    members = {j: h.stats.members[j] for j in h.final if j in h.stats.members}
                    conn.send(Part([(i, h.results[i]) for i in h.final], members, counts(h.stats)))
    except BaseException as e:  # noqa: BLE001  the parent raises it, naming this worker
        try:
            conn.send(Failed(isinstance(e, UserError), f"{type(e).__name__}: {e}"))
        except OSError:
            pass


def _build(rank: int, spec: EngineSpec, port: int) -> tuple[Engine, Any]:
    """(engine, the group's control channel or None) of one worker process."""
    import torch

    from lmbatch.engine.engine import Engine
    from lmbatch.model.tokenizer import LazyTokenizer

    procs = spec.workers * spec.tensor_parallel
    if spec.device == "cpu":
        torch.set_num_threads(spec.threads or max(1, (os.cpu_count() or 1) // procs))
    tp, ctrl = None, None
    if spec.tensor_parallel > 1:
        import torch.distributed as dist

        from lmbatch.model.tensor_parallel import TensorParallel

        backend = "nccl" if spec.device == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=spec.tensor_parallel)
        ctrl = dist.new_group(backend="gloo") if backend == "nccl" else dist.group.WORLD
        tp = TensorParallel(rank, spec.tensor_parallel)
    assert spec.dtype is not None, "the parent fits the spec"
    engine = Engine.from_pretrained(spec.model_dir, spec.options, device=spec.device, dtype=getattr(torch, spec.dtype),
                                    tokenizer=LazyTokenizer.of(spec.model_dir), tp=tp, load_format=spec.load_format)
    engine.warm_up(graphs=spec.graphs_ahead)
    return engine, ctrl


def _broadcast(msg: Any, group: Any) -> Any:
    """Rank 0's message, on every rank of its tensor-parallel group."""
    import torch.distributed as dist

    box = [msg]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def _rebuild(grammars: Any, spec: tuple[str, Any], steps: Sequence[int | str]) -> Any:
    """A constraint in the state its parent's was in."""
    c = grammars.constraint(**{spec[0]: spec[1]})
    for step in steps:
        ok = c.accept(step) if isinstance(step, int) else c.accept_string(step)
        assert ok, f"replaying {step!r} of a {spec[0]} constraint"
    return c
