"""A data-parallel worker process (or one rank of its tensor-parallel group): it builds its own
`Engine` and runs the batches its parent (`parallel.ParallelEngine`) sends, handing finished
results back as it goes. Rank 0 of a group reads the parent's messages and broadcasts them to the
other ranks, which run the same engine steps so that their collectives pair up.

Messages: parent -> worker ("run", packed requests, schedule, seed), ("match", sequences),
("close",); worker -> parent ("ready", KV slots), ("part", results, members, counts),
("done", results, stats), ("match", lengths), ("error", is_user_error, text).
"""
from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from typing import Any, Sequence

from lmbatch.errors import UserError
from lmbatch.requests import GenerateRequest, RunStats, ScoreRequest, TokenCounts

RELAY_S = 1.0           # a worker hands its finished results to the parent at least this often
RELAY_TICKS = 1024      # in a tensor-parallel group: every this many prefill adds and decode steps


@dataclass(frozen=True)
class WorkerSpec:
    """What each worker builds its engine from (sent to its process)."""
    model_dir: str
    device: str                     # "cpu" or "cuda"
    dtype: str
    kv_cache_tokens: int
    max_tokens_per_batch: int
    cache: bool = True
    jump_forward: bool = True
    vocab_size: int | None = None   # the model's (grammars are compiled against it)
    threads: int | None = None      # torch threads of a CPU worker
    relay_s: float = RELAY_S        # seconds between a worker's handovers of finished results
    tensor_parallel: int = 1        # ranks (devices) of each worker's model
    load_format: str = "auto"       # "dummy": random weights (speed work)


def _pack(r: ScoreRequest | GenerateRequest) -> tuple[Any, Any]:
    """A request as it crosses to a worker: a grammar goes as its source and the steps its matcher
    has accepted (text jump-forward put in the prompt), compiled and replayed there."""
    if isinstance(r, GenerateRequest) and r.constraint is not None:
        return replace(r, constraint=None), (r.constraint.spec, list(r.constraint.steps))
    return r, None


class _Relay:
    """A worker's handover: finished results go to the parent every `seconds`. In a tensor-parallel
    group every rank must flush its batches at the same points (their collectives pair up), so there
    it is due every `ticks` engine ticks instead, the same on each rank; only rank 0 sends."""

    def __init__(self, conn: Connection | None, seconds: float, ticks: int = 0):
        self.conn, self.seconds, self.ticks = conn, seconds, ticks
        self.next = time.monotonic() + seconds
        self.count = 0

    def due(self) -> bool:
        if self.ticks:
            self.count += 1
            return self.count % self.ticks == 0
        return time.monotonic() >= self.next

    def take(self, final: list[int], results: Sequence[Any], stats: RunStats) -> None:
        self.next = time.monotonic() + self.seconds
        if self.conn is not None:
            members = {j: stats.members[j] for j in final if j in stats.members}
            self.conn.send(("part", [(i, results[i]) for i in final], members, _counts(stats)))


def _counts(stats: RunStats) -> TokenCounts:
    return TokenCounts(stats.prompt_tokens, stats.cached_tokens, stats.computed_tokens, stats.decode_tokens)


def _serve(rank: int, spec: WorkerSpec, conn: Connection, gpu: str | None, port: int) -> None:
    """A worker process (`rank` of its tensor-parallel group): build the engine, then run what the
    parent sends (rank 0 reads it and passes it to the other ranks) until it says close."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    if gpu is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu          # before torch starts CUDA: this worker's device
    try:
        engine, tokenizer, ctrl = _build(rank, spec, port)
        conn.send(("ready", engine.kv_slots))
        grammars: Any = None
        while True:
            msg = conn.recv() if rank == 0 else None
            if msg is not None and msg[0] == "match":       # each rank's cache is the same: rank 0 answers
                conn.send(("match", engine.match_lens(msg[1])))
                continue
            if ctrl is not None:
                msg = _broadcast(msg, ctrl)
            assert msg is not None
            if msg[0] == "close":
                return
            _, packed, schedule, seed = msg
            if grammars is None and any(c is not None for _, c in packed):
                from lmbatch.grammar import GrammarCompiler
                grammars = GrammarCompiler(tokenizer, spec.vocab_size)
            requests = [r if c is None else replace(r, constraint=_rebuild(grammars, *c)) for r, c in packed]
            relay = _Relay(conn if rank == 0 else None, spec.relay_s, RELAY_TICKS if ctrl is not None else 0)
            results, stats = engine.run(requests, schedule=schedule, seed=seed, handover=relay)
            if rank == 0:
                conn.send(("done", results, stats))
    except BaseException as e:  # noqa: BLE001  the parent raises it, naming this worker
        try:
            conn.send(("error", isinstance(e, UserError), f"{type(e).__name__}: {e}"))
        except OSError:
            pass


def _build(rank: int, spec: WorkerSpec, port: int) -> tuple[Any, Any, Any]:
    """(engine, tokenizer, the group's control channel or None) of one worker process."""
    import torch

    from lmbatch.engine.engine import Engine, EngineOptions

    if spec.threads:
        torch.set_num_threads(spec.threads)
    tp, ctrl = None, None
    if spec.tensor_parallel > 1:
        import torch.distributed as dist

        from lmbatch.model.tensor_parallel import TensorParallel

        backend = "nccl" if spec.device == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=spec.tensor_parallel)
        ctrl = dist.new_group(backend="gloo") if backend == "nccl" else dist.group.WORLD
        tp = TensorParallel(rank, spec.tensor_parallel)
    from transformers import AutoTokenizer

    try:        # stop strings and grammars need it; a bare checkpoint (tests) runs without
        tokenizer = AutoTokenizer.from_pretrained(spec.model_dir)
    except (OSError, ValueError):
        tokenizer = None
    options = EngineOptions(kv_cache_tokens=spec.kv_cache_tokens, max_tokens_per_batch=spec.max_tokens_per_batch,
                            cache=spec.cache, jump_forward=spec.jump_forward)
    engine = Engine.from_pretrained(spec.model_dir, options, device=spec.device, dtype=getattr(torch, spec.dtype),
                                    tokenizer=tokenizer, tp=tp, load_format=spec.load_format)
    engine.warm_up()
    return engine, tokenizer, ctrl


def _broadcast(msg: Any, group: Any) -> Any:
    """Rank 0's message, on every rank of its tensor-parallel group."""
    import torch.distributed as dist

    box = [msg]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def _rebuild(grammars: Any, spec: tuple[str, Any], steps: list[int | str]) -> Any:
    """A constraint in the state its parent's was in."""
    c = grammars.constraint(**{spec[0]: spec[1]})
    for step in steps:
        ok = c.accept(step) if isinstance(step, int) else c.accept_string(step)
        assert ok, f"replaying {step!r} of a {spec[0]} constraint"
    return c
