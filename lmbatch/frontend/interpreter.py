"""Runs a whole batch of LM programs on the engine, in waves.

Every program runs in its own greenlet until it waits for a model result. The calls queued by all
waiting programs form a wave, executed as one engine batch (planned as a radix tree, in DFS order).
The first wave holds the first-stage calls of every instance, so the offline tree covers them all.
Later calls depend on generated text; they join the next wave once their program has them, picked
by longest cached prefix in the live tree (SGLang's online approximation of DFS), with the new
tokens of a wave's generation calls capped so that what they leave in the cache is still there when
their programs' next calls arrive. Score calls (select) always join: they leave nothing behind.

With `checkpoints`, results are also handed over while a wave runs (at least every wave, and when
`checkpoints.due()` says so): the calls whose results are all final are resolved, their programs
resumed, and the programs that finished are given to `checkpoints.save` (the runner's result parts).
"""
from __future__ import annotations

import operator
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence, cast

import greenlet

from lmbatch.errors import UserError
from lmbatch.frontend.calls import CallPreparer, EngineRequest, call_tokens, engine_requests, resolve
from lmbatch.frontend.dsl import Pending, Select, State
from lmbatch.frontend.runs import ProgramRun
from lmbatch.frontend.tally import StageCounts, Tally
from lmbatch.frontend.tokenize import TextEncoder
from lmbatch.frontend.waves import WaveBudget, pick_wave
from lmbatch.frontend.workload import Instance
from lmbatch.requests import GenerateResult, RunStats, ScoreResult
from lmbatch.scheduler.planner import Plan, plan_requests

if TYPE_CHECKING:      # the engine (and torch) load on the runner's model thread, not here
    from lmbatch.engine import Engine
    from lmbatch.grammar import GrammarCompiler
    from lmbatch.progress import TokenProgress

__all__ = ["Checkpoints", "Interpreter", "ProgramRun", "StageCounts"]


class Checkpoints(Protocol):
    """Where finished programs go while a run executes (the runner's result parts)."""

    def due(self) -> bool:
        """Whether to hand results over now (time since the last save, or a stop was asked for)."""
        ...

    def save(self, runs: list[ProgramRun]) -> None:
        """Keep these finished programs (each given once); may raise to stop the run."""
        ...


@dataclass
class _Wave:
    """A wave's engine requests while it runs: the call of each, which are handed over already."""
    requests: list[EngineRequest]
    owner: list[Pending]
    first: dict[int, int]           # id(call) -> its first request
    left: dict[int, int]            # id(call) -> its requests not handed over yet
    rank: dict[int, int]            # ProgramRun.index -> its first call's place in the wave
    handed: bytearray


class Interpreter:
    def __init__(self, tokenizer: TextEncoder | Any, *, max_len: int, schedule: str = "dfs", seed: int = 0,
                 truncate_left: bool = False, progress: TokenProgress | None = None,
                 vocab_size: int | None = None, jump_forward: bool = True, grammar_cache: bool = True,
                 think_budget: int | None = None, think_end: str | None = None):
        # a TextEncoder, or a transformers fast tokenizer it is made from
        self.encoder = tokenizer if isinstance(tokenizer, TextEncoder) else TextEncoder.from_hf(tokenizer)
        self.max_len = max_len
        self.preparer = CallPreparer(self.encoder, max_len=max_len, truncate_left=truncate_left,
                                     vocab_size=vocab_size, jump_forward=jump_forward, grammar_cache=grammar_cache,
                                     think_budget=think_budget, think_end=think_end)
        self.schedule, self.seed, self.progress = schedule, seed, progress
        self.engine: Engine | None = None
        self._ahead: tuple[list[Pending], Plan] | None = None     # the first wave, planned ahead
        self.runs: list[ProgramRun] = []
        self.ready: list[Pending] = []
        self.hub = greenlet.getcurrent()
        self.tally = Tally()
        self.max_final_footprint = 0   # largest cache footprint of a finished program
        self.waves = 0
        self.checkpoints: Checkpoints | None = None
        self._unsaved: list[ProgramRun] = []     # finished programs not given to checkpoints yet
        self._wave: _Wave | None = None

    # ---- what the runner, tests and benchmarks read -----------------------------------------
    @property
    def stats(self) -> RunStats:
        return self.tally.stats

    @property
    def stages(self) -> dict[int, StageCounts]:
        return self.tally.stages

    @property
    def prompt_tree_optimal_hit_rate(self) -> float:
        return self.tally.prompt_tree_optimal_hit_rate

    @property
    def grammars(self) -> GrammarCompiler | None:
        return self.preparer.grammars

    @property
    def truncated(self) -> int:
        return self.preparer.truncated

    @property
    def tokenize_s(self) -> float:
        return self.preparer.tokenize_s

    # ---- the run --------------------------------------------------------------------------
    def start(self, program: Callable, instances: list[Instance],
              numbers: Sequence[int] | None = None) -> list[ProgramRun]:
        """Run every program up to its first wait (no model work): the first-stage calls are queued.
        `numbers`: each instance's position in its task (default: its position here)."""
        self.runs = [ProgramRun(k, inst, self, number=k if numbers is None else numbers[k])
                     for k, inst in enumerate(instances)]
        for run in self.runs:
            self._start(run, program)
            if run.user_error is not None:
                raise run.user_error
            if run.error is not None:
                raise UserError(f"program failed on instance {run.instance.id}: {run.error}")
        self.preparer.prepare(self.ready, self._fail)
        return self.runs

    def execute(self, engine: Engine, wave_tokens: int | None = None) -> list[ProgramRun]:
        """Run waves until every program has finished."""
        t0, tokenized, planned = time.perf_counter(), self.tokenize_s, self.stats.plan_s
        self.engine = engine
        self.wave_tokens = wave_tokens or engine.kv_slots * engine.data_parallel * 3 // 4
        self._save()                # programs that finished before any model work
        while self.ready:
            self._execute(self._pick_wave())
        for run in self.runs:       # every program ends in the output, whatever it left unread
            if not run.complete:
                run.complete = True
                self._unsaved.append(run)
        self._save()
        # planning and tokenizing done in here are their own phases (the first wave's plan, made ahead
        # while the model loaded, is not in here: subtracting it made a fast run's execute negative)
        self.stats.execute_s = (time.perf_counter() - t0 - (self.stats.plan_s - planned)
                                - (self.tokenize_s - tokenized))
        t1 = time.perf_counter()
        self.tally.finish()
        self.stats.plan_s += time.perf_counter() - t1
        return self.runs

    def longest_ready(self) -> int:
        """Tokens the longest queued call needs (prompt + new tokens, or context + longest choice)."""
        return max((call_tokens(p) for p in self.ready), default=1)

    def _start(self, run: ProgramRun, program: Callable) -> None:
        run.state = State(run)

        def body():
            try:
                program(run.state, **run.instance.inputs)
            except UserError as e:  # a call that cannot run (e.g. too long): named with its instance
                run.error, run.user_error = str(e), e
            except Exception as e:  # a program's own bug: kept with its instance
                run.error = f"{type(e).__name__}: {e}"
            self._done(run)
        run.glet = greenlet.greenlet(body, parent=self.hub)
        run.glet.switch()

    def _resume(self, run: ProgramRun) -> None:
        if not run.finished and all(p.done for p in run.calls):
            cast(greenlet.greenlet, run.glet).switch()     # not finished: it has a greenlet

    def _done(self, run: ProgramRun) -> None:
        self.max_final_footprint = max(self.max_final_footprint, run.footprint)
        self._if_complete(run)

    def _if_complete(self, run: ProgramRun) -> None:
        """A program is complete when it has returned and every call it made has its result (a
        program may return without reading its last calls)."""
        if not run.complete and run.finished and all(p.done for p in run.calls):
            run.complete = True
            self._unsaved.append(run)

    def _save(self) -> None:
        """Give the complete programs to `checkpoints` (also none: it may stop the run)."""
        if self.checkpoints is not None:
            runs, self._unsaved = self._unsaved, []
            self.checkpoints.save(runs)

    def _fail(self, p: Pending, message: str) -> None:
        """Before any model work a failing call stops the run; later it ends its own program."""
        run = self.runs[p.owner.index]
        if self.engine is None:
            raise UserError(message if message.startswith("instance ") else
                            f"instance {run.instance.id}: {message}")
        run.calls.remove(p)
        p.done, p.meta["error"] = True, message       # an empty result: nothing waits on it forever
        run.error = run.error or message
        if not run.finished:
            cast(greenlet.greenlet, run.glet).throw(UserError(message))
        self._if_complete(run)      # a program that returned before this call could run

    # ---- waves ----------------------------------------------------------------------------
    def _pick_wave(self) -> list[Pending]:
        """The next wave (see `waves`) from the queued calls, prepared first; the rest stay queued."""
        self.preparer.prepare([p for p in self.ready if p.ids is None], self._fail)
        engine = cast("Engine", self.engine)     # set by execute(), the only caller
        for p in [p for p in self.ready if p.ids is not None and call_tokens(p) > engine.kv_slots]:
            n, p.ids = call_tokens(p), None     # a later stage's (the runner sized the pool for the first)
            kind = "select" if isinstance(p.op, Select) else "gen"
            self._fail(p, f"instance {p.owner.instance.id}: {kind} {p.op.name!r} needs {n} tokens, more than the "
                          f"KV pool holds ({engine.kv_slots}): raise --kv-cache-tokens")
        ready = [p for p in self.ready if p.ids is not None]
        budget = WaveBudget(self.wave_tokens, self.max_final_footprint)
        wave, self.ready = pick_wave(ready, self.runs, engine.match_lens, budget, self.schedule,
                                     self.seed + self.waves)
        for p in wave:
            p.owner.started = True
        return wave

    def first_requests(self) -> list[EngineRequest]:
        """The engine requests of every queued call (after `start`: the whole first stage), as the
        first wave would run them if it held them all: what a dry run plans."""
        return engine_requests(self.ready, self.seed)[0]

    def plan_ahead(self) -> None:
        """Plan the first wave before the model is there (the runner calls this while it loads), when
        that wave is known without the engine: every queued call a select (a wave of generation
        calls depends on the engine's cache and pool)."""
        if self.waves or not self.ready or not all(isinstance(p.op, Select) for p in self.ready):
            return
        t = time.perf_counter()
        requests = engine_requests(self.ready, self.seed)[0]
        self._ahead = (list(self.ready), plan_requests(requests, self.schedule, self.seed))
        self.stats.plan_s += time.perf_counter() - t

    def _execute(self, wave: list[Pending]) -> None:
        requests, owner = engine_requests(wave, self.seed)
        for p in wave:
            p.constraint = None         # its request holds it now
        ahead, self._ahead = self._ahead, None
        same = ahead is not None and len(ahead[0]) == len(wave) and all(map(operator.is_, ahead[0], wave))
        plan = ahead[1] if ahead is not None and same else None
        first: dict[int, int] = {}
        left: dict[int, int] = {}
        for k, p in enumerate(owner):
            first.setdefault(id(p), k)
            left[id(p)] = left.get(id(p), 0) + 1
        rank: dict[int, int] = {}
        for p in wave:
            rank.setdefault(p.owner.index, len(rank))
        self._wave = _Wave(requests, owner, first, left, rank, bytearray(len(requests)))
        self.tally.start_wave(owner)
        engine = cast("Engine", self.engine)     # set by execute(), the only caller
        results, st = engine.run(requests, schedule=self.schedule, seed=self.seed + self.waves, plan=plan,
                                 progress=self.progress, handover=self if self.checkpoints is not None else None,
                                 groups=[p.owner.index for p in owner])
        if self.progress is not None:
            self.progress.wave_done(st)
        self.tally.end_wave(st)
        handed = self._wave.handed
        self.take([m for j in st.order for m in st.members[j] if not handed[m]], results, st)
        self._wave = None
        self.waves += 1

    # ---- the engine's handover (Engine.run) ------------------------------------------------------
    def due(self) -> bool:
        return self.checkpoints is not None and self.checkpoints.due()

    def take(self, final: list[int], results: Sequence[ScoreResult | GenerateResult], stats: RunStats) -> None:
        """Engine requests `final` of the running wave have their results: resolve the calls whose
        requests all have, resume their programs, and save those that finished."""
        w = cast(_Wave, self._wave)
        self.tally.account(w.requests, w.owner, results, [k for k in final if k in stats.members], stats.members,
                           self.waves)
        touched: dict[int, ProgramRun] = {}
        for k in final:
            w.handed[k] = 1
            p = w.owner[k]
            w.left[id(p)] -= 1
            if not w.left[id(p)]:
                n = len(p.op.choices) if isinstance(p.op, Select) else 1
                resolve(p, results[w.first[id(p)]:w.first[id(p)] + n])
                touched[p.owner.index] = self.runs[p.owner.index]
        for index in sorted(touched, key=w.rank.__getitem__):
            self._resume(touched[index])
            self._if_complete(touched[index])
        self._save()
