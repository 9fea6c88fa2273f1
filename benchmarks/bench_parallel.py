"""More than one GPU, side by side in one run on the same prompts: full MMLU 5-shot scored by one
engine (dp1), by data-parallel workers (dpN: the radix tree cut along whole subtrees) and by
tensor-parallel groups (tpN), with random bf16 weights of a preset's shape. Per variant: engine
seconds (after a warm-up batch), hit rate and its optimum, seconds per computed token, MFU against
the measured bf16 matmul rate times the GPUs used, and predictions equal to dp1's.

    python benchmarks/bench_parallel.py --preset llama-3.1-8b --variants dp1,dp2,tp2     # 2 GPUs
    python benchmarks/bench_parallel.py --preset llama-3.1-70b --variants tp2 --limit 20  # 70B over 2 H200s
    python benchmarks/bench_parallel.py --preset llama-3.1-70b --variants tp4,dp2xtp2      # 4 GPUs

Each variant's workers start, warm up and close in turn (the GPUs hold one variant at a time).
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))     # baseline.py: the transformers reference

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="llama-3.1-8b")
    ap.add_argument("--tokenizer", help="tokenizer folder (default: the embedded model's)")
    ap.add_argument("--variants", default="dp1,dp2,tp2")
    ap.add_argument("--shots", type=int, default=5)
    ap.add_argument("--limit", type=int)
    ap.add_argument("--max-tokens-per-batch", type=int, default=16384)
    ap.add_argument("--kv-cache-tokens", type=int, default=131072)
    ap.add_argument("--out", default="results/bench_parallel.json")
    args = ap.parse_args()

    import torch
    from baseline import first_selects
    from transformers import AutoTokenizer

    from lmbatch.engine.options import EngineOptions, EngineSpec
    from lmbatch.frontend.workload import LoadArgs
    from lmbatch.model.config import ModelConfig
    from lmbatch.model.embedded import embedded_model_dir
    from lmbatch.programs import mmlu
    from lmbatch.requests import ScoreRequest
    from lmbatch.run.loading import make_engine
    from lmbatch.run.summary import estimate_flops
    from lmbatch.scheduler.planner import summarize

    tok = AutoTokenizer.from_pretrained(args.tokenizer or str(embedded_model_dir()))
    instances = first_selects(mmlu.program, mmlu.instances(LoadArgs(tok, args.shots, args.limit, None)), tok)
    reqs = [ScoreRequest(inst.context, c) for inst in instances for c in inst.continuations]
    model_dir = ROOT / "presets" / args.preset
    cfg = ModelConfig.from_dir(model_dir)
    plan = summarize([r.prompt for r in reqs], [True] * len(reqs), [len(r.continuation) for r in reqs])
    flops = estimate_flops(cfg, plan.unique_tokens, plan.attended_keys, plan.logit_rows)
    peak = _peak_flops(torch)
    print(f"{len(instances)} questions, {plan.prompt_tokens:,} prompt tokens, optimum {plan.optimal_hit_rate:.4f}; "
          f"bf16 matmul {peak / 1e12:.0f} TFLOP/s per GPU", flush=True)
    rows, preds = [], {}
    for name in args.variants.split(","):
        sizes = dict((part[:2], int(part[2:])) for part in name.split("x"))     # dp2, tp4, dp2xtp2
        dp, tp = sizes.get("dp", 1), sizes.get("tp", 1)
        options = EngineOptions(kv_cache_tokens=args.kv_cache_tokens, max_tokens_per_batch=args.max_tokens_per_batch,
                                attention="triton")
        engine = make_engine(EngineSpec(str(model_dir), "cuda", "bfloat16", options, data_parallel=dp,
                                        tensor_parallel=tp, load_format="dummy", graphs_ahead=False))
        try:
            engine.run(reqs[:256])              # warm-up: kernels, allocator, a cached prefix or two
            t = time.perf_counter()
            results, stats = engine.run(reqs)
            seconds = time.perf_counter() - t
        finally:
            engine.close()
            del engine                          # an in-process engine's memory, before the next variant
            gc.collect()
            torch.cuda.empty_cache()
        preds[name] = [max(range(len(i.continuations)), key=lambda c, k=k: results[k + c].logprob)
                       for k, i in zip(_starts(instances), instances)]
        gpus = dp * tp
        row = dict(variant=name, gpus=gpus, seconds=seconds, hit_rate=stats.hit_rate,
                   optimum=stats.optimal_hit_rate, computed_tokens=stats.computed_tokens,
                   us_per_computed_token=1e6 * seconds / max(stats.computed_tokens, 1),
                   mfu=flops / seconds / (peak * gpus),
                   same_predictions=sum(a == b for a, b in zip(preds[name], preds[args.variants.split(",")[0]])))
        rows.append(row)
        print(json.dumps(row), flush=True)
    base = rows[0]["seconds"]
    print("\n| variant | GPUs | engine s | speed-up | hit rate (optimum) | µs / computed token | MFU "
          "| same predictions |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['variant']} | {r['gpus']} | {r['seconds']:.2f} | {base / r['seconds']:.2f}x | "
              f"{r['hit_rate']:.4f} ({r['optimum']:.4f}) | {r['us_per_computed_token']:.3f} | {r['mfu']:.1%} | "
              f"{r['same_predictions']} of {len(instances)} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=1))


def _starts(instances) -> list[int]:
    out, k = [], 0
    for inst in instances:
        out.append(k)
        k += len(inst.continuations)
    return out


def _peak_flops(torch) -> float:
    """Measured dense bf16 matmul rate of one GPU (the MFU denominator)."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ a
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(20):
        a @ a
    torch.cuda.synchronize()
    return 20 * 2 * 8192 ** 3 / (time.perf_counter() - t)


if __name__ == "__main__":
    main()
