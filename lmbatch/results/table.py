"""`lmbatch report`'s table: a row per run, and one per task of a suite run (docs/outputs.md), each metric
with its standard error, as aligned text, Markdown or JSON."""

from __future__ import annotations

import json
from typing import Any, Iterable

from lmbatch.errors import UserError
from lmbatch.results.runs import Run, TaskResult, as_run, model_name, split_stderr
from lmbatch.results.task_results import STDERR
from lmbatch.rundir.codec import ABSENT
from lmbatch.rundir.records import Summary

FORMATS = ("table", "markdown", "json")
# a task's own metrics other than acc (HellaSwag's acc_norm, json's complete and valid) are columns too,
# after accuracy (`columns`)
COLUMNS = ("run_id", "task", "model", "shots", "dtype", "device", "instances", "failed", "accuracy", "hit_rate",
           "optimal_hit_rate", "hit_ratio", "execute_s", "programs_per_s",
           "prompt_tokens_per_s", "computed_tokens_per_s")
# Decimals shown per float column in the table and markdown formats (a metric's column: 4).
DECIMALS = {"accuracy": 4, "hit_rate": 4, "optimal_hit_rate": 4, "hit_ratio": 4, "execute_s": 2,
            "programs_per_s": 1, "prompt_tokens_per_s": 1, "computed_tokens_per_s": 1}


def hit_ratio(summary: Summary) -> float:
    """Achieved / optimal prefix-cache hit rate; 1.0 when the optimum is 0."""
    achieved, optimal = summary.hit_rate, summary.optimal_hit_rate
    return 1.0 if not optimal else achieved / optimal


def _metrics(s: Summary) -> dict[str, Any]:
    """A run's own metrics other than acc (its accuracy column), each a column of its own: HellaSwag's
    acc_norm, json's complete and valid. A metric named like a column is shown as metric:NAME."""
    out = {}
    for name, value in sorted(split_stderr(s.metrics or {})[0].items()):
        if name != "acc":
            out[f"metric:{name}" if name in COLUMNS else name] = value
    return out


def _run_stderr(run: Run) -> dict[str, Any]:
    """The standard error of each of a run's metrics: its summary's "NAME_stderr", else its one task's."""
    errors = split_stderr(run.summary.metrics or {})[1]
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
    errors = _run_stderr(run)
    # accuracy's own error where the summary has it (a suite's accuracy is over each task's primary metric)
    acc_stderr = errors.get("acc") if s.accuracy_stderr is ABSENT else s.accuracy_stderr
    return {
        "run_id": s.run_id,
        "task": s.task,
        "model": model_name(s.model),
        "shots": s.prompt_shots,       # a suite's: null if mixed
        "dtype": s.dtype,
        "device": s.device,
        "instances": s.counts.instances,
        "failed": s.counts.failed_instances,
        "accuracy": s.accuracy,
        "accuracy_stderr": acc_stderr if s.accuracy is not None else None,
        **_with_stderr(_metrics(s), errors),
        "hit_rate": s.hit_rate,
        "optimal_hit_rate": s.optimal_hit_rate,
        "hit_ratio": hit_ratio(s),
        "execute_s": s.execute_s,
        "programs_per_s": s.throughput.programs_per_s,
        "prompt_tokens_per_s": s.throughput.prompt_tokens_per_s,
        "computed_tokens_per_s": s.throughput.computed_tokens_per_s,
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


def report_rows(runs: Iterable[Run | Summary | dict[str, Any]]) -> list[dict[str, Any]]:
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


