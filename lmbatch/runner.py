"""`lmbatch run`: load a task's instances, plan and execute them, write the run directory."""
from __future__ import annotations

import datetime as dt
import json
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

import lmbatch
from lmbatch.errors import UserError
from lmbatch.outputs import INSTANCE_SCHEMA, atomic_dir, request_schema, write_json, write_parquet
from lmbatch.program import LoadArgs, Workload
from lmbatch.tasks import get_workload

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class RunOptions:
    task: str
    shots: int = 0
    model: str | None = None
    limit: int | None = None
    subjects: list[str] | None = None
    device: str = "cpu"
    dtype: str | None = None
    max_tokens_per_batch: int = 4096
    kv_cache_tokens: int | None = None
    schedule: str = "dfs"
    no_cache: bool = False
    seed: int = 0
    out: Path = Path("results")
    run_id: str | None = None
    overwrite: bool = False
    truncate_left: bool = False
    save_token_ids: bool = False
    quiet: bool = False
    jump_forward: bool = True


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(Path(lmbatch.__file__).parent), "rev-parse", "HEAD"],
                             capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _check(o: RunOptions, w: Workload) -> tuple[torch.dtype, str]:
    if w.max_shots is not None and (o.shots < 0 or o.shots > w.max_shots):
        raise UserError(f"--shots {o.shots} is out of range: {w.name} takes 0 to {w.max_shots} few-shot examples")
    if o.shots < 0:
        raise UserError("--shots must be at least 0")
    if o.subjects and not w.subjects:
        raise UserError(f"--subjects applies to mmlu only, not to {w.name}")
    if o.limit is not None and o.limit < 1:
        raise UserError("--limit must be at least 1")
    if o.device not in ("cpu", "cuda"):
        raise UserError(f"--device {o.device}: use cpu or cuda")
    if o.device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA GPU is visible here")
    dtype_name = o.dtype or ("float32" if o.device == "cpu" else "bfloat16")
    if dtype_name not in DTYPES:
        raise UserError(f"--dtype {dtype_name}: use one of {', '.join(DTYPES)}")
    if o.max_tokens_per_batch < 1:
        raise UserError("--max-tokens-per-batch must be at least 1")
    from lmbatch.scheduler.planner import SCHEDULES
    if o.schedule not in SCHEDULES:
        raise UserError(f"--schedule {o.schedule}: use one of {', '.join(SCHEDULES)}")
    return DTYPES[dtype_name], dtype_name


def _kv_tokens(o: RunOptions, cfg, dtype: torch.dtype, longest: int) -> int:
    """Default pool: 4 GiB of KV on CPU; on CUDA half the free memory, at most 131072 tokens (DFS needs
    only its working set, and a compact pool measured faster); never under one request + a batch."""
    need = longest + o.max_tokens_per_batch
    if o.kv_cache_tokens is not None:
        if o.kv_cache_tokens < need:
            raise UserError(f"--kv-cache-tokens {o.kv_cache_tokens} is too small: the longest prompt ({longest}) "
                            f"plus one batch ({o.max_tokens_per_batch}) needs {need}")
        return o.kv_cache_tokens
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * torch.finfo(dtype).bits // 8
    budget = 4 << 30 if o.device == "cpu" else torch.cuda.mem_get_info()[0] // 2
    return max(need, min(budget // per_token, 1 << 20 if o.device == "cpu" else 1 << 17))


def run(o: RunOptions) -> Path:
    from transformers import AutoTokenizer

    from lmbatch.config import ModelConfig
    from lmbatch.engine import Engine
    from lmbatch.interpreter import Interpreter
    from lmbatch.models import resolve_model

    t0 = time.perf_counter()
    w = get_workload(o.task)
    dtype, dtype_name = _check(o, w)
    model_dir = resolve_model(o.model)
    run_id = o.run_id or "{}-{}shot-{}-{}".format(w.name, o.shots, model_dir.name,
                                                  dt.datetime.now().strftime("%Y%m%d-%H%M%S"))
    final = Path(o.out) / run_id
    if final.exists() and not o.overwrite:
        raise UserError(f"output directory {final} exists; pass --overwrite to replace it or --run-id to name another")
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    cfg = ModelConfig.from_dir(model_dir)
    instances = w.instances(LoadArgs(tokenizer, o.shots, o.limit, o.subjects, o.seed))
    if not instances:
        raise UserError(f"{w.name} has no instances to run")
    interp = Interpreter(tokenizer, max_len=cfg.max_position_embeddings, schedule=o.schedule, seed=o.seed,
                         truncate_left=o.truncate_left, progress=_progress_bar(len(instances), o.quiet),
                         vocab_size=cfg.vocab_size, jump_forward=o.jump_forward)
    interp.start(w.program, instances)       # every first-stage call, before any model work
    engine = Engine.from_pretrained(model_dir, device=o.device, dtype=dtype, tokenizer=tokenizer,
                                    kv_cache_tokens=_kv_tokens(o, cfg, dtype, interp.longest_ready()),
                                    max_tokens_per_batch=o.max_tokens_per_batch, cache=not o.no_cache,
                                    jump_forward=o.jump_forward)
    t_load = time.perf_counter() - t0
    runs = interp.execute(engine)
    t_total = time.perf_counter() - t0
    rows = _instance_rows(w, runs)
    summary = _summary(o, w, run_id, model_dir, dtype_name, rows, interp, t_load, t_total)
    with atomic_dir(final, o.overwrite) as tmp:
        write_parquet(tmp / "instances.parquet", rows, INSTANCE_SCHEMA)
        req_rows = interp.request_rows if o.save_token_ids else [
            {k: v for k, v in r.items() if k != "token_ids"} for r in interp.request_rows]
        write_parquet(tmp / "requests.parquet", req_rows, request_schema(o.save_token_ids))
        write_json(tmp / "summary.json", summary)
    if not o.quiet:
        acc = "" if summary["accuracy"] is None else f"accuracy {summary['accuracy']:.4f}  "
        failed = summary["counts"]["failed_instances"]
        print(f"{len(rows)} instances  {acc}hit rate {summary['hit_rate']:.4f} (optimum "
              f"{summary['optimal_hit_rate']:.4f})  execute {summary['time_s']['execute']:.1f}s"
              + (f"  {failed} FAILED (see the error column)" if failed else "") + f"  -> {final}", file=sys.stderr)
    return final


def _progress_bar(total: int, quiet: bool):
    if quiet:
        return None
    from tqdm import tqdm

    bar = tqdm(total=total, unit="prog", desc="programs", dynamic_ncols=True)
    start = time.perf_counter()

    def update(i: int, stats) -> None:
        bar.update(1)
        seen = stats.cached_tokens + stats.computed_tokens
        bar.set_postfix(hit=f"{stats.cached_tokens / max(seen, 1):.4f}",
                        tok_s=f"{stats.computed_tokens / max(time.perf_counter() - start, 1e-9):.0f}", refresh=False)
        if bar.n == bar.total:
            bar.close()
    return update


def _jsonable(v):
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    return v if isinstance(v, (str, int, float, bool)) or v is None else str(v)


def _instance_rows(w: Workload, runs) -> list[dict]:
    rows = []
    for run in runs:
        s, inst, error, metrics = run.state, run.instance, run.error, {}
        if error is None and w.score is not None:
            try:
                metrics = {k: float(v) for k, v in w.score(inst, s).items()}
            except Exception as e:  # the user's scoring code: kept with its instance
                error = f"score: {type(e).__name__}: {e}"
        ans = s.meta(w.answer) if w.answer and w.answer in s and run.error is None else None
        t = run.tokens
        rows.append(dict(task=w.name, subject=inst.subject, id=inst.id,
                         prediction=None if ans is None else ans["index"],
                         gold=None if inst.gold is None else str(inst.gold),
                         correct=bool(metrics["acc"]) if "acc" in metrics else None,
                         logprobs=[] if ans is None else ans["logprobs"],
                         is_greedy=[] if ans is None else ans["is_greedy"],
                         metrics=metrics, outputs=json.dumps(_jsonable(s.variables())), error=error,
                         prompt_tokens=t.prompt_tokens, cached_tokens=t.cached_tokens,
                         computed_tokens=t.computed_tokens, decode_tokens=t.decode_tokens))
    return rows


def _mean(values) -> float | None:
    values = list(values)
    return sum(values) / len(values) if values else None


def _summary(o, w, run_id, model_dir, dtype_name, rows, interp, t_load, t_total) -> dict:
    stats = interp.stats
    ok = [r for r in rows if r["error"] is None]
    names = sorted({k for r in ok for k in r["metrics"]})
    by_subject = defaultdict(list)
    for r in ok:
        if r["subject"] and "acc" in r["metrics"]:
            by_subject[r["subject"]].append(r["metrics"]["acc"])
    ex = max(stats.execute_s, 1e-9)
    options = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(o).items()}
    return {
        "run_id": run_id,
        "task": w.name,
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "lmbatch_version": lmbatch.__version__,
        "git_commit": _git_commit(),
        "model": str(model_dir),
        "device": o.device,
        "dtype": dtype_name,
        "options": options,
        "counts": {"instances": len(rows), "failed_instances": len(rows) - len(ok),
                   "calls": sum(c.calls for c in interp.stages.values()), "requests": stats.requests,
                   "executed_requests": stats.executed, "waves": interp.waves,
                   "truncated_calls": interp.truncated},
        "accuracy": _mean(r["metrics"]["acc"] for r in ok if "acc" in r["metrics"]),
        "metrics": {k: _mean(r["metrics"][k] for r in ok if k in r["metrics"]) for k in names},
        "accuracy_by_subject": {s: sum(v) / len(v) for s, v in sorted(by_subject.items())},
        "tokens": {"prompt": stats.prompt_tokens, "cached": stats.cached_tokens, "computed": stats.computed_tokens,
                   "unique": stats.unique_tokens, "decode": stats.decode_tokens},
        "hit_rate": stats.hit_rate,
        "optimal_hit_rate": stats.optimal_hit_rate,
        "prompt_tree_optimal_hit_rate": interp.prompt_tree_optimal_hit_rate,
        "stages": {str(k): asdict(v) for k, v in sorted(interp.stages.items())},
        "evicted_tokens": stats.evicted_tokens,
        "forward_batches": stats.forward_batches,
        "time_s": {"load": t_load, "plan": stats.plan_s, "execute": stats.execute_s, "total": t_total},
        "throughput": {"programs_per_s": len(rows) / ex, "prompt_tokens_per_s": stats.prompt_tokens / ex,
                       "computed_tokens_per_s": stats.computed_tokens / ex,
                       "decode_tokens_per_s": stats.decode_tokens / ex},
    }
