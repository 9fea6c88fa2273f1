"""Runs as `lmbatch report` reads them (docs/outputs.md): a run directory's summary.json, checked by its record
(`Summary.read`: summaries of earlier versions too), its Parquet files against the summary's records of them,
and the run's tasks: the summary's `tasks` block, or derived from instances.parquet."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path, PurePosixPath
from typing import Any

from lmbatch.errors import UserError, first_line
from lmbatch.results.stats import mean, mean_stderr
from lmbatch.results.task_results import STDERR
from lmbatch.rundir.codec import RecordError
from lmbatch.rundir.layout import INSTANCES, MARKER, REQUESTS, SUMMARY
from lmbatch.rundir.records import FileRecord, Summary, Tokens
from lmbatch.rundir.rows import ColumnMissing, InstanceScores, read_scores


def run_dir_of(path: Path) -> Path:
    """The run directory a path names: the folder itself, or the folder of a summary.json given as the run."""
    path = Path(path)
    return path.parent if path.name == SUMMARY and path.is_file() else path


def summary_of(data: Any, where: str) -> Summary:
    """The summary parsed JSON holds; UserError naming `where` and the field that is absent or of another type."""
    if not isinstance(data, dict):
        raise UserError(f"{where} is not an lmbatch summary (expected a JSON object)")
    try:
        return Summary.read(data)
    except RecordError as e:
        raise UserError(f"{e.line(where)}: not a summary lmbatch wrote") from None


def load_summary(run_dir: Path) -> Summary:
    """The summary of a run directory (or of its summary.json's path), its files checked against it; UserError
    if absent, unreadable, not a summary or not the files' own."""
    run_dir = run_dir_of(run_dir)
    path = run_dir / SUMMARY
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        if (Path(run_dir) / MARKER).is_file():
            raise UserError(f"{run_dir} is an incomplete run (interrupted, or still running): re-run the same "
                            "lmbatch run command to resume it") from None
        raise UserError(f"{run_dir} is not an lmbatch run directory (no summary.json)") from None
    except UnicodeDecodeError as e:
        raise UserError(f"{path} is not an lmbatch summary (not UTF-8 text: {e.reason} at byte {e.start})") from None
    try:
        data = json.loads(text)
    except ValueError as e:
        raise UserError(f"{path} is not valid JSON: {e}") from None
    summary = summary_of(data, str(path))
    _check_files(Path(run_dir), summary.files)
    return summary


def _check_files(run_dir: Path, files: dict[str, FileRecord] | None) -> None:
    """The run's Parquet files are those its summary recorded (size and SHA-256): not truncated, not
    another run's. Summaries written before lmbatch recorded them have no "files": their Parquet files
    are read whole instead (a truncated one is found, another run's is not)."""
    if files is None:
        _read_whole(run_dir)
        return
    for name, want in files.items():
        f = run_dir / name
        if not f.is_file():
            raise UserError(f"{f} is missing: the run directory was altered")
        size = f.stat().st_size
        if size != want.bytes:
            what = f"size {size} != {want.bytes} bytes"
        elif FileRecord.of(f, 0).sha256 != want.sha256:
            what = "same size, its checksum differs"
        else:
            continue
        raise UserError(f"{f} does not belong to this run's summary ({what}): the run directory was altered "
                        "or mixed with another run")


def _read_whole(run_dir: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    for name in (INSTANCES, REQUESTS):
        f = run_dir / name
        if f.is_file():
            try:
                pq.read_table(f)
            except (OSError, ValueError, pa.ArrowException) as e:
                raise UserError(f"{f} is not a whole Parquet file ({first_line(e)}): the run directory was altered "
                                "(its summary, from an older lmbatch, records no checksums)") from None


def model_name(model: str) -> str:
    """A model by its folder's name (the same model lives at other paths on other machines)."""
    return PurePosixPath(model.replace("\\", "/")).name


def split_stderr(metrics: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A metrics object as (metrics, their standard errors): "NAME_stderr" beside "NAME" is NAME's error."""
    errors = {k[:-len(STDERR)]: v for k, v in metrics.items() if k.endswith(STDERR) and k[:-len(STDERR)] in metrics}
    return {k: v for k, v in metrics.items() if not (k.endswith(STDERR) and k[:-len(STDERR)] in errors)}, errors


# --- one task of a run: summary.json's `tasks` block, or derived from instances.parquet ------------------------

@dataclass
class TaskResult:
    """One task of a run, as report shows and compares it."""
    name: str
    n: int                              # its instances
    failed: int | None                  # of them, those whose program or score failed (None: not recorded)
    primary_metric: str | None          # the task's main metric (None: not recorded)
    metrics: dict[str, float | None]    # each metric's mean over the instances scored
    stderr: dict[str, float | None]     # their standard errors (`stats.mean_stderr`), where known
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    computed_tokens: int | None = None
    hit_rate: float | None = None
    optimal_hit_rate: float | None = None
    compared: list[str] | None = None   # the metrics a comparison tests (the tasks block's compared_metrics)

    def decisive(self) -> list[str]:
        """The metrics that decide a comparison and are plotted: those the tasks block names, else the primary
        one where the instances carry it (or none was scored), else every one (a task with its own metrics,
        such as json or a program file's, that an older lmbatch recorded as having acc)."""
        if self.compared:
            return list(self.compared)
        if self.primary_metric and (self.primary_metric in self.metrics or not self.metrics):
            return [self.primary_metric]
        return sorted(self.metrics)

    def primary_value(self) -> tuple[float | None, float | None]:
        """The primary metric's score and standard error (acc where none is recorded)."""
        name = self.primary_metric or "acc"
        return self.metrics.get(name), self.stderr.get(name)


@dataclass
class TaskInstances:
    """A task's rows of the run's instances files: each instance's metrics by id (None where it failed),
    and the token counts summed over them."""
    scores: dict[str, dict[str, float] | None]
    prompt_tokens: int = 0
    cached_tokens: int = 0
    computed_tokens: int = 0


def instance_files(run_dir: Path, summary: Summary) -> list[Path]:
    """The run's instances files: those its summary records (`instances.parquet`, and any `*instances.parquet`
    beside it), else the instances.parquet there is (none in a summary-only folder)."""
    if summary.files is not None:
        return [run_dir / name for name in summary.files if name.endswith(INSTANCES)]
    return [f for f in [run_dir / INSTANCES] if f.is_file()]


def read_instances(run_dir: Path, summary: Summary) -> dict[str, TaskInstances] | None:
    """Every instance the run wrote, by task (in file order); None when the run has no instances file."""
    import pyarrow as pa

    files = instance_files(run_dir, summary)
    if not files:
        return None
    out: dict[str, TaskInstances] = {}
    for f in files:
        try:
            rows = read_scores(f)
        except ColumnMissing as e:
            raise UserError(str(e)) from None
        except (OSError, ValueError, pa.ArrowException) as e:
            raise UserError(f"{f} cannot be read ({first_line(e)})") from None
        for row in rows:
            _add_instance(out, row, f)
    return out


def _add_instance(out: dict[str, TaskInstances], row: InstanceScores, f: Path) -> None:
    t = out.setdefault(row.task, TaskInstances({}))
    if row.id in t.scores:
        raise UserError(f"{f}: instance {row.id!r} of task {row.task!r} is there twice: not a file lmbatch wrote")
    t.scores[row.id] = row.metrics
    t.prompt_tokens += row.prompt_tokens
    t.cached_tokens += row.cached_tokens
    t.computed_tokens += row.computed_tokens


def task_from_instances(name: str, inst: TaskInstances) -> TaskResult:
    """A task's view derived from its instances, as summary.json's `tasks` block holds it: each metric's
    mean and standard error over the instances that have it, the primary metric acc where they have it."""
    scored = [m for m in inst.scores.values() if m is not None]
    names = sorted({k for m in scored for k in m})
    values = {k: [m[k] for m in scored if k in m] for k in names}
    return TaskResult(name=name, n=len(inst.scores), failed=len(inst.scores) - len(scored),
                      primary_metric="acc" if "acc" in values else None,
                      metrics={k: mean(v) for k, v in values.items()},
                      stderr={k: mean_stderr(v) for k, v in values.items()},
                      prompt_tokens=inst.prompt_tokens, cached_tokens=inst.cached_tokens,
                      computed_tokens=inst.computed_tokens,
                      hit_rate=inst.cached_tokens / inst.prompt_tokens if inst.prompt_tokens else None)


def task_from_summary(s: Summary) -> TaskResult:
    """A single-task run's one task from its summary alone (no instances to derive standard errors from,
    unless the summary has them)."""
    metrics, errors = split_stderr(s.metrics or {})
    if not metrics and s.accuracy is not None:
        metrics = {"acc": s.accuracy}
    tokens = s.tokens or Tokens()
    return TaskResult(name=s.task, n=s.counts.instances, failed=s.counts.failed_instances,
                      primary_metric="acc" if "acc" in metrics else None, metrics=metrics, stderr=errors,
                      prompt_tokens=tokens.prompt, cached_tokens=tokens.cached, computed_tokens=tokens.computed,
                      hit_rate=s.hit_rate, optimal_hit_rate=s.optimal_hit_rate)


def tasks_from_block(s: Summary) -> dict[str, TaskResult] | None:
    """The run's tasks as its summary's `tasks` block holds them; None for a summary without one (written
    before lmbatch ran suites)."""
    if s.tasks is None:
        return None
    out = {}
    for name, t in s.tasks.items():
        metrics, errors = split_stderr(t.metrics)
        out[name] = TaskResult(name=name, n=t.n, failed=t.failed, primary_metric=t.primary_metric,
                               metrics=metrics, stderr=errors, compared=t.compared_metrics,
                               prompt_tokens=t.prompt_tokens, cached_tokens=t.cached_tokens,
                               computed_tokens=t.computed_tokens, hit_rate=t.hit_rate,
                               optimal_hit_rate=t.optimal_hit_rate)
    return out


class Run:
    """A run as report reads it: its summary, its instances (read when first needed), its tasks."""

    def __init__(self, summary: Summary, path: Path | None = None):
        self.summary, self.path = summary, path

    @property
    def run_id(self) -> str:
        return self.summary.run_id

    @cached_property
    def instances(self) -> dict[str, TaskInstances] | None:
        """Each task's instances by id; None for a summary alone (no run directory, or no instances file)."""
        return None if self.path is None else read_instances(self.path, self.summary)

    @cached_property
    def tasks(self) -> dict[str, TaskResult]:
        """The run's tasks: its summary's `tasks` block, else derived from its instances (a single task's
        hit rates are the run's), else the summary's one task."""
        block = tasks_from_block(self.summary)
        if block is not None:
            return block
        if not self.instances:
            return {self.summary.task: task_from_summary(self.summary)}
        out = {name: task_from_instances(name, inst) for name, inst in self.instances.items()}
        if len(out) == 1:       # the run's own figures (of this attempt, as the run's row shows them)
            only, whole = next(iter(out.values())), task_from_summary(self.summary)
            only.hit_rate, only.optimal_hit_rate = whole.hit_rate, whole.optimal_hit_rate
            if whole.prompt_tokens is not None:
                only.prompt_tokens, only.cached_tokens = whole.prompt_tokens, whole.cached_tokens
                only.computed_tokens = whole.computed_tokens
        return out


def load_run(run_dir: Path) -> Run:
    """A run directory, its summary checked (`load_summary`)."""
    return Run(load_summary(run_dir), run_dir_of(run_dir))


def as_run(run: Run | Summary | dict[str, Any]) -> Run:
    """A run, or a summary alone (parsed JSON: checked as a file's would be)."""
    if isinstance(run, Run):
        return run
    if isinstance(run, Summary):
        return Run(run)
    return Run(summary_of(run, "a summary given as parsed JSON"))     # checked before any field is read
