"""What a user waits for, first on a fresh machine and then warm (issue 34): `lmbatch run` of full MMLU
and HellaSwag 5-shot on random weights of real shapes, each run a fresh process timed by this parent
from spawn to exit, with the run's own phases (`summary.json` `time_s`), beside plain transformers doing
the MMLU job end to end (benchmarks/hf_e2e.py).

    python benchmarks/bench_fixed_costs.py --tokenizer TOK --out $OUT
    # TOK: a tokenizer folder (the embedded SmolLM2's files); writes $OUT/fixed-costs.jsonl, a line per
    # run as it ends (a call cut short keeps what it measured)

Order matters: the first run is the machine's first (Python's bytecode, the kernel compilers' caches,
the page cache of torch's libraries and of the weights, lmbatch's workload cache: all cold). So the
model folders are written here with numpy alone (random bf16 weights in safetensors, norms 1): nothing
imports torch before that first run. Then, per job, a dry run that puts its workload into the cache (no
model work) and `--repeat` warm runs (medians reported); the transformers script where --jobs puts it.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from random_checkpoint import ROOT, write_random_checkpoint  # noqa: E402

__all__ = ["ROOT", "cli", "lmbatch", "record", "timed", "write_random_checkpoint"]


def timed(cmd: list[str], log: Path) -> float:
    t = time.perf_counter()
    with open(log, "w") as fh:
        rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - t
    if rc != 0:
        raise SystemExit(f"{' '.join(map(str, cmd))} exited {rc}:\n{log.read_text()[-3000:]}")
    return wall


def cli() -> list[str]:
    """The `lmbatch` command: its console script beside this Python, else the module."""
    exe = Path(sys.executable).parent / "lmbatch"
    return [str(exe)] if exe.is_file() else [sys.executable, "-c", "from lmbatch.cli import main; main()"]


def lmbatch(task: str, model: Path, out: Path, run_id: str, extra: list[str], shots: int | None = 5) -> list[str]:
    """The `lmbatch run` command line (`shots` None: no --shots, for tasks whose shots are their own)."""
    given = [] if shots is None else ["--shots", str(shots)]
    return cli() + ["run", task, *given, "--model", str(model), "--out", str(out), "--run-id", run_id,
                  "--overwrite", "--quiet", *extra]


def record(out: Path, row: dict, name: str = "fixed-costs.jsonl", hide: tuple[str, ...] = ("time_s",)) -> None:
    """A line of `out/name`, and the row printed without its `hide` fields."""
    with open(out / name, "a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps({k: v for k, v in row.items() if k not in hide}), flush=True)


def run_job(args: argparse.Namespace, job: str, task: str, model: Path, kind: str, run_id: str) -> dict:
    runs = Path(args.out) / "runs"
    wall = timed(lmbatch(task, model, runs, run_id, args.lmbatch_args.split()), Path(args.out) / f"{run_id}.log")
    s = json.loads((runs / run_id / "summary.json").read_text())
    row = {"job": job, "kind": kind, "wall_s": round(wall, 2), "time_s": s["time_s"], "workload": s.get("workload"),
           "attention": s.get("attention"), "hit_rate": s["hit_rate"], "optimal_hit_rate": s["optimal_hit_rate"],
           "accuracy": s["accuracy"], "instances": s["counts"]["instances"]}
    record(Path(args.out), row)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", required=True, help="tokenizer folder copied into the model folders")
    ap.add_argument("--models", default="/tmp/bench-models")
    ap.add_argument("--jobs", default="mmlu-1.5b,hf-mmlu-1.5b,hellaswag-1.5b,mmlu-8b")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--lmbatch-args", default="")
    ap.add_argument("--out", default="results/fixed-costs")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tok = Path(args.tokenizer)
    jobs = args.jobs.split(",")
    t = time.perf_counter()
    q15 = write_random_checkpoint("qwen2.5-1.5b", Path(args.models) / "Q15", tok)
    print(f"wrote {q15} in {time.perf_counter() - t:.1f}s", flush=True)
    rows = [run_job(args, "mmlu-1.5b", "mmlu", q15, "fresh machine, first run", "fresh")]
    for job in jobs:
        name, _, size = job.partition("-")
        if name == "hf":
            wall = timed([sys.executable, str(ROOT / "benchmarks" / "hf_e2e.py"), "--task", "mmlu", "--shots", "5",
                          "--model", str(q15), "--device", "cuda", "--out", str(out / "runs" / "hf")],
                         out / "hf.log")
            record(out, {"job": job, "kind": "plain transformers", "wall_s": round(wall, 2)})
            continue
        model = q15 if size == "1.5b" else write_random_checkpoint("qwen3-8b", Path(args.models) / "Q8", tok)
        if job != "mmlu-1.5b":      # its workload into the cache (a dry run: no model work), as a warm run finds it
            timed(lmbatch(name, model, out / "runs", f"{job}-dry", ["--dry-run"]), out / f"{job}-dry.log")
        for k in range(args.repeat):
            rows.append(run_job(args, job, name, model, "warm", f"{job}-warm{k}"))
    summary = {}
    for job in dict.fromkeys(r["job"] for r in rows):
        warm = [r["wall_s"] for r in rows if r["job"] == job and r["kind"] == "warm"]
        if warm:
            summary[job] = statistics.median(warm)
    (out / "fixed-costs-summary.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
