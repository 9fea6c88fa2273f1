"""What a run reports: `summary.json` (docs/outputs.md), its closing line, and a dry run's figures."""
from __future__ import annotations

import datetime as dt
import os
import subprocess
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, NamedTuple

import lmbatch
from lmbatch.model.quantization import declared as checkpoint_quantization
from lmbatch.requests import RunStats, optimal_hit_rate
from lmbatch.results import task_results
from lmbatch.results.stats import mean_stderr
from lmbatch.rundir.codec import ABSENT
from lmbatch.rundir.records import (
    Attention,
    Counts,
    DataParallel,
    RunRecord,
    Stage,
    Summary,
    Threads,
    Throughput,
    Tokens,
    WorkerLoad,
)
from lmbatch.rundir.rows import InstanceRow
from lmbatch.timing import largest

if TYPE_CHECKING:
    from lmbatch.engine.options import EngineSpec
    from lmbatch.frontend.interpreter import Interpreter
    from lmbatch.frontend.tally import StageCounts
    from lmbatch.frontend.workload import Workload
    from lmbatch.model.config import ModelConfig
    from lmbatch.options import RunOptions
    from lmbatch.run.loading import Loaded
    from lmbatch.run.prepare import ModelFiles
    from lmbatch.rundir.rundir import Merged

MODEL_SIDE = ("spawn", "imports", "cuda_init", "helpers", "weights", "compile", "graphs", "tokenizer", "workers")


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(Path(lmbatch.__file__).parent), "rev-parse", "HEAD"],
                             capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _mean(values: Iterable[float]) -> float | None:
    values = list(values)
    return sum(values) / len(values) if values else None


def estimate_flops(cfg: ModelConfig, unique_tokens: int, attended_keys: int, logit_rows: int) -> float:
    """Model FLOPs of the planned prefill: the linear layers for every computed token (of an MoE layer
    the experts it is routed to), attention (QK and AV) over each computed token's keys, and the LM head
    at the positions that need logits."""
    d, q = cfg.hidden_size, cfg.num_heads * cfg.head_dim
    attention = cfg.num_layers * 4 * q * attended_keys
    return 2.0 * cfg.active_linear_params() * unique_tokens + attention + 2.0 * d * cfg.vocab_size * logit_rows


def dry_run(o: RunOptions, w: Workload, model: ModelFiles, tasks: dict[str, int], figures: dict[str, Any],
            time_s: dict[str, float]) -> dict[str, Any]:
    """The plan's figures for every first-stage call (later stages depend on generated text), over every
    task of the run at once (`tasks`: each one's instances)."""
    f, model_dir, cfg = figures, model.dir, model.shape
    return {"task": w.name, "model": str(model_dir), "shots": _shots(o, w), "instances": sum(tasks.values()),
            "tasks": tasks, "calls": f["calls"], "requests": f["requests"], "executed_requests": f["executed_requests"],
            "prompt_tokens": f["prompt_tokens"], "unique_tokens": f["unique_tokens"],
            "optimal_hit_rate": f["optimal_hit_rate"],
            "flops": estimate_flops(cfg, f["unique_tokens"], f["attended_keys"], f["logit_rows"]), "time_s": time_s}


def throughput(rows: list[InstanceRow], record: RunRecord) -> Throughput:
    """Rates over the whole run: every instance's tokens (of every attempt) over every attempt's seconds
    of execution (an attempt that was cut short counts up to its last part, as do its instances)."""
    ex = max(sum(0.0 if a.execute_s is ABSENT else a.execute_s for a in record.attempts), 1e-9)
    return Throughput(programs_per_s=len(rows) / ex,
                      prompt_tokens_per_s=sum(r.prompt_tokens for r in rows) / ex,
                      computed_tokens_per_s=sum(r.computed_tokens for r in rows) / ex,
                      decode_tokens_per_s=sum(r.decode_tokens for r in rows) / ex)


def _data_parallel(loaded: Loaded, stats: RunStats) -> DataParallel:
    """Workers and the devices each spans, and what decided them; the fewest tokens they had to compute
    between them (each its own chunks' optimum) and how many of those more than one worker computed (the
    prefixes their chunks share): the best hit rate they reach together; each worker's seconds busy and
    idle, tokens computed, chunks run and taken from another."""
    engine = loaded.engine
    unique = engine.optimal_unique_tokens()
    unique = stats.unique_tokens if unique is None else unique
    load = engine.load_report()
    return DataParallel(workers=engine.data_parallel, tensor_parallel=engine.tensor_parallel, why=loaded.layout,
                        duplicated_tokens=unique - stats.unique_tokens,
                        optimal_hit_rate=optimal_hit_rate(unique, stats.prompt_tokens),
                        workers_load=[WorkerLoad.from_json(w) for w in load] if load else ABSENT)


def _threads(loaded: Loaded) -> Threads | None:
    """A CPU engine's torch threads (engine/threads.py): given (--threads) or not, the most a batch may take,
    the policy, OpenMP's wait policy and how many forward batches ran on how many threads; a data-parallel
    run's workers keep theirs (given and wait policy only). None on CUDA."""
    if loaded.spec.device != "cpu":
        return None
    runner = getattr(loaded.engine, "model_runner", None)
    threads = getattr(runner, "threads", None)
    if threads is not None:
        return Threads.from_json(threads.describe())
    return Threads(given=loaded.spec.options.threads, wait_policy=os.environ.get("OMP_WAIT_POLICY", "unset"))


def _by_subject(ok: list[InstanceRow]) -> dict[str, list[float]]:
    """MMLU's acc by subject, of the instances scored."""
    by_subject = defaultdict(list)
    for r in ok:
        if r.subject and "acc" in r.metrics:
            by_subject[r.subject].append(r.metrics["acc"])
    return dict(sorted(by_subject.items()))


def _counts(rows: list[InstanceRow], interp: Interpreter, attempt: int) -> Counts:
    stats = interp.stats
    return Counts(instances=len(rows), failed_instances=sum(r.error is not None for r in rows),
                  scored_instances=sum(r.error is None for r in rows),
                  calls=sum(c.calls for c in interp.stages.values()), requests=stats.requests,
                  executed_requests=stats.executed, waves=interp.waves, truncated_calls=interp.truncated,
                  resumed_instances=sum(r.attempt < attempt for r in rows))


def _stage(c: StageCounts) -> Stage:
    return Stage(calls=c.calls, requests=c.requests, prompt_tokens=c.prompt_tokens, cached_tokens=c.cached_tokens,
                 computed_tokens=c.computed_tokens, decode_tokens=c.decode_tokens)


def _shots(o: RunOptions, w: Workload) -> int | None:
    """The few-shot examples the prompts hold: a suite's, where every task ran with the same (OLMES's fixed
    5 and `--shots 5`: 5); None where its tasks differ."""
    if w.tasks is None or w.fixed_shots is not None:
        return w.shots(o.workload.shots)
    each = {t.shots(o.workload.shots) for t in w.tasks.values()}
    return each.pop() if len(each) == 1 else None


class RunFacts(NamedTuple):
    """What a summary says of the run beside its results: its id, its phases' seconds, and where its
    workload came from ("cache", "child" or "here")."""
    run_id: str
    time_s: dict[str, float]
    workload: str


def build(o: RunOptions, w: Workload, loaded: Loaded, merged: Merged, interp: Interpreter,
          facts: RunFacts) -> Summary:
    """summary.json of a completed run (`merged`: every instance's row, of every attempt, and run.json).
    Each metric's mean is over the instances that have it, with its standard error (a failed instance has
    none: `metric_counts` says how many each mean is over); accuracy is the mean of each instance's primary
    metric (its task's, in a suite)."""
    stats, engine, spec, tally = interp.stats, loaded.engine, loaded.spec, interp.tally
    rows, record = merged
    ok = [r for r in rows if r.error is None]
    primary, subjects = task_results.accuracy(w, rows), _by_subject(ok)
    return Summary(
        run_id=facts.run_id, task=w.name, shots=_shots(o, w),
        created=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        lmbatch_version=lmbatch.__version__, git_commit=_git_commit(), model=spec.model_dir, device=spec.device,
        dtype=spec.dtype, model_type=engine.cfg.model_type,
        model_runtime=engine.cfg.runtime,       # "native": our network; "transformers": the fallback
        quantization=quantization(spec, engine.cfg.runtime),
        attention=Attention(loaded.attention.name, loaded.attention.why), workload=facts.workload,
        max_tokens_per_batch=spec.options.max_tokens_per_batch, kv_cache_tokens=spec.options.kv_cache_tokens,
        threads=_threads(loaded),
        options={k: (str(v) if isinstance(v, Path) else v) for k, v in o.flat().items()},
        counts=_counts(rows, interp, len(record.attempts)),
        accuracy=_mean(primary), accuracy_stderr=mean_stderr(primary),
        metrics=task_results.metrics_block([r.metrics for r in ok]),
        metric_counts={k: sum(k in r.metrics for r in ok) for k in sorted({k for r in ok for k in r.metrics})},
        accuracy_by_subject={s: sum(v) / len(v) for s, v in subjects.items()},
        accuracy_by_subject_counts={s: len(v) for s, v in subjects.items()},
        warnings=task_results.warnings(rows), tasks=task_results.tasks_block(w, rows, tally.tasks, tally.task_unique),
        tokens=Tokens(prompt=stats.prompt_tokens, cached=stats.cached_tokens, computed=stats.computed_tokens,
                      unique=stats.unique_tokens, decode=stats.decode_tokens, thinking=tally.think_tokens),
        hit_rate=stats.hit_rate, optimal_hit_rate=stats.optimal_hit_rate,
        prompt_tree_optimal_hit_rate=interp.prompt_tree_optimal_hit_rate,
        stages={str(k): _stage(v) for k, v in sorted(interp.stages.items())},
        evicted_tokens=stats.evicted_tokens, forward_batches=stats.forward_batches,
        # phases from the process's start on its main line; "load" is what the run waited for the model,
        # "load_background" what building it took on its thread (beside data, tokenize and plan), by step
        time_s={**facts.time_s, **loaded.seconds}, throughput=throughput(rows, record), attempts=record.attempts,
        data_parallel=_data_parallel(loaded, stats), deterministic=_deterministic(spec))


def quantization(spec: EngineSpec, runtime: str) -> dict[str, Any] | None:
    """The checkpoint's quantization (None: unquantized) and how this run ran its weights: FP8 GEMMs, or
    dequantized to the run's dtype as they loaded (model/quantization.py)."""
    declared = checkpoint_quantization(Path(spec.model_dir))
    if declared is None:
        return None
    run_as = "loaded by transformers (the fallback)" if runtime != "native" else \
        "FP8 GEMMs (activations quantized as they run); the rest dequantized on load" if spec.options.fp8_gemm \
        else f"dequantized to {spec.dtype} on load"
    return {**declared, "run_as": run_as}


def _deterministic(spec: EngineSpec) -> dict[str, Any] | None:
    """What --deterministic holds this run to (None: off): the same bits whatever the batch budget, pool,
    cache, workers, schedule, resume point or suite, on this device kind, tensor-parallel degree and these
    library versions; another tensor-parallel degree sums across devices in another order."""
    if not spec.options.deterministic:
        return None
    return {"same_bits_across": ["max_tokens_per_batch", "kv_cache_tokens", "cache", "data_parallel", "schedule",
                                 "resume", "suite"],
            "given": {"device": spec.device, "dtype": spec.dtype, "tensor_parallel": spec.ranks}}


def _scores(summary: Summary) -> str:
    """The task's own metrics (MMLU: acc; HellaSwag: acc and acc_norm; json: complete and valid; a suite:
    each task's primary metric) and what they are over: every instance, or those that did not fail."""
    counts = summary.counts
    failed, n = counts.failed_instances or 0, counts.instances
    tasks = summary.tasks or {}
    if len(tasks) > 1:
        picked = {k: v.metrics.get(v.primary_metric or "") for k, v in tasks.items()}
        shown = "  ".join(f"{k} {v:.4f}" for k, v in picked.items() if v is not None)
        over = {n - failed}
    else:
        shown = "  ".join(f"{k} {v:.4f}" for k, v in (summary.metrics or {}).items()
                          if v is not None and not k.endswith(task_results.STDERR))
        over = set((summary.metric_counts or {}).values())
    if shown and over != {n}:
        shown += f" over {max(over)} of {n} instances"
    return (f"  {shown}" if shown else "") + (f"  {failed} FAILED (see the error column)" if failed else "")


def closing_line(summary: Summary) -> str:
    """What a run says as it ends: what ran (task, shots, model, dtype, device), instances, the task's
    metrics and what they are over, hit rate and its optimum, where the time went."""
    counts, t = summary.counts, summary.time_s
    resumed = counts.resumed_instances
    side = largest(t, 2, MODEL_SIDE)
    runtime = f"{'native' if summary.model_runtime == 'native' else f'{summary.model_runtime} fallback'} " \
              f"{summary.model_type}"
    shots = summary.prompt_shots
    what = f"{summary.task}{'' if shots is None else f' {shots}-shot'} {Path(summary.model).name} " \
           f"{summary.dtype} {summary.device}"
    return (f"{what}: {counts.instances} instances" + (f" ({resumed} from earlier attempts)" if resumed else "")
            + _scores(summary)
            + f"  hit rate {summary.hit_rate:.4f} (optimum {summary.optimal_hit_rate:.4f})  wall "
            f"{t['total']:.1f}s ({largest(t)}" + (f"; model side {side}" if side else "") + ")"
            + _workers(summary.data_parallel, summary.device) + f"  {runtime}"
            + "".join(f"  WARNING: {w}" for w in summary.warnings or []))


def _workers(dp: DataParallel | None, device: str) -> str:
    """'  4 workers busy 96-99%': how evenly the work fell (nothing for one engine); a worker's tensor-parallel
    ranks are GPUs on CUDA, processes sharing the CPU on the CPU."""
    load = [] if dp is None or dp.workers_load is ABSENT else dp.workers_load
    if dp is None or not load:
        return ""
    busy = [w.busy_s / (w.busy_s + w.idle_s) if w.busy_s + w.idle_s > 0 else 0.0 for w in load]
    t = dp.tensor_parallel or 1
    tp = "" if t <= 1 else f" x {t} GPUs" if device.startswith("cuda") else f" x {t} CPU processes"
    return f"  {len(load)} worker{'s' if len(load) > 1 else ''}{tp} busy {min(busy):.0%}-{max(busy):.0%}"
