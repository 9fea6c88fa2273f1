"""Programs run where their GPU is: with several data-parallel workers, a generating run hands each worker
its share of the programs whole (`Programs`), cut along the first stage's radix subtrees as a batch's chunks
are, and each worker runs them end to end with an interpreter of its own beside its engine: waves, tokenizing
and planning of later calls on that worker, its GPU never waiting for another's wave or for this process.

This process only writes the instance rows each worker hands over as its programs finish (`Rows`, about every
second, so a stop and a resume keep what finished) and, once each has `Finished`, adds up the workers'
counts (`Tally.absorb`): the run's optimum is that of every prompt executed, as with one engine, and each
worker's own is the data-parallel optimum. Request rows are numbered here in the order they arrive.
`LMBATCH_SPREAD=0` keeps this process's interpreter instead: waves, each cut across the workers.
"""
from __future__ import annotations

import dataclasses
import os
import pickle
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, cast

from lmbatch.errors import Interrupted
from lmbatch.frontend.calls import CallOptions, KnownIds, engine_requests
from lmbatch.frontend.runs import Status
from lmbatch.frontend.workload import Instance
from lmbatch.run.progress import Meter

if TYPE_CHECKING:
    from lmbatch.engine.parallel import ParallelEngine
    from lmbatch.engine.protocol import BatchEngine
    from lmbatch.frontend.interpreter import Interpreter
    from lmbatch.frontend.tally import Tally
    from lmbatch.frontend.workload import Workload
    from lmbatch.options import RunOptions
    from lmbatch.run.parts import Every, PartWriter
    from lmbatch.run.progress import TokenProgress
    from lmbatch.rundir.rows import InstanceRow, RequestRow

TICK_S = 0.2        # how often this process looks at a stop while the workers run


@dataclass(frozen=True)
class Rows:
    """worker -> parent: instance rows of programs that finished, their requests' rows, the worker's counts."""
    instances: list[InstanceRow]
    requests: list[RequestRow]
    meter: Meter


@dataclass(frozen=True)
class Ended:
    """What a worker's `Programs.run_on` returns: its counts and waves, and its seconds."""
    tally: Tally
    waves: int
    truncated: int
    busy_s: float           # from the message's arrival to its last program's end


@dataclass(frozen=True)
class Programs:
    """parent -> worker: the programs of `numbers` (their `instances`) of task `task`, to run end to end."""
    task: str
    model_dir: str
    calls: CallOptions
    schedule: str
    seed: int
    instances: list[Instance]
    numbers: list[int]
    known: KnownIds             # their first-stage calls' token ids, as this process made them
    token_ids: bool             # request rows keep their prompts' ids (--save-token-ids)

    def run_on(self, engine: BatchEngine, send: Callable[[Any], None], due: Callable[[], bool]) -> Ended:
        """On the worker: the programs run as one engine's run would run them, rows handed over as they end."""
        from lmbatch.frontend.interpreter import Interpreter
        from lmbatch.frontend.tokenize import TextEncoder
        from lmbatch.programs.registry import get_workload
        from lmbatch.run.parts import instance_rows
        from lmbatch.run.progress import TokenProgress

        t0 = time.perf_counter()
        w = get_workload(self.task)
        interp = Interpreter(TextEncoder.for_model(self.model_dir), self.calls, schedule=self.schedule, seed=self.seed)
        interp.start(w.programs, self.instances, self.numbers, known=self.known)
        interp.plan_first_wave()
        meter = TokenProgress(disable=True)
        by_run = interp.tally.rows_by_run
        # each wave's survivors frozen (interpreter.settled_host_work): this worker process ends with the run
        for finished in interp.stream(engine, handover_due=due, progress=meter, settle=True):
            reqs = [r for run in finished for r in by_run.pop(run.index, [])]
            if not self.token_ids:
                reqs = [dataclasses.replace(r, token_ids=None) for r in reqs]
            send(Rows(instance_rows(w, finished), reqs, meter.counts()))
        busy = time.perf_counter() - t0
        by_run.clear()
        return Ended(interp.tally, interp.waves, interp.truncated, busy)


def spread_works(o: RunOptions, w: Workload, interp: Interpreter, engine: Any, known: KnownIds,
                 model_dir: Path) -> dict[int, Programs] | None:
    """Each worker's `Programs`, its share of the first stage's calls cut along the radix tree, where this
    run's programs go to its workers whole: several local workers, each alone on its model, and programs
    that generate (a run that only scores is one wave, cut in chunks as it is). None otherwise, and where
    they cannot cross to another process (a program file's instances that do not pickle)."""
    from lmbatch.engine.parallel import ParallelEngine
    if not (isinstance(engine, ParallelEngine) and engine.data_parallel > 1 and engine.tensor_parallel == 1
            and engine.cluster is None and w.generates) or os.environ.get("LMBATCH_SPREAD") == "0":
        return None
    requests, owner = engine_requests([p for p in interp.ready if p.ids is not None], interp.seed)
    groups = [p.owner.index for p in owner]
    cut = engine.shares(requests, groups) if requests else [[] for _ in range(engine.data_parallel)]
    placed = {g for share in cut for g in share}       # and any other program not complete yet, on worker 0
    cut[0] += [run.index for run in interp.runs if run.index not in placed and run.status is not Status.COMPLETE]
    works: dict[int, Programs] = {}
    for k, share in enumerate(cut):
        if not share:
            continue
        runs = [interp.runs[cast(int, g)] for g in share]
        numbers = [run.number for run in runs]
        mine = set(numbers)
        works[k] = Programs(o.workload.task, str(model_dir), interp.preparer.options, interp.schedule, interp.seed,
                            [run.instance for run in runs], numbers,
                            {key: v for key, v in known.items() if key[0] in mine}, o.output.save_token_ids)
    if w.data_files is None:        # a program file's instances: whatever its code made
        try:
            for work in works.values():
                pickle.dumps(work, protocol=pickle.HIGHEST_PROTOCOL)
        except (pickle.PicklingError, TypeError, AttributeError):
            return None
    return works


def run_spread(interp: Interpreter, engine: Any, works: dict[int, Programs], parts: PartWriter,
               progress: TokenProgress, every: Every) -> None:
    """Run every worker's programs; write their rows as parts when `every()` says so (and at the end), stop
    at the first chance once a stop is asked for (`every.stop`); then the run's counts are the workers'
    added up."""
    engine = cast("ParallelEngine", engine)
    t0 = time.perf_counter()
    meters: dict[int, Meter] = {}
    ended: dict[int, Ended] = {}
    rows: list[InstanceRow] = []
    reqs: list[RequestRow] = []
    order = 0
    parts.write(interp.take_completed())        # programs with nothing to run: complete here
    for got in engine.spread(dict(works), TICK_S):
        if got is not None:
            k, msg = got
            if isinstance(msg, Rows):
                rows += msg.instances
                for r in msg.requests:
                    r.order, order = order, order + 1
                reqs += msg.requests
                meters[k] = msg.meter
                progress.show(list(meters.values()))
            else:
                ended[k] = msg.payload
        if rows and (every() or len(ended) == len(works)):
            parts.write_rows(rows, reqs)
            rows, reqs = [], []
        if every.stop.asked:
            raise Interrupted(every.stop.kept())
    parts.write_rows(rows, reqs)
    wall = time.perf_counter() - t0
    t1 = time.perf_counter()
    interp.preparer.truncated = 0           # each worker ran its programs' first stage again: its count is theirs
    for k, e in sorted(ended.items()):
        engine.account_spread(k, e.busy_s, max(0.0, wall - e.busy_s), e.tally.stats.computed_tokens,
                              e.tally.stats.unique_tokens)
        interp.tally.absorb(e.tally)
        interp.waves = max(interp.waves, e.waves)
        interp.preparer.truncated += e.truncated
    interp.stats.execute_s = wall
    interp.tally.finish()
    interp.stats.plan_s += time.perf_counter() - t1
