"""`lmbatch run`: load a task's instances, plan and execute them, write the run directory."""
from __future__ import annotations

import datetime as dt
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
from lmbatch.tasks import ChoiceInstance, get_task

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


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(Path(lmbatch.__file__).parent), "rev-parse", "HEAD"],
                             capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _check(o: RunOptions) -> tuple[torch.dtype, str]:
    task = get_task(o.task)
    if o.shots < 0 or o.shots > task.max_shots:
        raise UserError(f"--shots {o.shots} is out of range: {o.task} has {task.max_shots} few-shot examples per subject")
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


def _check_lengths(instances: list[ChoiceInstance], max_len: int, truncate: bool) -> int:
    cut = 0
    for inst in instances:
        longest = len(inst.context) + max(len(c) for c in inst.continuations)
        if longest > max_len:
            if not truncate:
                raise UserError(f"instance {inst.id} has a {longest}-token prompt, longer than the model's "
                                f"{max_len}-token context; pass --truncate-left to drop its oldest tokens (as lm-eval does)")
            cut += inst.truncate_left(max_len)
    return cut


def run(o: RunOptions) -> Path:
    from transformers import AutoTokenizer

    from lmbatch.config import ModelConfig
    from lmbatch.engine import Engine
    from lmbatch.models import resolve_model

    t0 = time.perf_counter()
    dtype, dtype_name = _check(o)
    model_dir = resolve_model(o.model)
    run_id = o.run_id or "{}-{}shot-{}-{}".format(o.task, o.shots, model_dir.name,
                                                  dt.datetime.now().strftime("%Y%m%d-%H%M%S"))
    final = Path(o.out) / run_id
    if final.exists() and not o.overwrite:
        raise UserError(f"output directory {final} exists; pass --overwrite to replace it or --run-id to name another")
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    cfg = ModelConfig.from_dir(model_dir)
    instances = get_task(o.task).build(tokenizer, o.shots, o.limit, o.subjects)
    truncated = _check_lengths(instances, cfg.max_position_embeddings, o.truncate_left)
    requests, owner = [], []
    for k, inst in enumerate(instances):
        for choice, req in enumerate(inst.requests()):
            requests.append(req)
            owner.append((k, choice))
    longest = max(len(r.tokens) for r in requests)
    engine = Engine.from_pretrained(model_dir, device=o.device, dtype=dtype, tokenizer=tokenizer,
                                    kv_cache_tokens=_kv_tokens(o, cfg, dtype, longest),
                                    max_tokens_per_batch=o.max_tokens_per_batch, cache=not o.no_cache)
    t_load = time.perf_counter() - t0
    results, stats = engine.score(requests, schedule=o.schedule, seed=o.seed,
                                  progress=_progress_bar(instances, owner, o.quiet))
    t_total = time.perf_counter() - t0
    rows = _instance_rows(instances, owner, results)
    summary = _summary(o, run_id, model_dir, dtype_name, rows, len(requests), stats, t_load, t_total, truncated)
    with atomic_dir(final, o.overwrite) as tmp:
        write_parquet(tmp / "instances.parquet", rows, INSTANCE_SCHEMA)
        write_parquet(tmp / "requests.parquet", _request_rows(instances, owner, requests, results, stats,
                                                              o.save_token_ids), request_schema(o.save_token_ids))
        write_json(tmp / "summary.json", summary)
    if not o.quiet:
        print(f"{summary['counts']['instances']} instances  accuracy {summary['accuracy']:.4f}  "
              f"hit rate {stats.hit_rate:.4f} (optimum {stats.optimal_hit_rate:.4f})  "
              f"execute {stats.execute_s:.1f}s  -> {final}", file=sys.stderr)
    return final


def _progress_bar(instances, owner, quiet: bool):
    if quiet:
        return None
    from tqdm import tqdm

    bar = tqdm(total=len(instances), unit="prog", desc="programs", dynamic_ncols=True)
    left = [len(inst.continuations) for inst in instances]
    start = time.perf_counter()

    def update(i: int, stats) -> None:
        k = owner[i][0]
        left[k] -= 1
        if left[k] == 0:
            bar.update(1)
            seen = stats.cached_tokens + stats.computed_tokens
            bar.set_postfix(hit=f"{stats.cached_tokens / max(seen, 1):.4f}",
                            tok_s=f"{stats.computed_tokens / max(time.perf_counter() - start, 1e-9):.0f}",
                            refresh=False)
        if bar.n == bar.total:
            bar.close()
    return update


def _instance_rows(instances, owner, results) -> list[dict]:
    per = defaultdict(list)
    for (k, _), res in zip(owner, results):
        per[k].append(res)
    rows = []
    for k, inst in enumerate(instances):
        res = per[k]
        pred = inst.prediction(res)
        rows.append(dict(task=inst.task, subject=inst.subject, id=inst.id, prediction=pred, gold=inst.gold,
                         correct=pred == inst.gold, logprobs=[r.logprob for r in res],
                         is_greedy=[r.is_greedy for r in res],
                         prompt_tokens=sum(r.prompt_tokens for r in res),
                         cached_tokens=sum(r.cached_tokens for r in res),
                         computed_tokens=sum(r.computed_tokens for r in res)))
    return rows


def _request_rows(instances, owner, requests, results, stats, with_tokens: bool) -> list[dict]:
    """One row per executed request, in execution order (choices with equal prompts ran once)."""
    rows = []
    for n, j in enumerate(stats.order):
        r = results[j]
        row = dict(order=n, instance_id=instances[owner[j][0]].id, choices=[owner[i][1] for i in stats.members[j]],
                   prompt_tokens=r.prompt_tokens, cached_tokens=r.cached_tokens, computed_tokens=r.computed_tokens)
        if with_tokens:
            row["token_ids"] = requests[j].prompt
        rows.append(row)
    return rows


def _summary(o, run_id, model_dir, dtype_name, rows, n_requests, stats, t_load, t_total, truncated) -> dict:
    by_subject = defaultdict(list)
    for r in rows:
        by_subject[r["subject"]].append(r["correct"])
    ex = max(stats.execute_s, 1e-9)
    options = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(o).items()}
    return {
        "run_id": run_id,
        "task": o.task,
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "lmbatch_version": lmbatch.__version__,
        "git_commit": _git_commit(),
        "model": str(model_dir),
        "device": o.device,
        "dtype": dtype_name,
        "options": options,
        "counts": {"instances": len(rows), "requests": n_requests, "executed_requests": stats.executed,
                   "truncated_instances": truncated},
        "accuracy": sum(r["correct"] for r in rows) / len(rows),
        "accuracy_by_subject": {s: sum(v) / len(v) for s, v in sorted(by_subject.items())},
        "tokens": {"prompt": stats.prompt_tokens, "cached": stats.cached_tokens, "computed": stats.computed_tokens,
                   "unique": stats.unique_tokens, "decode": stats.decode_tokens},
        "hit_rate": stats.hit_rate,
        "optimal_hit_rate": stats.optimal_hit_rate,
        "engine_optimal_hit_rate": stats.engine_optimal_hit_rate,
        "evicted_tokens": stats.evicted_tokens,
        "forward_batches": stats.forward_batches,
        "time_s": {"load": t_load, "plan": stats.plan_s, "execute": stats.execute_s, "total": t_total},
        "throughput": {"programs_per_s": len(rows) / ex, "prompt_tokens_per_s": stats.prompt_tokens / ex,
                       "computed_tokens_per_s": stats.computed_tokens / ex},
    }
