"""What keeps a run's finished work while it executes: the instance rows of finished programs written to
the run directory as parts (`PartWriter`), when (`Every`), and Ctrl-C / SIGTERM (`Stop`)."""
from __future__ import annotations

import json
import math
import os
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from lmbatch.results.task_results import NAN_ERROR
from lmbatch.rundir.rows import InstanceRow, RequestRow

if TYPE_CHECKING:
    from lmbatch.frontend.runs import ProgramRun
    from lmbatch.frontend.tally import Tally
    from lmbatch.frontend.workload import Workload
    from lmbatch.rundir.rundir import RunDir


class Stop:
    """SIGINT (Ctrl-C) and SIGTERM during a run. While it executes, the first signal stops it at its
    next handover: the finished instances are written as a part and the run raises `Interrupted`.
    Before that, it raises KeyboardInterrupt at once (nothing of this attempt to keep). A second
    signal exits at once: what is on disk is whole parts."""

    def __init__(self) -> None:
        self.asked = False
        self.executing = False
        self.rundir: RunDir | None = None
        self._old: dict[int, Any] = {}

    def __enter__(self) -> Stop:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)

    def _handle(self, signum: int, frame: object) -> None:
        if self.asked:
            rd = self.rundir
            how = f"{rd.rerun} to resume {rd.path}" if rd is not None else "re-run the same command to resume"
            print(f"interrupted again: stopped at once (the results on disk are whole parts; {how})", file=sys.stderr,
                  flush=True)
            os._exit(130)
        self.asked = True
        if not self.executing:
            raise KeyboardInterrupt

    def kept(self) -> str:
        """The line a stopped run ends with."""
        rd = self.rundir
        if rd is None or not rd.saved:
            return "nothing written (no instance had finished)"
        of = f" of {rd.total}" if rd.total else ""
        return f"{len(rd.saved)}{of} instances kept; {rd.rerun} to resume {rd.path}"


class Every:
    """`handover_due()` for the engine: every `seconds` of work, and at once when a stop was asked for."""

    def __init__(self, seconds: float, stop: Stop):
        self.seconds, self.stop = seconds, stop
        self.next = time.perf_counter() + seconds

    def __call__(self) -> bool:
        now = time.perf_counter()
        if not self.stop.asked and now < self.next:
            return False
        self.next = now + self.seconds
        return True


def _jsonable(v: Any) -> Any:
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    return v if isinstance(v, (str, int, float, bool)) or v is None else str(v)


def _nan(metrics: dict[str, float], ans: dict[str, Any] | None, answer: str | None) -> str | None:
    """The error of an instance whose answer's logprobs or metrics are NaN (a model with NaN weights), else None."""
    if ans is not None and any(math.isnan(x) for x in ans["logprobs"]):
        return (f"{NAN_ERROR}: the model's log-probabilities of select {answer!r}'s choices are NaN (its weights or "
                "its numerics are broken), so no choice was picked")
    bad = sorted(k for k, v in metrics.items() if math.isnan(v))
    if bad:
        return f"{NAN_ERROR}: metric {bad[0]!r} is NaN" + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else "")
    return None


def instance_rows(w: Workload, runs: list[ProgramRun]) -> list[InstanceRow]:
    """instances.parquet's rows (docs/outputs.md) of finished programs, each scored by its task (a
    suite's instances by theirs)."""
    rows = []
    for run in runs:
        s, inst, error = run.state, run.instance, run.error
        tw = w.task_of(inst)
        metrics: dict[str, float] = {}
        if error is None and tw.score is not None:
            try:
                metrics = {k: float(v) for k, v in tw.score(inst, s).items()}
            except (Exception, SystemExit) as e:  # the user's scoring code: kept with its instance
                error = f"score: {type(e).__name__}: {e}"
        assert s is not None
        ans = s.meta(tw.answer) if tw.answer and tw.answer in s and run.error is None else None
        nan = None if error is not None else _nan(metrics, ans, tw.answer)
        if nan is not None:                 # a NaN score is no score: the instance failed, and the run warns
            error, metrics = nan, {}
        t = run.tokens
        primary = tw.primary_metric or "acc"
        rows.append(InstanceRow(task=tw.name, subject=inst.subject, id=inst.id,
                                prediction=None if ans is None else str(ans["index"]),     # comparable with gold
                                gold=None if inst.gold is None else str(inst.gold),
                                correct=bool(metrics[primary]) if primary in metrics else None,
                                logprobs=[] if ans is None else ans["logprobs"],
                                is_greedy=[] if ans is None else ans["is_greedy"],
                                metrics=metrics, outputs=json.dumps(_jsonable(s.variables())), error=error,
                                prompt_tokens=t.prompt_tokens, cached_tokens=t.cached_tokens,
                                computed_tokens=t.computed_tokens, decode_tokens=t.decode_tokens,
                                inputs=json.dumps(_jsonable(inst.inputs)), number=run.number))
    return rows


class PartWriter:
    """Finished programs go to the run directory as a part (their instance rows and their requests' rows)."""

    def __init__(self, w: Workload, rundir: RunDir, tally: Tally):
        self.w, self.rundir, self.tally = w, rundir, tally
        self.started = time.perf_counter()

    def write(self, runs: list[ProgramRun]) -> None:
        if not runs:
            return
        by_run = self.tally.rows_by_run
        reqs = [r for run in runs for r in by_run.pop(run.index, [])]      # token_ids written if saved
        self.write_rows(instance_rows(self.w, runs), reqs)

    def write_rows(self, rows: list[InstanceRow], reqs: list[RequestRow]) -> None:
        """A part of rows made already (a data-parallel worker's programs': lmbatch/run/spread.py)."""
        self.rundir.write_part(rows, reqs, execute_s=time.perf_counter() - self.started)
