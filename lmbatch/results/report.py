"""Read run directories (docs/outputs.md), tabulate them (a row per run, and one per task of a suite run),
and compare two runs for regressions (a paired test per task on the instances both ran)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path, PurePosixPath
from typing import Any, Iterable

from lmbatch.errors import UserError, first_line
from lmbatch.options import DECIDING
from lmbatch.results.stats import MCNEMAR, Paired, holm, mean, mean_stderr, paired_test
from lmbatch.results.task_results import STDERR

FORMATS = ("table", "markdown", "json")
# a task's own metrics other than acc (HellaSwag's acc_norm, json's complete and valid) are columns too,
# after accuracy (`columns`)
COLUMNS = ("run_id", "task", "model", "shots", "dtype", "device", "instances", "failed", "accuracy", "hit_rate",
           "optimal_hit_rate", "hit_ratio", "execute_s", "programs_per_s",
           "prompt_tokens_per_s", "computed_tokens_per_s")
# Decimals shown per float column in the table and markdown formats (a metric's column: 4).
DECIMALS = {"accuracy": 4, "hit_rate": 4, "optimal_hit_rate": 4, "hit_ratio": 4, "execute_s": 2,
            "programs_per_s": 1, "prompt_tokens_per_s": 1, "computed_tokens_per_s": 1}
_EPS = 1e-9  # thresholds are inclusive: a value exactly at a limit (up to float noise) passes

# The fields report and compare read, and what each must be: a summary with another type (a hand-edited
# or foreign file) is one line naming the field, not a TypeError.
_NUMBER, _OPTIONAL_NUMBER, _INT, _STR, _OBJECT = "a number", "a number or null", "an integer", "a string", "an object"
FIELDS = {"run_id": _STR, "task": _STR, "model": _STR, "device": _STR, "dtype": _STR, "counts": _OBJECT,
          "counts.instances": _INT, "counts.failed_instances": _INT, "accuracy": _OPTIONAL_NUMBER,
          "accuracy_stderr": _OPTIONAL_NUMBER, "shots": _OPTIONAL_NUMBER,
          "metrics": _OBJECT, "hit_rate": _NUMBER, "optimal_hit_rate": _NUMBER, "time_s": _OBJECT,
          "time_s.execute": _NUMBER, "throughput": _OBJECT, "throughput.programs_per_s": _NUMBER,
          "throughput.prompt_tokens_per_s": _NUMBER, "throughput.computed_tokens_per_s": _NUMBER,
          "options": _OBJECT, "files": _OBJECT}
# the fields every summary has (the others are newer than some summaries)
REQUIRED = ("run_id", "task", "model", "device", "counts.instances", "accuracy", "hit_rate", "optimal_hit_rate",
            "time_s.execute", "throughput.programs_per_s", "throughput.prompt_tokens_per_s",
            "throughput.computed_tokens_per_s")
# What decides a run's workload (and so its accuracy and speed): --compare refuses runs that differ in any
# field both summaries have. The model is compared by its folder's name (the same model lives at other
# paths on other machines).
WORKLOAD = ("task", "model", "dtype", "counts.instances", *(f"options.{name}" for name in DECIDING))


def run_dir_of(path: Path) -> Path:
    """The run directory a path names: the folder itself, or the folder of a summary.json given as the run."""
    path = Path(path)
    return path.parent if path.name == "summary.json" and path.is_file() else path


def load_summary(run_dir: Path) -> dict:
    """The parsed summary.json of a run directory (or of its summary.json's path); UserError if absent or
    unreadable."""
    run_dir = run_dir_of(run_dir)
    path = run_dir / "summary.json"
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        if (Path(run_dir) / "INCOMPLETE").is_file():
            raise UserError(f"{run_dir} is an incomplete run (interrupted, or still running): re-run the same "
                            "lmbatch run command to resume it") from None
        raise UserError(f"{run_dir} is not an lmbatch run directory (no summary.json)") from None
    except UnicodeDecodeError as e:
        raise UserError(f"{path} is not an lmbatch summary (not UTF-8 text: {e.reason} at byte {e.start})") from None
    try:
        data = json.loads(text)
    except ValueError as e:
        raise UserError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise UserError(f"{path} is not an lmbatch summary (expected a JSON object)")
    for dotted in FIELDS:
        _typed(data, dotted, str(path))
    for dotted in REQUIRED:
        if _field(data, dotted) is _ABSENT:
            raise UserError(f"{path} lacks field '{dotted}': not a summary lmbatch wrote")
    _metrics(data, str(path))
    _check_files(Path(run_dir), data.get("files"))
    return data


def _field(summary: dict, dotted: str) -> Any:
    """A summary's field by its dotted path ("options.subjects"), or _ABSENT."""
    value: Any = summary
    for key in dotted.split("."):
        if not isinstance(value, dict) or key not in value:
            return _ABSENT
        value = value[key]
    return value


_ABSENT = object()


def _typed(summary: dict, dotted: str, where: str) -> Any:
    """summary's field `dotted` (None if absent), checked to be what FIELDS says it is."""
    value = _field(summary, dotted)
    if value is _ABSENT:
        return None
    kind = FIELDS.get(dotted)
    number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = {_NUMBER: number, _OPTIONAL_NUMBER: value is None or number, _STR: isinstance(value, str),
          _INT: isinstance(value, int) and not isinstance(value, bool), _OBJECT: isinstance(value, dict),
          None: True}[kind]
    if not ok:
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        raise UserError(f"{where}: field '{dotted}' is {shown} ({type(value).__name__}), not {kind}: not a summary "
                        "lmbatch wrote")
    return value


def _check_files(run_dir: Path, files: Any) -> None:
    """The run's Parquet files are those its summary recorded (size and SHA-256): not truncated, not
    another run's. Summaries written before lmbatch recorded them have no "files": their Parquet files
    are read whole instead (a truncated one is found, another run's is not)."""
    from lmbatch.rundir.layout import file_record

    if not isinstance(files, dict):
        _read_whole(run_dir)
        return
    for name, rec in files.items():
        f, want = run_dir / name, rec if isinstance(rec, dict) else {}
        if not f.is_file():
            raise UserError(f"{f} is missing: the run directory was altered")
        size = f.stat().st_size
        if size != want.get("bytes"):
            what = f"size {size} != {want.get('bytes')} bytes"
        elif file_record(f, 0)["sha256"] != want.get("sha256"):
            what = "same size, its checksum differs"
        else:
            continue
        raise UserError(f"{f} does not belong to this run's summary ({what}): the run directory was altered "
                        "or mixed with another run")


def _read_whole(run_dir: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    for name in ("instances.parquet", "requests.parquet"):
        f = run_dir / name
        if f.is_file():
            try:
                pq.read_table(f)
            except (OSError, ValueError, pa.ArrowException) as e:
                raise UserError(f"{f} is not a whole Parquet file ({first_line(e)}): the run directory was altered "
                                "(its summary, from an older lmbatch, records no checksums)") from None


def _get(summary: dict, dotted: str) -> Any:
    """summary['a']['b'] for 'a.b', of the type FIELDS says; UserError naming the run and field when
    missing or of another type."""
    value: Any = summary
    for key in dotted.split("."):
        if not isinstance(value, dict) or key not in value:
            raise UserError(f"summary of run {summary.get('run_id', '?')} lacks field '{dotted}'")
        value = value[key]
    return _typed(summary, dotted, f"summary of run {summary.get('run_id', '?')}")


def _optional(summary: dict, dotted: str) -> Any:
    """Like `_get`, None where the summary has no such field (one written by an older lmbatch)."""
    return _typed(summary, dotted, f"summary of run {summary.get('run_id', '?')}")


def hit_ratio(summary: dict) -> float:
    """Achieved / optimal prefix-cache hit rate; 1.0 when the optimum is 0."""
    achieved, optimal = _get(summary, "hit_rate"), _get(summary, "optimal_hit_rate")
    return 1.0 if not optimal else achieved / optimal


def _model_name(model: str) -> str:
    return PurePosixPath(model.replace("\\", "/")).name


def split_stderr(metrics: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A metrics object as (metrics, their standard errors): "NAME_stderr" beside "NAME" is NAME's error."""
    errors = {k[:-len(STDERR)]: v for k, v in metrics.items() if k.endswith(STDERR) and k[:-len(STDERR)] in metrics}
    return {k: v for k, v in metrics.items() if not (k.endswith(STDERR) and k[:-len(STDERR)] in errors)}, errors


def _metrics(s: dict, where: str = "") -> dict[str, Any]:
    """A run's own metrics other than acc (its accuracy column), each a column of its own: HellaSwag's
    acc_norm, json's complete and valid. A metric named like a column is shown as metric:NAME."""
    metrics = _optional(s, "metrics") or {}
    out = {}
    for name, value in sorted(metrics.items()):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise UserError(f"{where or 'summary of run ' + str(s.get('run_id', '?'))}: field 'metrics.{name}' is "
                            f"{value!r}, not a number: not a summary lmbatch wrote")
    for name, value in sorted(split_stderr(metrics)[0].items()):
        if name != "acc":
            out[f"metric:{name}" if name in COLUMNS else name] = value
    return out


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


INSTANCE_COLUMNS = ("task", "id", "metrics", "error")
TOKEN_COLUMNS = ("prompt_tokens", "cached_tokens", "computed_tokens")


def instance_files(run_dir: Path, summary: dict) -> list[Path]:
    """The run's instances files: those its summary records (`instances.parquet`, and any `*instances.parquet`
    beside it), else the instances.parquet there is (none in a summary-only folder)."""
    files = summary.get("files")
    if isinstance(files, dict):
        return [run_dir / name for name in files if str(name).endswith("instances.parquet")]
    return [f for f in [run_dir / "instances.parquet"] if f.is_file()]


def read_instances(run_dir: Path, summary: dict) -> dict[str, TaskInstances] | None:
    """Every instance the run wrote, by task (in file order); None when the run has no instances file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    files = instance_files(run_dir, summary)
    if not files:
        return None
    out: dict[str, TaskInstances] = {}
    for f in files:
        try:
            names = set(pq.read_schema(f).names)
            missing = [c for c in INSTANCE_COLUMNS if c not in names]
            if missing:
                raise UserError(f"{f} has no column {missing[0]!r}: not an instances file lmbatch wrote")
            rows = pq.read_table(f, columns=[*INSTANCE_COLUMNS, *(c for c in TOKEN_COLUMNS if c in names)])
        except (OSError, ValueError, pa.ArrowException) as e:
            raise UserError(f"{f} cannot be read ({first_line(e)})") from None
        for row in rows.to_pylist():
            _add_instance(out, row, f)
    return out


def _add_instance(out: dict[str, TaskInstances], row: dict[str, Any], f: Path) -> None:
    task, key = str(row["task"]), str(row["id"])
    t = out.setdefault(task, TaskInstances({}))
    if key in t.scores:
        raise UserError(f"{f}: instance {key!r} of task {task!r} is there twice: not a file lmbatch wrote")
    t.scores[key] = None if row["error"] is not None else {str(k): v for k, v in row["metrics"] or []}
    t.prompt_tokens += row.get("prompt_tokens") or 0
    t.cached_tokens += row.get("cached_tokens") or 0
    t.computed_tokens += row.get("computed_tokens") or 0


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


def task_from_summary(s: dict) -> TaskResult:
    """A single-task run's one task from its summary alone (no instances to derive standard errors from,
    unless the summary has them)."""
    metrics, errors = split_stderr(_optional(s, "metrics") or {})
    if not metrics and _get(s, "accuracy") is not None:
        metrics = {"acc": _get(s, "accuracy")}
    tokens: dict[str, Any] = s["tokens"] if isinstance(s.get("tokens"), dict) else {}
    tokens = {k: v for k, v in tokens.items() if isinstance(v, int) and not isinstance(v, bool)}
    return TaskResult(name=_get(s, "task"), n=_get(s, "counts.instances"),
                      failed=_optional(s, "counts.failed_instances"),
                      primary_metric="acc" if "acc" in metrics else None, metrics=metrics, stderr=errors,
                      prompt_tokens=tokens.get("prompt"), cached_tokens=tokens.get("cached"),
                      computed_tokens=tokens.get("computed"), hit_rate=_get(s, "hit_rate"),
                      optimal_hit_rate=_get(s, "optimal_hit_rate"))


# each field of a task in summary.json's `tasks` block, and what it must be (absent: not recorded, except n)
TASK_FIELDS = {"n": _INT, "failed": _INT, "primary_metric": _STR, "metrics": _OBJECT, "prompt_tokens": _INT,
               "cached_tokens": _INT, "computed_tokens": _INT, "hit_rate": _NUMBER, "optimal_hit_rate": _NUMBER}


def _task_field(block: dict, key: str, where: str) -> Any:
    """A field of one task of the `tasks` block (None if absent or null), checked to be what TASK_FIELDS says."""
    value = block.get(key)
    if value is None:
        if key in ("n", "metrics"):
            raise UserError(f"{where} lacks field '{key}': not a summary lmbatch wrote")
        return None
    kind = TASK_FIELDS[key]
    number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = {_NUMBER: number, _STR: isinstance(value, str), _OBJECT: isinstance(value, dict),
          _INT: isinstance(value, int) and not isinstance(value, bool)}[kind]
    metrics_ok = kind != _OBJECT or all(v is None or (isinstance(v, (int, float)) and not isinstance(v, bool))
                                        for v in value.values())
    if not ok or not metrics_ok:
        raise UserError(f"{where}: field '{key}' is {value!r:.40} ({type(value).__name__}), not {kind}"
                        f"{' of numbers' if ok else ''}: not a summary lmbatch wrote")
    return value


def tasks_from_block(s: dict) -> dict[str, TaskResult] | None:
    """The run's tasks as its summary's `tasks` block holds them; None for a summary without one (written
    before lmbatch ran suites)."""
    block = s.get("tasks")
    if block is None:
        return None
    where = f"summary of run {s.get('run_id', '?')}"
    if not isinstance(block, dict) or not all(isinstance(v, dict) for v in block.values()):
        raise UserError(f"{where}: field 'tasks' is not an object of tasks: not a summary lmbatch wrote")
    out = {}
    for name, t in block.items():
        f = {key: _task_field(t, key, f"{where}: task {name!r}") for key in TASK_FIELDS}
        metrics, errors = split_stderr(f["metrics"])
        compared = t.get("compared_metrics")
        if compared is not None and not (isinstance(compared, list) and all(isinstance(m, str) for m in compared)):
            raise UserError(f"{where}: task {name!r}: field 'compared_metrics' is {compared!r:.40}, not a list of "
                            "metric names: not a summary lmbatch wrote")
        out[str(name)] = TaskResult(name=str(name), n=f["n"], failed=f["failed"], primary_metric=f["primary_metric"],
                                    metrics=metrics, stderr=errors, compared=compared,
                                    **{k: f[k] for k in ("prompt_tokens", "cached_tokens", "computed_tokens",
                                                         "hit_rate", "optimal_hit_rate")})
    return out


class Run:
    """A run as report reads it: its summary, its instances (read when first needed), its tasks."""

    def __init__(self, summary: dict, path: Path | None = None):
        self.summary, self.path = summary, path

    @property
    def run_id(self) -> str:
        return str(_get(self.summary, "run_id"))

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
            return {_get(self.summary, "task"): task_from_summary(self.summary)}
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


def as_run(run: Run | dict) -> Run:
    return run if isinstance(run, Run) else Run(run)


# --- tables -------------------------------------------------------------------------------------------------------

def _run_stderr(run: Run) -> dict[str, Any]:
    """The standard error of each of a run's metrics: its summary's "NAME_stderr", else its one task's."""
    errors = split_stderr(_optional(run.summary, "metrics") or {})[1]
    if len(run.tasks) == 1:
        errors = {**next(iter(run.tasks.values())).stderr, **errors}
    return errors


def _with_stderr(metrics: dict[str, Any], errors: dict[str, Any]) -> dict[str, Any]:
    """The metric columns (`_metrics`), each followed by its NAME_stderr where its error is known."""
    out = {}
    for col, value in metrics.items():
        out[col] = value
        name = col.removeprefix("metric:")
        if errors.get(name) is not None:
            out[col + STDERR] = errors[name]
    return out


def _run_row(run: Run) -> dict[str, Any]:
    s = run.summary
    options = _optional(s, "options") or {}
    errors = _run_stderr(run)
    # accuracy's own error where the summary has it (a suite's accuracy is over each task's primary metric)
    acc_stderr = _optional(s, "accuracy_stderr") if "accuracy_stderr" in s else errors.get("acc")
    return {
        "run_id": _get(s, "run_id"),
        "task": _get(s, "task"),
        "model": _model_name(_get(s, "model")),
        "shots": _optional(s, "shots") if "shots" in s else options.get("shots"),     # a suite's: null if mixed
        "dtype": _optional(s, "dtype"),
        "device": _get(s, "device"),
        "instances": _get(s, "counts.instances"),
        "failed": _optional(s, "counts.failed_instances"),
        "accuracy": _get(s, "accuracy"),
        "accuracy_stderr": acc_stderr if _get(s, "accuracy") is not None else None,
        **_with_stderr(_metrics(s), errors),
        "hit_rate": _get(s, "hit_rate"),
        "optimal_hit_rate": _get(s, "optimal_hit_rate"),
        "hit_ratio": hit_ratio(s),
        "execute_s": _get(s, "time_s.execute"),
        "programs_per_s": _get(s, "throughput.programs_per_s"),
        "prompt_tokens_per_s": _get(s, "throughput.prompt_tokens_per_s"),
        "computed_tokens_per_s": _get(s, "throughput.computed_tokens_per_s"),
    }


def _task_row(run_row: dict[str, Any], t: TaskResult) -> dict[str, Any]:
    """A row of one task of a suite run: its primary metric as its accuracy, its metrics, counts and hit rates;
    its run's speed is the whole run's (one batch over one tree), so the speed columns are empty."""
    metrics = {f"metric:{k}" if k in COLUMNS else k: v for k, v in sorted(t.metrics.items()) if k != "acc"}
    ratio = None if t.hit_rate is None or t.optimal_hit_rate is None else \
        1.0 if not t.optimal_hit_rate else t.hit_rate / t.optimal_hit_rate
    value, stderr = t.primary_value()       # an OLMES task's acc_raw or acc_per_char, json's valid
    return {**{k: run_row[k] for k in ("run_id", "model", "shots", "dtype", "device")}, "task": t.name,
            "instances": t.n, "failed": t.failed, "accuracy": value,
            "accuracy_stderr": stderr, **_with_stderr(metrics, t.stderr),
            "hit_rate": t.hit_rate, "optimal_hit_rate": t.optimal_hit_rate, "hit_ratio": ratio,
            **{k: None for k in ("execute_s", "programs_per_s", "prompt_tokens_per_s", "computed_tokens_per_s")}}


def report_rows(runs: Iterable[Run | dict]) -> list[dict]:
    """One flat row per run: COLUMNS, and the run's own metrics (`_metrics`) after accuracy, each metric with
    its standard error as NAME_stderr where known (accuracy_stderr: acc's); a run of several tasks (a suite)
    is followed by a row per task."""
    rows = []
    for r in map(as_run, runs):
        row = _run_row(r)
        rows.append(row)
        if len(r.tasks) > 1:
            rows += [_task_row(row, t) for t in r.tasks.values()]
    return rows


def _is_stderr(key: str, row: dict) -> bool:
    return key.endswith(STDERR) and key[:-len(STDERR)] in row


def columns(rows: list[dict]) -> list[str]:
    """COLUMNS, with every metric column of the rows after accuracy (in order of first appearance); a
    standard error is shown in its metric's column."""
    metrics = list(dict.fromkeys(k for r in rows for k in r if k not in COLUMNS and not _is_stderr(k, r)))
    at = COLUMNS.index("accuracy") + 1
    return [*COLUMNS[:at], *metrics, *COLUMNS[at:]]


def _cell(column: str, value: Any, stderr: Any = None) -> str:
    """A value as displayed in table/markdown ('-' for None); a metric with its standard error as
    '0.4120 ± 0.0131'."""
    if value is None:
        return "-"
    if isinstance(stderr, (int, float)) and isinstance(value, (int, float)):
        return f"{value:.4f} ± {stderr:.4f}"
    if column not in COLUMNS and isinstance(value, float):      # a metric
        return f"{value:.4f}"
    if column in DECIMALS and isinstance(value, (int, float)) and not isinstance(value, bool):
        if column.endswith("_per_s") and 0 < abs(value) < 10:
            return f"{value:.3g}"       # a small run's rate: not "0.0"
        return f"{value:.{DECIMALS[column]}f}"
    return str(value)


def cells(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    """The table's columns and each row's cells as displayed."""
    cols = columns(rows)
    return cols, [[_cell(c, r.get(c), r.get(c + STDERR)) for c in cols] for r in rows]


def render(rows: list[dict], fmt: str) -> str:
    """rows as 'table' (aligned plain text), 'markdown' (GitHub table) or 'json'."""
    if fmt not in FORMATS:
        raise UserError(f"unknown format {fmt!r} (choose from {', '.join(FORMATS)})")
    if fmt == "json":
        return json.dumps(rows, indent=2)
    cols, shown = cells(rows)
    numeric = [c in DECIMALS or c in ("shots", "instances", "failed") or c not in COLUMNS for c in cols]
    if fmt == "markdown":
        lines = ["| " + " | ".join(cols) + " |",
                 "|" + "|".join("---:" if n else "---" for n in numeric) + "|"]
        lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in shown]
        return "\n".join(lines)
    widths = [max(len(h), *(len(row[i]) for row in shown)) for i, h in enumerate(cols)]

    def line(values: list[str] | tuple[str, ...]) -> str:
        return "  ".join(v.rjust(w) if n else v.ljust(w)
                         for v, w, n in zip(values, widths, numeric)).rstrip()

    return "\n".join([line(cols), line(["-" * w for w in widths])] + [line(r) for r in shown])


# --- comparing two runs -----------------------------------------------------------------------------------------

# the accuracy check of runs without per-instance results (summaries alone): an absolute drop, as before
# significance tests (a candidate more than this below base is a regression unless --max-acc-drop says otherwise)
LEGACY_MAX_ACC_DROP = 0.005


def check_thresholds(max_slowdown: float | None, min_hit_ratio: float, max_acc_drop: float | None,
                     alpha: float = 0.05) -> None:
    """--max-slowdown (None: speed unchecked) is at least 0; --min-hit-ratio, --max-acc-drop (None: not given)
    and --alpha are fractions, 0 to 1. NaN is none of them."""
    for flag, value, top in (("--max-slowdown", max_slowdown, math.inf), ("--min-hit-ratio", min_hit_ratio, 1.0),
                             ("--max-acc-drop", max_acc_drop, 1.0), ("--alpha", alpha, 1.0)):
        if value is not None and not 0 <= value <= top:       # NaN fails both
            within = "at least 0" if top == math.inf else "a fraction from 0 to 1"
            raise UserError(f"{flag} {value}: it must be {within}")


def _workload(summary: dict, dotted: str) -> Any:
    """A WORKLOAD field as compared: the model by its folder's name, subjects as a set; absent: _ABSENT."""
    value = _field(summary, dotted)
    if dotted == "model" and isinstance(value, str):
        return _model_name(value)
    if dotted == "options.subjects" and isinstance(value, list):
        return sorted(set(map(str, value)))
    return value


def workload_differences(base: dict, cand: dict, fields: Iterable[str] = WORKLOAD) -> list[str]:
    """The fields (WORKLOAD's) in which the two runs differ, each as 'name base vs candidate' (a field one of
    them lacks, written by an older lmbatch, is not compared)."""
    out = []
    for dotted in fields:
        b, c = _workload(base, dotted), _workload(cand, dotted)
        if b is not _ABSENT and c is not _ABSENT and b != c:
            out.append(f"{dotted.removeprefix('options.').replace('counts.', '')} {b!r} vs {c!r}")
    return out


def instance_differences(base: dict[str, TaskInstances], cand: dict[str, TaskInstances]) -> list[str]:
    """How the two runs' instances differ (by task, by id), each as a short phrase; [] when they ran the same."""
    out = []
    for task in dict.fromkeys([*base, *cand]):
        if task not in cand or task not in base:
            out.append(f"task {task!r} only in {'base' if task in base else 'candidate'}")
            continue
        for this, that, who in ((base, cand, "base"), (cand, base, "candidate")):
            only = [i for i in this[task].scores if i not in that[task].scores]
            if only:
                out.append(f"task {task!r}: {len(only)} instance{'s' * (len(only) > 1)} only in {who}, "
                           f"e.g. id {only[0]!r}")
    return out


@dataclass
class TaskDelta:
    """One task's metric in two runs over the instances either scored (one that failed in one run counts there
    as the metric's worst score): the paired test, and its verdict."""
    task: str
    metric: str
    paired: Paired
    base_stderr: float | None
    cand_stderr: float | None
    p_holm: float = 1.0                 # its p adjusted over the comparison's tests (`stats.holm`)
    tests: int = 1                      # how many the comparison made (tasks x decisive metrics scored)
    regression: bool = False
    why: str = ""                       # what makes it a regression ('' when it is none)
    failed_base: int = 0                # paired instances that failed in base (scored `worst` there)
    failed_cand: int = 0                # ... in the candidate
    worst: float = 0.0                  # the score a failed instance counts as


@dataclass
class Comparison:
    """What `compare_runs` found: a line per check ("REGRESSION ..." for a failed one) and each task's delta."""
    lines: list[str]
    deltas: list[TaskDelta]

    @property
    def ok(self) -> bool:
        return not any(line.startswith("REGRESSION") for line in self.lines)


def comparison_json(found: Comparison, base: Run, cand: Run) -> str:
    """The comparison as one JSON document (`--compare --format json`): the verdict, every check's line, and
    each task's metric with its paired test."""
    tasks = [{"task": d.task, "metric": d.metric, "test": d.paired.test, "instances": d.paired.n,
              "base": d.paired.base, "candidate": d.paired.cand, "delta": d.paired.delta,
              "delta_stderr": d.paired.delta_stderr, "base_stderr": d.base_stderr, "candidate_stderr": d.cand_stderr,
              "worse": d.paired.worse, "better": d.paired.better, "p": d.paired.p, "p_holm": d.p_holm,
              "failed_base": d.failed_base, "failed_candidate": d.failed_cand, "failed_scored_as": d.worst,
              "regression": d.regression, "why": d.why} for d in found.deltas]
    return json.dumps({"ok": found.ok, "base": base.run_id, "candidate": cand.run_id,
                       "lines": found.lines, "regressions": [x for x in found.lines if x.startswith("REGRESSION")],
                       "tasks": tasks}, indent=2)


def render_comparison(found: Comparison, base: Run, cand: Run, fmt: str) -> str:
    """The comparison as --format says: its lines ('table'), a Markdown list ('markdown') or one JSON document
    (`comparison_json`)."""
    if fmt == "json":
        return comparison_json(found, base, cand)
    if fmt == "markdown":
        return "\n".join(f"- **{x}**" if x.startswith("REGRESSION") else f"- {x}" for x in found.lines)
    return "\n".join(found.lines)


def _pm(value: float | None, stderr: float | None) -> str:
    return "-" if value is None else f"{value:.4f}" + (f" ± {stderr:.4f}" if stderr is not None else "")


_BOTH_FAILED = object()


def _pair(metric: str, b: dict[str, float] | None, c: dict[str, float] | None, worst: float) -> Any:
    """One instance's (base, candidate) score of `metric`: a failed run's is `worst`; None where a run scored the
    instance without the metric, or both failed (left out)."""
    if b is None and c is None:
        return None
    if (b is not None and metric not in b) or (c is not None and metric not in c):
        return None
    return (worst if b is None else b[metric], worst if c is None else c[metric])


def task_delta(task: str, metric: str, base: TaskInstances, cand: TaskInstances) -> TaskDelta:
    """The paired test of one metric of a task over its instances: an instance that failed in one run (its program
    or score raised, its scores were NaN) counts as that metric's worst score there (0, or the lowest either run
    scored), so failures weigh against the run that has them; one that failed in both is left out."""
    values = [m[metric] for inst in (base, cand) for m in inst.scores.values() if m and metric in m]
    worst = min([0.0, *values])
    pairs, failed = [], [0, 0]
    for i, m in base.scores.items():
        pair = _pair(metric, m, cand.scores[i], worst) if i in cand.scores else None
        if pair is not None:
            pairs.append(pair)
            failed[0] += m is None
            failed[1] += cand.scores[i] is None
    b, c = [x for x, _ in pairs], [y for _, y in pairs]
    return TaskDelta(task, metric, paired_test(b, c), mean_stderr(b), mean_stderr(c), failed_base=failed[0],
                     failed_cand=failed[1], worst=worst)


def judge(deltas: list[TaskDelta], max_acc_drop: float | None, alpha: float) -> None:
    """Each delta's verdict: a regression when the candidate is lower and the test says so at `alpha` (its p,
    Holm-adjusted over every test of the comparison, below alpha: a suite of many tasks raises no more false
    alarms than one task), or it is lower by more than `max_acc_drop` (when given)."""
    tested = [d for d in deltas if d.paired.n]
    for d, adjusted in zip(tested, holm([d.paired.p for d in tested])):
        d.p_holm, d.tests = adjusted, len(tested)
    for d in deltas:
        why = []
        if d.paired.n and d.paired.delta < 0 and d.p_holm < alpha:
            holm_p = f", Holm-adjusted over {d.tests} tests {d.p_holm:.3g}" if d.tests > 1 else ""
            why.append(f"a significant drop (p {d.paired.p:.3g}{holm_p} < alpha {alpha:g})")
        if d.paired.n and max_acc_drop is not None and -d.paired.delta > max_acc_drop + _EPS:
            why.append(f"dropped by more than the {max_acc_drop:.4f} allowed")
        d.regression, d.why = bool(why), " and ".join(why)


def delta_line(d: TaskDelta) -> str:
    """'mmlu acc: candidate 0.3040 ± 0.0193 vs base 0.3100 ± 0.0194 (-0.0060 over 570 instances: 9 worse,
    6 better; McNemar mid-p p=0.61) ok', or REGRESSION ... and why."""
    p = d.paired
    if p.n == 0:
        return f"{d.task} {d.metric}: no instance scored in both runs, skipped"
    changed = f"{p.worse} worse, {p.better} better" if p.test == MCNEMAR else f"{p.worse} lower, {p.better} higher"
    failed = f"; failed, each scored {d.worst:g}: candidate {d.failed_cand}, base {d.failed_base}" \
        if d.failed_base or d.failed_cand else ""
    holm_p = f", Holm {d.p_holm:.3g}" if d.tests > 1 else ""
    desc = (f"candidate {_pm(p.cand, d.cand_stderr)} vs base {_pm(p.base, d.base_stderr)} ({p.delta:+.4f} over "
            f"{p.n} instances: {changed}; {p.test} p={p.p:.3g}{holm_p}{failed})")
    return f"REGRESSION {d.task} {d.metric}: {desc} {d.why}" if d.regression else f"{d.task} {d.metric}: {desc} ok"


def failures_line(task: str, n: int, base_failed: int, cand_failed: int) -> str | None:
    """A task's failed instances in both runs: more in the candidate is a regression of its own (whatever the
    scores say); None when neither run has any."""
    if not base_failed and not cand_failed:
        return None
    desc = f"candidate {cand_failed} of {n} instances failed, base {base_failed}"
    if cand_failed > base_failed:
        return f"REGRESSION {task} failed: {desc}: more instances failed (see instances.parquet's error column)"
    return f"{task} failed: {desc} ok"


def _compared_metrics(base: Run, cand: Run, task: str) -> list[str]:
    """The metrics a task is compared on (`TaskResult.decisive`): a tasks block's decide over those derived for
    a run without one; the base's, else the candidate's (a run that scored nothing has none)."""
    bt, ct = base.tasks.get(task), cand.tasks.get(task)
    if bt is None or ct is None:
        raise UserError(f"cannot compare: task {task!r} of the instances is not in the summary of "
                        f"{'base' if bt is None else 'candidate'}: not a run lmbatch wrote")
    declared = [t for r, t in ((base, bt), (cand, ct)) if "tasks" in r.summary and t.decisive()]
    return (declared[0] if declared else bt).decisive() or ct.decisive()


def _task_deltas(base: Run, cand: Run, max_acc_drop: float | None, alpha: float) -> tuple[list[TaskDelta], list[str]]:
    """Each task's decisive metrics compared instance by instance, and its failures."""
    assert base.instances is not None and cand.instances is not None
    diff = instance_differences(base.instances, cand.instances)
    if diff:
        raise UserError(f"cannot compare: base and candidate ran different instances ({'; '.join(diff[:3])}"
                        f"{'; ...' if len(diff) > 3 else ''})")
    deltas, skipped, failures = [], [], []
    for task, b_inst in base.instances.items():
        c_inst = cand.instances[task]
        metrics = _compared_metrics(base, cand, task)
        if not metrics:
            skipped.append(f"{task}: no metric recorded, skipped")
        deltas += [task_delta(task, metric, b_inst, c_inst) for metric in metrics]
        failures.append(failures_line(task, len(b_inst.scores), sum(m is None for m in b_inst.scores.values()),
                                      sum(m is None for m in c_inst.scores.values())))
    judge(deltas, max_acc_drop, alpha)
    return deltas, [delta_line(d) for d in deltas] + [x for x in failures if x] + skipped


def _legacy_accuracy(base: dict, cand: dict, max_acc_drop: float | None) -> list[str]:
    """The accuracy check of runs without per-instance results: an absolute drop of the summaries' accuracy, and
    their failed instances."""
    limit = LEGACY_MAX_ACC_DROP if max_acc_drop is None else max_acc_drop
    b_acc, c_acc = _get(base, "accuracy"), _get(cand, "accuracy")
    failed = failures_line(_get(cand, "task"), _get(cand, "counts.instances"),
                           _optional(base, "counts.failed_instances") or 0,
                           _optional(cand, "counts.failed_instances") or 0)
    extra = [failed] if failed else []
    if b_acc is None or c_acc is None:
        return ["accuracy: not recorded in both runs, skipped", *extra]
    drop = b_acc - c_acc
    desc = f"candidate {c_acc:.4f} vs base {b_acc:.4f} ({-drop:+.4f})"
    if drop > limit + _EPS:
        return [f"REGRESSION accuracy: {desc} dropped by more than the {limit:.4f} allowed", *extra]
    return [f"accuracy: {desc} ok", *extra]


# what must be the same for two runs' speeds to be compared: the device and how many of them ran
DEVICE = ("device", "data_parallel.workers", "data_parallel.tensor_parallel")


def _speed(base: dict, cand: dict, max_slowdown: float | None) -> str:
    """The execute phase's programs/s (summary.json's throughput: model work, not loading or start-up) of both
    runs; checked against `max_slowdown` only when given, and then only on the same device."""
    b_speed, c_speed = _get(base, "throughput.programs_per_s"), _get(cand, "throughput.programs_per_s")
    # one measure, both ways: how much slower the candidate is (base/cand - 1), or how much faster
    slowdown = b_speed / c_speed - 1 if c_speed > 0 else (0.0 if b_speed <= 0 else float("inf"))
    rel = f"{slowdown:.1%} slower" if slowdown > 0 else f"{c_speed / b_speed - 1 if b_speed > 0 else 0.0:.1%} faster"
    desc = f"candidate {c_speed:.3g} programs/s vs base {b_speed:.3g} (execute phase): {rel}"
    if max_slowdown is None:
        return f"speed: {desc}, not checked (--max-slowdown not given)"
    other = workload_differences(base, cand, DEVICE)
    if other:
        raise UserError(f"cannot check speed (--max-slowdown): base and candidate ran on other devices (base vs "
                        f"candidate: {'; '.join(other)}); compare speed between runs on the same device")
    if slowdown > max_slowdown + _EPS:
        return f"REGRESSION speed: {desc} (more than the {max_slowdown:.1%} allowed)"
    return f"speed: {desc} ok"


def _hit_rate(base: dict, cand: dict, min_hit_ratio: float) -> str:
    ratio = hit_ratio(cand)
    desc = (f"candidate {_get(cand, 'hit_rate'):.4f} of optimal {_get(cand, 'optimal_hit_rate'):.4f} "
            f"(ratio {ratio:.4f}, base {hit_ratio(base):.4f})")
    if ratio < min_hit_ratio - _EPS:
        return f"REGRESSION hit rate: {desc} is below the {min_hit_ratio:.4f} required"
    return f"hit rate: {desc} ok"


def compare_runs(base: Run | dict, cand: Run | dict, max_slowdown: float | None = None, min_hit_ratio: float = 0.99,
                 max_acc_drop: float | None = None, alpha: float = 0.05) -> Comparison:
    """Check candidate against base for accuracy, failure, cache-hit and (when asked) speed regressions.

    Hit rate is the whole run's; speed (only with `max_slowdown`, and on the same device) the execute phase's.
    Scores are each task's, on its instances: a paired test (`stats.paired_test`) of each metric it is compared
    on (`TaskResult.decisive`), an instance that failed in one run counting as the worst score there, flags a
    drop significant at `alpha`, or one larger than `max_acc_drop` when given; more failed instances in the
    candidate is a regression of its own. Runs without per-instance results (summaries alone) compare their
    accuracy against `max_acc_drop` (LEGACY_MAX_ACC_DROP if None). Limits are inclusive (exactly at a threshold
    passes). UserError if the thresholds are out of range or the runs are not comparable: other workloads
    (`workload_differences`), other instances (`instance_differences`).
    """
    check_thresholds(max_slowdown, min_hit_ratio, max_acc_drop, alpha)
    b, c = as_run(base), as_run(cand)
    _get(b.summary, "task"), _get(c.summary, "task")
    _get(b.summary, "counts.instances"), _get(c.summary, "counts.instances")
    diff = workload_differences(b.summary, c.summary)
    if diff:
        raise UserError(f"cannot compare: base and candidate ran different workloads (base vs candidate: "
                        f"{'; '.join(diff[:4])}{'; ...' if len(diff) > 4 else ''})")
    lines = [_speed(b.summary, c.summary, max_slowdown), _hit_rate(b.summary, c.summary, min_hit_ratio)]
    if b.instances is None or c.instances is None:
        return Comparison(lines + _legacy_accuracy(b.summary, c.summary, max_acc_drop), [])
    deltas, task_lines = _task_deltas(b, c, max_acc_drop, alpha)
    return Comparison(lines + task_lines, deltas)

