"""Metrics as summary.json reports them: each metric's mean over instances with its standard error, and
the `tasks` block, one entry per task of the run (one for a single task, one per task of a suite).

A standard error is lm-eval's for a mean of per-instance scores (`stats.mean_stderr`): the sample
standard deviation over the square root of the count; null where fewer than two instances have the metric.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from lmbatch.requests import TokenCounts, optimal_hit_rate
from lmbatch.results.stats import mean_stderr
from lmbatch.rundir.records import TaskBlock
from lmbatch.rundir.rows import InstanceRow

if TYPE_CHECKING:
    from lmbatch.frontend.workload import Workload

STDERR = "_stderr"          # the suffix of a metric's standard error in a metrics block


def metrics_block(scores: list[dict[str, float]]) -> dict[str, float | None]:
    """Each metric's mean over the instances' scores that have it, then its standard error (`<metric>_stderr`)."""
    names = sorted({k for m in scores for k in m})
    out: dict[str, float | None] = {}
    for k in names:
        values = [m[k] for m in scores if k in m]
        out[k] = sum(values) / len(values)
        out[k + STDERR] = mean_stderr(values)
    return out


# An instance whose scores are NaN (a model with NaN weights, say) failed: its error starts so, and the run warns.
NAN_ERROR = "score: NaN"


def declared_metric(w: Workload, task: str) -> str | None:
    """The primary metric a task's workload declares (a suite's task: its own); None for a task with its own
    metrics (json, a program file)."""
    return w.tasks[task].primary_metric if w.tasks is not None and task in w.tasks else w.primary_metric


def carried(rows: list[InstanceRow], task: str) -> list[str]:
    """The metrics a task's scored instances carry, by name."""
    return sorted({k for r in rows if r.task == task and r.error is None for k in r.metrics})


def primary_metric(w: Workload, task: str, rows: list[InstanceRow]) -> str | None:
    """The metric a task's accuracy is: the one its workload declares (acc; an OLMES task's config's), else the
    first (by name) its instances carry (json: complete; a program file's own); None if they carry none."""
    declared = declared_metric(w, task)
    if declared is not None:
        return declared
    names = carried(rows, task)
    return names[0] if names else None


def compared_metrics(w: Workload, task: str, rows: list[InstanceRow]) -> list[str]:
    """The metrics `lmbatch report --compare` tests a task on: the declared primary one, else every one its
    instances carry (json: complete and valid; a program file's: all of its own)."""
    declared = declared_metric(w, task)
    return [declared] if declared is not None else carried(rows, task)


def task_names(w: Workload, rows: list[InstanceRow]) -> list[str]:
    """The run's tasks: a suite's in its order, else the workload's own (and any other a row names)."""
    names = list(w.tasks) if w.tasks is not None else [w.name]
    return names + sorted({r.task for r in rows} - set(names))


def tasks_block(w: Workload, rows: list[InstanceRow], tokens: dict[str, TokenCounts],
                unique: dict[str, int]) -> dict[str, TaskBlock]:
    """summary.json's `tasks`: per task, its instances and failures (of every attempt), its primary
    metric and those a comparison tests, its metrics with their standard errors, and this attempt's tokens and
    hit rates (`tokens`, `unique`: by task, from the interpreter's tally)."""
    out = {}
    for task in task_names(w, rows):
        mine = [r for r in rows if r.task == task]
        t = tokens.get(task, TokenCounts())
        out[task] = TaskBlock(n=len(mine), failed=sum(r.error is not None for r in mine),
                              primary_metric=primary_metric(w, task, rows),
                              compared_metrics=compared_metrics(w, task, rows),
                              metrics=dict(metrics_block([r.metrics for r in mine if r.error is None])),
                              prompt_tokens=t.prompt_tokens, cached_tokens=t.cached_tokens,
                              computed_tokens=t.computed_tokens,
                              hit_rate=t.cached_tokens / t.prompt_tokens if t.prompt_tokens else 0.0,
                              optimal_hit_rate=optimal_hit_rate(unique.get(task, 0), t.prompt_tokens))
    return out


def accuracy(w: Workload, rows: list[InstanceRow]) -> list[float]:
    """Each scored instance's value of its task's primary metric (the run's accuracy is their mean)."""
    values = []
    primary = {task: primary_metric(w, task, rows) for task in {r.task for r in rows}}
    for r in rows:
        metric = primary[r.task]
        if r.error is None and metric is not None and metric in r.metrics:
            values.append(r.metrics[metric])
    return values


def warnings(rows: list[InstanceRow]) -> list[str]:
    """What the run's closing line and summary.json warn of: instances whose scores were NaN."""
    nan = sum(r.error is not None and r.error.startswith(NAN_ERROR) for r in rows)
    if not nan:
        return []
    return [f"{nan} of {len(rows)} instances scored NaN and count as failed: the model computes NaN (its weights, "
            "or its numerics in this dtype, are broken)"]
