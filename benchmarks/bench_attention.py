"""FlashInfer vs Triton attention on the same full job, side by side in one process tree: `lmbatch run`
of full MMLU 5-shot on random weights of a real shape, each run a fresh process, the variants
alternating after one untimed run each (which pays FlashInfer's JIT and fills the workload cache).

    python benchmarks/bench_attention.py --tokenizer TOK --out $OUT --repeat 3
    # writes $OUT/attention.jsonl, a line per run; the medians at the end
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from bench_fixed_costs import lmbatch, timed, write_random_checkpoint


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", required=True, help="tokenizer folder copied into the model folder")
    ap.add_argument("--models", default="/tmp/bench-models")
    ap.add_argument("--preset", default="qwen2.5-1.5b")
    ap.add_argument("--task", default="mmlu")
    ap.add_argument("--variants", default="triton,flashinfer")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default="results/attention")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = write_random_checkpoint(args.preset, Path(args.models) / args.preset, Path(args.tokenizer))
    variants = args.variants.split(",")
    rows: list[dict] = []
    for k in range(-1, args.repeat):        # -1: the untimed first run of each variant
        for v in variants:
            run_id = f"{v}-{k}"
            wall = timed(lmbatch(args.task, model, out / "runs", run_id, ["--attention", v]), out / f"{run_id}.log")
            s = json.loads((out / "runs" / run_id / "summary.json").read_text())
            row = {"variant": v, "round": k, "wall_s": round(wall, 2), "execute_s": s["time_s"].get("execute"),
                   "attention": s.get("attention"), "hit_rate": s["hit_rate"], "accuracy": s["accuracy"],
                   "time_s": s["time_s"]}
            with open(out / "attention.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")
            print(json.dumps({key: val for key, val in row.items() if key != "time_s"}), flush=True)
            if k >= 0:
                rows.append(row)
    for v in variants:
        mine = [r for r in rows if r["variant"] == v]
        print(f"{v}: wall {statistics.median(r['wall_s'] for r in mine):.2f} s, execute "
              f"{statistics.median(r['execute_s'] for r in mine):.2f} s (median of {len(mine)})", flush=True)


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
    print(f"total {time.perf_counter() - t0:.0f} s")
