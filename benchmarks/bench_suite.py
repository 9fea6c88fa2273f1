"""A suite in one run against its tasks one process each (issue 39's targets): `lmbatch run SUITE` once,
then `lmbatch run TASK` for every task of the suite, each a fresh process timed by this parent from spawn
to exit, with each run's own phases (`summary.json` `time_s`).

    python benchmarks/bench_suite.py --tokenizer TOK --out $OUT            # the full `olmes` suite
    python benchmarks/bench_suite.py --suite olmes:rc --limit 50 --device cpu --preset smollm2-135m ...
    # TOK: a tokenizer folder (the embedded SmolLM2's files); random bf16 weights of presets/PRESET
    # (written by bench_fixed_costs.write_random_checkpoint); writes $OUT/suite.jsonl, a line per run

Reports the suite's wall over the sum of its tasks' model work alone (their `execute` phases) and over
the sum of their walls, and the largest difference of a task's metric between the suite and the task alone.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_fixed_costs import lmbatch, record, timed, write_random_checkpoint  # noqa: E402


def _run(args: argparse.Namespace, task: str, model: Path, run_id: str) -> dict:
    runs = Path(args.out) / "runs"
    extra = ["--device", args.device, *args.lmbatch_args.split()] + (["--limit", str(args.limit)] if args.limit else [])
    # the suite pins MMLU's shots; OLMES tasks have their own
    cmd = lmbatch(task, model, runs, run_id, extra, shots=5 if task == "mmlu" else None)
    wall = timed(cmd, Path(args.out) / f"{run_id}.log")
    s = json.loads((runs / run_id / "summary.json").read_text())
    row = {"task": task, "wall_s": round(wall, 2), "execute_s": s["time_s"].get("execute"), "time_s": s["time_s"],
           "hit_rate": s["hit_rate"], "optimal_hit_rate": s["optimal_hit_rate"],
           "tasks": {name: t.get("metrics") for name, t in (s.get("tasks") or {}).items()}}
    record(Path(args.out), row, "suite.jsonl", ("time_s", "tasks"))
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", required=True, help="tokenizer folder copied into the model folder")
    ap.add_argument("--preset", default="qwen2.5-1.5b")
    ap.add_argument("--models", default="/tmp/bench-models")
    ap.add_argument("--suite", default="olmes")
    ap.add_argument("--limit", type=int, default=0, help="--limit for every run (0: full splits)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--lmbatch-args", default="")
    ap.add_argument("--out", default="results/bench-suite")
    args = ap.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    model = write_random_checkpoint(args.preset, Path(args.models) / args.preset, Path(args.tokenizer))

    from lmbatch.programs.registry import get_workload
    tasks = list(get_workload(args.suite).tasks or [args.suite])
    suite = _run(args, args.suite, model, "suite")
    alone = [_run(args, task, model, f"alone-{k}") for k, task in enumerate(tasks)]

    work = sum(r["execute_s"] for r in alone)
    walls = sum(r["wall_s"] for r in alone)
    # bf16 on a GPU: another batch composition can flip a near-tie, so the largest difference is shown
    delta = max((abs(v - suite["tasks"][r["task"]][k]) for r in alone for k, v in r["tasks"][r["task"]].items()
                 if not k.endswith("_stderr")), default=0.0)
    print(f"\n{args.suite}: {len(tasks)} tasks; suite wall {suite['wall_s']:.1f} s "
          f"(execute {suite['execute_s']:.1f} s, "
          f"hit rate {suite['hit_rate']:.4f}, optimum {suite['optimal_hit_rate']:.4f})")
    print(f"tasks alone: model work (execute) {work:.1f} s summed, walls {walls:.1f} s summed")
    print(f"suite wall / their model work: {suite['wall_s'] / work:.2f}x (target <= 1.3x); "
          f"/ their walls: {suite['wall_s'] / walls:.3f} (target < 0.333); largest metric difference, suite vs alone: "
          f"{delta:.4f}")
    print(f"{'task':<22}{'wall s':>8}{'execute s':>11}")
    for r in alone:
        print(f"{r['task']:<22}{r['wall_s']:>8.1f}{r['execute_s']:>11.2f}")


if __name__ == "__main__":
    main()
