"""Runs a whole batch of LM programs on the engine: one open stream, or waves.

Every program runs in its own greenlet until it waits for a model result. The calls queued by all
waiting programs form a wave, executed as one engine batch (planned as a radix tree, in DFS order).
The first wave holds the first-stage calls of every instance, so the offline tree covers them all.
Later calls depend on generated text. On an engine that takes requests while it runs
(`open_stream`), a program's next calls join the running batch once its results are back and the
batch has room (engine/stream.py: its decode rows at most half taken), and whenever the engine has
nothing left to run; a program need not wait for a wave's slowest request. Otherwise (several workers' engine, or
`LMBATCH_BARRIERS=1`) they join the next wave. Either way the calls that join are picked by longest
cached prefix in the live tree (SGLang's online approximation of DFS), programs not yet started only
while the cache footprint of those under way leaves room (`waves.pick_wave`), so that what a call
leaves in the cache is still there when its program's next calls arrive. Score calls (select) always
join: they leave nothing behind.

`stream` yields the programs that complete as results come back: the engine hands results over
whenever the caller's `handover_due()` says so and at the end of every wave (an engine of workers as
they arrive, too); the calls whose results are all there are resolved, their programs resumed, and
those that completed are yielded at each handover that was due.
"""
from __future__ import annotations

import functools
import gc
import operator
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator, Mapping, Sequence, cast

import greenlet

from lmbatch.errors import UserError
from lmbatch.frontend.calls import (
    CallOptions,
    CallPreparer,
    EngineRequest,
    KnownIds,
    call_tokens,
    engine_requests,
    resolve,
)
from lmbatch.frontend.dsl import Pending, Select, State
from lmbatch.frontend.runs import ProgramRun, Status
from lmbatch.frontend.tally import StageCounts, Tally
from lmbatch.frontend.tokenize import TextEncoder
from lmbatch.frontend.waves import WaveBudget, pick_wave
from lmbatch.frontend.workload import Instance, exit_call
from lmbatch.requests import RunStats
from lmbatch.scheduler.planner import Plan, plan_requests

if TYPE_CHECKING:      # the engine (and torch) load on the model's thread, not here
    from lmbatch.engine.protocol import BatchEngine, Handover, Progress
    from lmbatch.grammar import GrammarCompiler

__all__ = ["Interpreter", "ProgramRun", "StageCounts"]


@dataclass
class _Wave:
    """A wave's engine requests while it runs: the call of each, and which are handed over already."""
    requests: list[EngineRequest] = field(default_factory=list)
    owner: list[Pending] = field(default_factory=list)
    first_request: dict[int, int] = field(default_factory=dict)     # id(call) -> its first request
    waiting: dict[int, int] = field(default_factory=dict)           # id(call) -> its requests not handed over yet
    rank: dict[int, int] = field(default_factory=dict)  # ProgramRun.index -> its first call's place in the wave
    delivered: bytearray = field(default_factory=bytearray)         # request -> handed over
    entered: list[int] = field(default_factory=list)    # request -> the batch it entered the engine in

    def add(self, requests: list[EngineRequest], owner: list[Pending], batch: int) -> int:
        """Engine requests that enter the wave (at its start, or joining it while it runs), `owner[k]`
        the call of each (its request holds its constraint now), all in batch `batch`; returns the index
        of the first."""
        first = len(self.requests)
        self.requests += requests
        self.owner += owner
        for k, p in enumerate(owner, first):
            p.constraint = None
            self.first_request.setdefault(id(p), k)      # the wave keeps every call: ids stay unique
            self.waiting[id(p)] = self.waiting.get(id(p), 0) + 1
            self.rank.setdefault(p.owner.index, len(self.rank))
        self.delivered += bytes(len(requests))
        self.entered += [batch] * len(requests)
        return first


@contextmanager
def settled_host_work(settle: bool = True) -> Iterator[None]:
    """Host work between waves (tokenizing and planning the next): what the last wave left is collected
    and what outlives it frozen first, then the work runs without the cycle collector, and what it made is
    frozen too. The collector's passes during a wave then walk only that wave's objects; without this each
    full pass walked every token list of the run so far (tree of thought, host only: 7.4 s of collector in
    a 26-s run, benchmarks/bench_host.py). No device memory is frozen: a wave's engine objects are made and
    dropped inside the wave."""
    if not settle:
        yield
        return
    gc.collect()
    gc.freeze()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()


class _Readings:
    """What the run layer, tests and benchmarks read of an interpreter: its counts and its calls' preparation."""
    tally: Tally
    preparer: CallPreparer

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


SETTLE_S = 1.0      # an open stream settles its host work (`settled_host_work`) at most this often


class Interpreter(_Readings):
    def __init__(self, tokenizer: TextEncoder | object, calls: CallOptions, *, schedule: str = "dfs", seed: int = 0,
                 barriers: bool | None = None):
        """`tokenizer`: a TextEncoder, or a transformers fast tokenizer it is made from. `barriers`: later
        calls wait for the wave before them even on an engine with an open stream (default: where
        `LMBATCH_BARRIERS=1`)."""
        self.encoder = tokenizer if isinstance(tokenizer, TextEncoder) else TextEncoder.from_hf(tokenizer)
        self.preparer = CallPreparer(self.encoder, calls)
        self.schedule, self.seed = schedule, seed
        self.barriers = os.environ.get("LMBATCH_BARRIERS") == "1" if barriers is None else barriers
        self.first_plan: Plan | None = None     # the first wave's plan, made before the engine is there
        self._planned: list[Pending] = []       # the calls it is for
        self._planned_requests: tuple[list[EngineRequest], list[Pending]] | None = None   # theirs, where made
        self.runs: list[ProgramRun] = []
        self.ready: list[Pending] = []
        self.hub = greenlet.getcurrent()
        self.tally = Tally()
        self.max_final_footprint = 0   # largest cache footprint of a finished program
        self.waves = 0                 # batches of calls that entered the engine (waves, or an open stream's)
        self._settled = 0.0            # when an open stream last settled its host work
        self._completed: list[ProgramRun] = []      # complete programs not yielded yet
        self._wave: _Wave | None = None

    # ---- the first stage, before any model work ---------------------------------------------------
    def start(self, program: Callable[..., None] | Mapping[str, Callable[..., None]], instances: list[Instance],
              numbers: Sequence[int] | None = None, known: KnownIds | None = None,
              record: KnownIds | None = None) -> list[ProgramRun]:
        """Run every program up to its first wait (no model work): the first-stage calls are queued and
        tokenized (or take the `known` ids of the same text; `record` gets every call's ids). A call
        that cannot run stops the run, naming its instance. `program`: one for every instance, or (a
        suite's) one per task, by the instance's `task`. `numbers`: each instance's position in its
        workload (default: its position here)."""
        self.runs = [ProgramRun(k, inst, self, number=k if numbers is None else numbers[k])
                     for k, inst in enumerate(instances)]
        for run in self.runs:
            self._start(run, program[run.instance.task] if isinstance(program, Mapping) else program)
            if run.user_error is not None:
                raise run.user_error
            if run.error is not None:
                raise UserError(f"program failed on instance {run.instance.id}: "
                                f"{(run.error.strip().splitlines() or ['?'])[0]}")
        self.preparer.prepare(self.ready, self._fail_before_model, known, record)
        return self.runs

    def _fail_before_model(self, p: Pending, message: str) -> None:
        raise UserError(message if message.startswith("instance ") else f"instance {p.owner.instance.id}: {message}")

    def longest_ready(self) -> int:
        """Tokens the longest queued call needs (prompt + new tokens, or context + longest choice)."""
        return max((call_tokens(p) for p in self.ready), default=1)

    def first_requests(self) -> list[EngineRequest]:
        """The engine requests of every queued call (after `start`: the whole first stage), as the
        first wave would run them if it held them all: what a dry run plans."""
        if self._planned_requests is not None and self._is_planned(self.ready):
            return self._planned_requests[0]
        return engine_requests(self.ready, self.seed)[0]

    def _is_planned(self, calls: list[Pending]) -> bool:
        """Whether `calls` are those the first wave's plan is for."""
        planned = self._planned
        return len(planned) == len(calls) > 0 and all(map(operator.is_, planned, calls))

    def plan_first_wave(self, plan: Plan | None = None) -> None:
        """Plan the first wave before the engine is there (the run does this while the model loads),
        when that wave is known without the engine: every queued call a select (a wave of generation
        calls depends on the engine's cache and pool). `plan`: made already (a cached workload's)."""
        if self.waves or not self.ready or not all(isinstance(p.op, Select) for p in self.ready):
            return
        self._planned = list(self.ready)
        if plan is None:
            self._planned_requests = engine_requests(self.ready, self.seed)     # a dry run's figures take them too
            plan = plan_requests(self._planned_requests[0], self.schedule, self.seed)
        self.first_plan = plan

    # ---- execution --------------------------------------------------------------------------------
    def execute(self, engine: BatchEngine, wave_tokens: int | None = None) -> list[ProgramRun]:
        """Run waves until every program has finished (`stream`, drained)."""
        for _ in self.stream(engine, wave_tokens=wave_tokens):
            pass
        return self.runs

    def stream(self, engine: BatchEngine, *, handover_due: Callable[[], bool] | None = None,
               progress: Progress | None = None, wave_tokens: int | None = None,
               settle: bool = False) -> Iterator[list[ProgramRun]]:
        """Run every program to its end (one open stream, or waves: see the module), yielding the programs
        that complete at every handover (an empty list too: the caller may stop there). `wave_tokens`: the
        live cache the programs under way may fill (default three quarters of every engine's pool). `settle`:
        calls are picked (tokenized and planned) in `settled_host_work` (a run's own process; it unfreezes at
        its end)."""
        t0, tokenized, planned = time.perf_counter(), self.tokenize_s, self.stats.plan_s
        wave_tokens = wave_tokens or engine.kv_slots * engine.data_parallel * 3 // 4
        feed: Callable[[bool], list[EngineRequest]] | None = None
        if getattr(engine, "open_stream", False) and not self.barriers:
            feed = functools.partial(self._join, engine, wave_tokens, settle=settle)
        yield self.take_completed()                  # programs that finished before any model work
        while self.ready:
            with settled_host_work(settle):
                wave = self._pick_wave(engine, wave_tokens)
            self._settled = time.perf_counter()
            yield from self._run_wave(engine, wave, handover_due, progress, feed)
        for run in self.runs:       # every program ends in the output, whatever it left unread
            if run.status is not Status.COMPLETE:
                run.status = Status.COMPLETE
                self._completed.append(run)
        yield self.take_completed()
        # planning and tokenizing done in here are phases of their own (the first wave's plan, made
        # ahead while the model loaded, is not in here)
        self.stats.execute_s = (time.perf_counter() - t0 - (self.stats.plan_s - planned)
                                - (self.tokenize_s - tokenized))
        t1 = time.perf_counter()
        self.tally.finish()
        self.stats.plan_s += time.perf_counter() - t1

    def take_completed(self) -> list[ProgramRun]:
        """Programs complete and not handed out yet (`stream` yields them)."""
        done, self._completed = self._completed, []
        return done

    def _start(self, run: ProgramRun, program: Callable[..., None]) -> None:
        run.state = State(run)

        def body() -> None:
            try:
                program(run.state, **run.instance.inputs)
            except UserError as e:  # a call that cannot run (e.g. too long): named with its instance
                run.error, run.user_error = str(e), e
            except SystemExit as e:  # sys.exit() in a program ends that program, not the run
                run.error = f"the program called {exit_call(e)}"
            except Exception as e:  # a program's own bug: kept with its instance
                run.error = f"{type(e).__name__}: {e}"
            self.max_final_footprint = max(self.max_final_footprint, run.footprint)
            self._if_complete(run)
        run.glet = greenlet.greenlet(body, parent=self.hub)
        run.glet.switch()

    def _resume(self, run: ProgramRun) -> None:
        if not run.finished and all(p.done for p in run.calls):
            cast(greenlet.greenlet, run.glet).switch()     # not finished: it has a greenlet

    def _if_complete(self, run: ProgramRun) -> None:
        """A program is complete when it has returned and every call it made has its result (a
        program may return without reading its last calls)."""
        if run.status is not Status.COMPLETE and run.finished and all(p.done for p in run.calls):
            run.status = Status.COMPLETE
            self._completed.append(run)

    def _fail_call(self, p: Pending, message: str) -> None:
        """A call of a later stage that cannot run ends its own program."""
        run = self.runs[p.owner.index]
        run.calls.remove(p)
        p.done, p.meta["error"] = True, message       # an empty result: nothing waits on it forever
        run.error = run.error or message
        if not run.finished:
            cast(greenlet.greenlet, run.glet).throw(UserError(message))
        self._if_complete(run)      # a program that returned before this call could run

    # ---- waves ----------------------------------------------------------------------------
    def _pick_wave(self, engine: BatchEngine, wave_tokens: int, force: bool = True) -> list[Pending]:
        """The next wave (see `waves`) from the queued calls, prepared first; the rest stay queued.
        `force`: a program not started joins even beyond the budget when nothing else would."""
        self.preparer.prepare([p for p in self.ready if p.ids is None], self._fail_call)
        for p in [p for p in self.ready if p.ids is not None and call_tokens(p) > engine.kv_slots]:
            n, p.ids = call_tokens(p), None     # a later stage's (the run sized the pool for the first)
            kind = "select" if isinstance(p.op, Select) else "gen"
            self._fail_call(p, f"instance {p.owner.instance.id}: {kind} {p.op.name!r} needs {n} tokens, more than "
                               f"the KV pool holds ({engine.kv_slots}): raise --kv-cache-tokens")
        ready = [p for p in self.ready if p.ids is not None]
        budget = WaveBudget(wave_tokens, self.max_final_footprint, force)
        wave, self.ready = pick_wave(ready, self.runs, engine.match_lens, budget, self.schedule,
                                     self.seed + self.waves)
        for p in wave:
            run = self.runs[p.owner.index]
            if run.status is Status.NEW:
                run.status = Status.STARTED
        return wave

    def _run_wave(self, engine: BatchEngine, wave: list[Pending], handover_due: Callable[[], bool] | None,
                  progress: Progress | None, feed: Callable[[bool], list[EngineRequest]] | None = None,
                  ) -> Iterator[list[ProgramRun]]:
        """Run a wave on the engine (with `feed`, an open stream: the programs' later calls join it)."""
        same = self._is_planned(wave)
        made, self._planned_requests = self._planned_requests, None
        requests, owner = made if same and made is not None else engine_requests(wave, self.seed)
        self._planned = []
        plan, self.first_plan = (self.first_plan if same else None), None
        self._wave = _Wave()
        self._wave.add(requests, owner, self.waves)
        self.tally.start_wave(owner, None if plan is None or len(plan.dfs) != len(requests) else
                              (plan.dfs, plan.lcps, [r.prompt_len for r in requests]))
        first = self.waves
        for h in engine.stream(requests, schedule=self.schedule, seed=self.seed + self.waves, plan=plan,
                               progress=progress, handover_due=handover_due, feed=feed,
                               groups=[p.owner.index for p in owner]):
            if h.last:
                self.tally.end_wave(h.stats, self.waves - first + 1)
            self._receive(h)
            if h.due or h.last:     # a handover not due: its programs wait for the next that is
                yield self.take_completed()
        self._wave = None
        self.waves += 1

    def _join(self, engine: BatchEngine, wave_tokens: int, idle: bool, settle: bool) -> list[EngineRequest]:
        """The engine requests of queued calls that join the running wave now (an open stream's `feed`),
        picked as a wave is; `idle`: the engine has nothing left to run."""
        if not self.ready:
            return []
        now = time.perf_counter()
        settle = settle and now - self._settled > SETTLE_S
        with settled_host_work(settle):
            calls = self._pick_wave(engine, wave_tokens, force=idle)
        if settle:
            self._settled = now
        if not calls:
            return []
        requests, owner = engine_requests(calls, self.seed)
        self.waves += 1
        self.tally.join(owner, cast(_Wave, self._wave).add(requests, owner, self.waves))
        return requests

    def _receive(self, h: Handover) -> None:
        """Engine requests `h.final` of the running wave have their results: resolve the calls whose
        requests all have, resume their programs (those that complete wait in `_completed`)."""
        w = cast(_Wave, self._wave)
        self.tally.account(w.requests, w.owner, h.results, [k for k in h.final if k in h.stats.members],
                           h.stats.members, w.entered)
        touched: dict[int, ProgramRun] = {}
        for k in h.final:
            w.delivered[k] = 1
            p = w.owner[k]
            w.waiting[id(p)] -= 1
            if not w.waiting[id(p)]:
                n = len(p.op.choices) if isinstance(p.op, Select) else 1
                resolve(p, h.results[w.first_request[id(p)]:w.first_request[id(p)] + n])
                touched[p.owner.index] = self.runs[p.owner.index]
        for index in sorted(touched, key=w.rank.__getitem__):
            self._resume(touched[index])
            self._if_complete(touched[index])
