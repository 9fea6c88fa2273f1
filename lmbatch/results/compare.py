"""`lmbatch report --compare`: a candidate run checked against a base for regressions (docs/outputs.md): the
same workload and instances, hit rate, speed when asked, and each task's decisive metrics by a paired test on
the instances both ran (an instance that failed in one run counts as the worst score there)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Callable

from lmbatch.errors import UserError
from lmbatch.options import DECIDING
from lmbatch.results.runs import Run, TaskInstances, as_run, model_name
from lmbatch.results.stats import MCNEMAR, Paired, holm, mean_stderr, paired_test
from lmbatch.results.table import hit_ratio
from lmbatch.rundir.codec import ABSENT
from lmbatch.rundir.records import Summary

_EPS = 1e-9  # thresholds are inclusive: a value exactly at a limit (up to float noise) passes

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


def workload(s: Summary) -> dict[str, Any]:
    """What decides a run's workload (and so its accuracy and speed), by name: --compare refuses runs that
    differ in any of them both summaries record (ABSENT: one an older lmbatch did not). The model is compared
    by its folder's name (the same model lives at other paths on other machines), subjects as a set."""
    out: dict[str, Any] = {"task": s.task, "model": model_name(s.model),
                           "dtype": ABSENT if s.dtype is None else s.dtype, "instances": s.counts.instances}
    for name in DECIDING:
        value = s.option(name)
        out[name] = sorted(set(map(str, value))) if name == "subjects" and isinstance(value, list) else value
    return out


def device(s: Summary) -> dict[str, Any]:
    """What must be the same for two runs' speeds to be compared: the device and how many of them ran."""
    dp = s.data_parallel
    tp = None if dp is None else dp.tensor_parallel
    return {"device": s.device, "data_parallel.workers": ABSENT if dp is None else dp.workers,
            "data_parallel.tensor_parallel": ABSENT if tp is None else tp}


def workload_differences(base: Summary, cand: Summary,
                         fields: Callable[[Summary], dict[str, Any]] = workload) -> list[str]:
    """The fields (`workload`'s) in which the two runs differ, each as 'name base vs candidate' (a field one of
    them lacks, written by an older lmbatch, is not compared)."""
    b, c = fields(base), fields(cand)
    return [f"{name} {b[name]!r} vs {c[name]!r}" for name in b
            if b[name] is not ABSENT and c.get(name, ABSENT) is not ABSENT and b[name] != c[name]]


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
    declared = [t for r, t in ((base, bt), (cand, ct)) if r.summary.tasks is not None and t.decisive()]
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


def _legacy_accuracy(base: Summary, cand: Summary, max_acc_drop: float | None) -> list[str]:
    """The accuracy check of runs without per-instance results: an absolute drop of the summaries' accuracy, and
    their failed instances."""
    limit = LEGACY_MAX_ACC_DROP if max_acc_drop is None else max_acc_drop
    b_acc, c_acc = base.accuracy, cand.accuracy
    failed = failures_line(cand.task, cand.counts.instances, base.counts.failed_instances or 0,
                           cand.counts.failed_instances or 0)
    extra = [failed] if failed else []
    if b_acc is None or c_acc is None:
        return ["accuracy: not recorded in both runs, skipped", *extra]
    drop = b_acc - c_acc
    desc = f"candidate {c_acc:.4f} vs base {b_acc:.4f} ({-drop:+.4f})"
    if drop > limit + _EPS:
        return [f"REGRESSION accuracy: {desc} dropped by more than the {limit:.4f} allowed", *extra]
    return [f"accuracy: {desc} ok", *extra]


def _speed(base: Summary, cand: Summary, max_slowdown: float | None) -> str:
    """The execute phase's programs/s (summary.json's throughput: model work, not loading or start-up) of both
    runs; checked against `max_slowdown` only when given, and then only on the same device."""
    b_speed, c_speed = base.throughput.programs_per_s, cand.throughput.programs_per_s
    slowdown = b_speed / c_speed - 1 if c_speed > 0 else (0.0 if b_speed <= 0 else float("inf"))
    rel = f"{slowdown:.1%} slower" if slowdown > 0 else f"{c_speed / b_speed - 1 if b_speed > 0 else 0.0:.1%} faster"
    desc = f"candidate {c_speed:.3g} programs/s vs base {b_speed:.3g} (execute phase): {rel}"
    if max_slowdown is None:
        return f"speed: {desc}, not checked (--max-slowdown not given)"
    other = workload_differences(base, cand, device)
    if other:
        raise UserError(f"cannot check speed (--max-slowdown): base and candidate ran on other devices (base vs "
                        f"candidate: {'; '.join(other)}); compare speed between runs on the same device")
    if slowdown > max_slowdown + _EPS:
        return f"REGRESSION speed: {desc} (more than the {max_slowdown:.1%} allowed)"
    return f"speed: {desc} ok"


def _hit_rate(base: Summary, cand: Summary, min_hit_ratio: float) -> str:
    ratio = hit_ratio(cand)
    desc = (f"candidate {cand.hit_rate:.4f} of optimal {cand.optimal_hit_rate:.4f} "
            f"(ratio {ratio:.4f}, base {hit_ratio(base):.4f})")
    if ratio < min_hit_ratio - _EPS:
        return f"REGRESSION hit rate: {desc} is below the {min_hit_ratio:.4f} required"
    return f"hit rate: {desc} ok"


def compare_runs(base: Run | Summary | dict[str, Any], cand: Run | Summary | dict[str, Any],
                 max_slowdown: float | None = None, min_hit_ratio: float = 0.99, max_acc_drop: float | None = None,
                 alpha: float = 0.05) -> Comparison:
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
    diff = workload_differences(b.summary, c.summary)
    if diff:
        raise UserError(f"cannot compare: base and candidate ran different workloads (base vs candidate: "
                        f"{'; '.join(diff[:4])}{'; ...' if len(diff) > 4 else ''})")
    lines = [_speed(b.summary, c.summary, max_slowdown), _hit_rate(b.summary, c.summary, min_hit_ratio)]
    if b.instances is None or c.instances is None:
        return Comparison(lines + _legacy_accuracy(b.summary, c.summary, max_acc_drop), [])
    deltas, task_lines = _task_deltas(b, c, max_acc_drop, alpha)
    return Comparison(lines + task_lines, deltas)

