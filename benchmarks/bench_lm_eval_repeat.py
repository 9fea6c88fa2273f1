"""A first and a repeated `lmbatch lm-eval` of the same command, each a fresh process timed from spawn to
exit, with every cache the command uses starting empty for the first (lmbatch's workload and score caches
and its copy of lm-eval's task index under a new LMBATCH_CACHE; lm-eval's request cache under a new
LM_HARNESS_CACHE_PATH): the repeat's wall over the first's, and whether every sample's loglikelihoods
are the same (`--log_samples`).

    python benchmarks/bench_lm_eval_repeat.py --device cpu --limit 1      # 2-core CPU: lm-eval's mmlu, 57 subjects
    python benchmarks/bench_lm_eval_repeat.py --device cpu --limit 1 --no-score-cache   # the repeat computes
    python benchmarks/bench_lm_eval_repeat.py --device cpu --limit 1 --use-cache   # lm-eval's answer cache too
    python benchmarks/bench_lm_eval_repeat.py --model DIR --device cuda   # the full task
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _samples(out: Path) -> dict[tuple[str, int], list]:
    got: dict[tuple[str, int], list] = {}
    for f in out.rglob("samples_*.jsonl"):
        task = f.name[len("samples_"):].rsplit("_", 1)[0]
        for line in f.read_text().splitlines():
            s = json.loads(line)
            got[(task, s["doc_id"])] = s["resps"]
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="HF model folder (default: the embedded model)")
    ap.add_argument("--tasks", default="mmlu_offline")
    ap.add_argument("--num-fewshot", type=int, default=5)
    ap.add_argument("--limit", help="lm-eval's --limit per task")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--no-cache-requests", action="store_true", help="without lm-eval's --cache_requests")
    ap.add_argument("--no-score-cache", action="store_true",
                    help="score_cache=false: both runs compute their scores (lmbatch keeps them by default)")
    ap.add_argument("--use-cache", action="store_true",
                    help="with lm-eval's --use_cache (its sqlite cache of answers: a repeat scores nothing)")
    args = ap.parse_args()

    from lmbatch.lm_eval.backend import write_offline_tasks
    from lmbatch.model.embedded import embedded_model_dir

    model = args.model or str(embedded_model_dir())
    dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    root = Path(tempfile.mkdtemp(prefix="lmbatch-repeat-"))
    write_offline_tasks(root / "tasks")
    env = {**os.environ, "LMBATCH_CACHE": str(root / "cache"), "LM_HARNESS_CACHE_PATH": str(root / "requests"),
           "HF_HUB_OFFLINE": "1"}
    model_args = f"pretrained={model},dtype={dtype}" + (",score_cache=false" if args.no_score_cache else "")
    walls, samples = [], []
    for run in ("first", "repeat"):
        out = root / run
        cmd = [sys.executable, "-c", "from lmbatch.cli import main; main()", "lm-eval",
               "--model_args", model_args, "--device", args.device, "--tasks", args.tasks,
               "--include_path", str(root / "tasks"), "--num_fewshot", str(args.num_fewshot),
               "--output_path", str(out), "--log_samples"]
        cmd += [] if args.no_cache_requests else ["--cache_requests", "true"]
        cmd += ["--limit", args.limit] if args.limit else []
        cmd += ["--use_cache", str(root / "answers")] if args.use_cache else []
        start = time.perf_counter()
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
        walls.append(time.perf_counter() - start)
        samples.append(_samples(out))
        report = json.loads(next(out.glob("lmbatch_*.json")).read_text())
        print(f"{run}: {walls[-1]:.1f} s, {len(samples[-1])} samples, {report['scores_from_cache']} of "
              f"{report['requests']} scores from the score cache", flush=True)
    same = samples[0] == samples[1] and len(samples[0]) > 0
    print(f"repeat / first: {walls[1] / walls[0]:.2f} ({walls[1]:.1f} s / {walls[0]:.1f} s); "
          f"per-sample loglikelihoods identical: {same}")


if __name__ == "__main__":
    main()
