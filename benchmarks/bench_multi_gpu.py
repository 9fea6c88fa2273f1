"""More than one GPU, end to end (issue 46's table): each job run by `lmbatch run` (or `lmbatch lm-eval`)
with one engine and with 2 or 4 data-parallel workers, each run a fresh process timed by this parent
from spawn to exit, side by side in one call, with the run's own phases (`summary.json` `time_s`) and
each worker's busy and idle seconds (`data_parallel.workers_load`).

    python benchmarks/bench_multi_gpu.py --tokenizer TOK --out $OUT --jobs mmlu-8b,mmlu-1.5b,olmes-1.5b:1/4
    # TOK: a tokenizer folder (the embedded SmolLM2's files); random bf16 weights of presets/qwen2.5-1.5b
    # (1.5b) and qwen3-8b (8b) written by bench_fixed_costs.write_random_checkpoint; writes $OUT/multi.jsonl,
    # a line per run as it ends (a call cut short keeps what it measured)

Jobs: mmlu (full, 5-shot), olmes (the suite), tot (tot-gsm8k, all 1,319), small (mmlu --limit 5: what a
job too small for several GPUs pays), lmeval (lm-eval's gsm8k through `lmbatch lm-eval`, generate_until,
needs lm-eval), each as JOB-SIZE[:W/W...][@R] (its worker counts, else --workers; its rounds, else
--repeat). Before a job's runs, a run
of one MMLU question compiles the kernels for the model's shape, and the job's workload is put into the
workload cache (a dry run), as a repeated evaluation finds both; then `--repeat` rounds of every worker
count, alternating.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_fixed_costs import cli, lmbatch, record, timed, write_random_checkpoint  # noqa: E402

PRESETS = {"1.5b": "qwen2.5-1.5b", "8b": "qwen3-8b"}
TASKS = {"mmlu": ("mmlu", 5, []), "olmes": ("olmes", None, []), "tot": ("tot-gsm8k", None, []),
         "small": ("mmlu", 5, ["--limit", "5"])}


def _row(job: str, workers: str, wall: float, s: dict) -> dict:
    dp = s["data_parallel"]
    load = dp.get("workers_load") or []
    busy = [w["busy_s"] / max(w["busy_s"] + w["idle_s"], 1e-9) for w in load]
    return {"job": job, "workers": workers, "wall_s": round(wall, 2), "execute_s": s["time_s"].get("execute"),
            "time_s": {k: round(v, 2) for k, v in s["time_s"].items()}, "dp": dp["workers"], "why": dp.get("why"),
            "busy": [round(b, 3) for b in busy], "load": load, "hit_rate": s["hit_rate"],
            "workers_optimum": dp["optimal_hit_rate"], "optimal_hit_rate": s["optimal_hit_rate"],
            "accuracy": s["accuracy"], "instances": s["counts"]["instances"]}


def run_job(args: argparse.Namespace, job: str, model: Path, workers: str, k: int) -> dict:
    name, shots, extra = TASKS[job.split("-")[0]]
    runs = Path(args.out) / "runs"
    run_id = f"{job}-dp{workers}-{k}"
    cmd = lmbatch(name, model, runs, run_id, [*extra, "--data-parallel", workers, *args.lmbatch_args.split()], shots)
    wall = timed(cmd, Path(args.out) / f"{run_id}.log")
    row = _row(job, workers, wall, json.loads((runs / run_id / "summary.json").read_text()))
    record(Path(args.out), row, "multi.jsonl", ("time_s", "load"))
    return row


def run_lm_eval(args: argparse.Namespace, job: str, model: Path, workers: str, k: int) -> dict:
    """`lmbatch lm-eval --tasks gsm8k_offline` (all 1,319 questions, 5-shot, generate_until)."""
    from lmbatch.lm_eval.backend import write_offline_tasks

    tasks = Path(args.out) / "lm-eval-tasks"
    if not tasks.is_dir():
        write_offline_tasks(tasks)
    out = Path(args.out) / "runs" / f"{job}-dp{workers}-{k}"
    cmd = cli() + ["lm-eval", "--model_args", f"pretrained={model},dtype=bfloat16,data_parallel={workers}",
                   "--tasks", "gsm8k_offline", "--include_path", str(tasks), "--num_fewshot", "5",
                   "--output_path", str(out)]
    wall = timed(cmd, Path(args.out) / f"{job}-dp{workers}-{k}.log")
    report = json.loads(next(out.rglob("lmbatch_*.json")).read_text())
    row = {"job": job, "workers": workers, "wall_s": round(wall, 2), "dp": report["data_parallel"],
           "time_s": {k: round(v, 2) for k, v in report["time_s"].items()}, "hit_rate": report["hit_rate"],
           "tokens": report["tokens"], "load": report.get("workers_load")}
    record(Path(args.out), row, "multi.jsonl", ("time_s", "load"))
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", required=True, help="tokenizer folder copied into the model folders")
    ap.add_argument("--models", default="/tmp/bench-models")
    ap.add_argument("--jobs", default="mmlu-8b,mmlu-1.5b")
    ap.add_argument("--workers", default="1,2,4", help="worker counts of every job (auto: the default)")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--lmbatch-args", default="")
    ap.add_argument("--out", default="results/multi-gpu")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    counts: dict[str, list[str]] = {}
    for spec in args.jobs.split(","):
        spec, _, rounds = spec.partition("@")
        job, _, given = spec.partition(":")
        counts[job] = given.split("/") if given else args.workers.split(",")
        size = job.split("-")[1]
        model = write_random_checkpoint(PRESETS[size], Path(args.models) / PRESETS[size], Path(args.tokenizer))
        # kernels compiled for the model's shape (Triton's cache), as a machine that ran it before has them
        timed(lmbatch("mmlu", model, out / "runs", f"{job}-warm", ["--limit", "1", "--data-parallel", "1"]),
              out / f"{job}-warm.log")
        if not job.startswith("lmeval"):
            name, shots, extra = TASKS[job.split("-")[0]]
            dry = lmbatch(name, model, out / "runs", f"{job}-dry", [*extra, "--dry-run"], shots)
            timed(dry, out / f"{job}-dry.log")
        for k in range(int(rounds or args.repeat)):
            for workers in counts[job]:
                try:
                    rows.append((run_lm_eval if job.startswith("lmeval") else run_job)(args, job, model, workers, k))
                except (SystemExit, Exception) as e:    # a failed run: say so, go on with the others
                    print(f"FAILED {job} dp{workers}: {str(e)[-2000:]}", flush=True)
    print("\n| job | workers | wall s (median) | execute s | wall / one engine's | busy |")
    print("|---|---|---:|---:|---:|---|")
    for job in dict.fromkeys(r["job"] for r in rows):
        base = None
        for workers in counts[job]:
            mine = [r for r in rows if r["job"] == job and r["workers"] == workers]
            if not mine:
                continue
            wall = statistics.median(r["wall_s"] for r in mine)
            ex = statistics.median((r.get("execute_s") or r["time_s"].get("execute", 0.0)) for r in mine)
            base = base or wall
            busy = ", ".join(f"{min(r.get('busy') or [1]):.0%}-{max(r.get('busy') or [1]):.0%}" for r in mine)
            print(f"| {job} | {workers} | {wall:.1f} ({', '.join(str(r['wall_s']) for r in mine)}) | {ex:.1f} | "
                  f"{wall / base:.2f}x | {busy} |")


if __name__ == "__main__":
    main()
