"""MMLU scoring benchmark, every variant in one process on the same prompts and the same weights:
lmbatch (DFS), the paper's ablations (--schedule fcfs / random, no cache), and plain transformers
(sdpa, length-sorted padded batches, last-position logits: what lm-eval's HF backend does).

    # CPU, embedded model (real weights), a subset:
    python benchmarks/bench_mmlu.py --device cpu --limit 100 --subjects 5 --variants dfs,hf
    # GPU, Qwen2.5-1.5B shape with dummy weights, full MMLU 5-shot:
    python benchmarks/bench_mmlu.py --device cuda --preset qwen2.5-1.5b --variants dfs,fcfs,random,nocache,hf
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))     # baseline.py: the transformers reference

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--preset", help="presets/<name>/config.json with dummy weights (default: the embedded model)")
    ap.add_argument("--tokenizer", help="tokenizer folder (default: the embedded model's)")
    ap.add_argument("--shots", type=int, default=5)
    ap.add_argument("--limit", type=int)
    ap.add_argument("--subjects", type=int, help="only the first N subjects")
    ap.add_argument("--variants", default="dfs,fcfs,random,nocache,hf")
    ap.add_argument("--backend", help="attention backend for the lmbatch runs (default: per device)")
    ap.add_argument("--max-tokens-per-batch", type=int, default=16384)
    ap.add_argument("--kv-cache-tokens", type=int, default=None, help="pool of the dfs and dfs-torch runs "
                    "(default: as lmbatch run: half the free GPU memory, at most 131072 tokens)")
    ap.add_argument("--tie-margin", type=float, default=0.05,
                    help="questions whose top-2 logprobs differ by less (nats) in either run count as bf16 ties")
    ap.add_argument("--ablation-kv-tokens", type=int, default=131072,
                    help="pool of dfs-small, fcfs, random, nocache: the paper's ablation needs a bounded cache")
    ap.add_argument("--hf-batch-tokens", type=int, default=32768)
    ap.add_argument("--hf-every", type=int, default=1, help="transformers scores every Nth question only and its "
                    "seconds are scaled by the prompt tokens to the whole set (for models where it takes too long)")
    ap.add_argument("--out", default="results/bench_mmlu.parquet")
    ap.add_argument("--profile", action="store_true", help="cProfile the lmbatch runs (host time by function)")
    ap.add_argument("--torch-profile", action="store_true", help="device time by kernel, on the first 4000 requests")
    args = ap.parse_args()

    from baseline import first_selects, score_choices
    from transformers import AutoTokenizer

    from lmbatch.engine import Engine
    from lmbatch.frontend.workload import LoadArgs
    from lmbatch.model.embedded import embedded_model_dir
    from lmbatch.programs import mmlu
    from lmbatch.requests import ScoreRequest

    dev = torch.device(args.device)
    dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
    tok_dir = args.tokenizer or str(embedded_model_dir())
    model_dir = ROOT / "presets" / args.preset if args.preset else embedded_model_dir()
    tok = AutoTokenizer.from_pretrained(tok_dir)
    subjects = mmlu.subject_names()[: args.subjects] if args.subjects else None
    t0 = time.perf_counter()
    # the token ids exactly as `lmbatch run mmlu` makes them: the program's first pass
    instances = first_selects(mmlu.program, mmlu.instances(LoadArgs(tok, args.shots, args.limit, subjects)), tok)
    reqs = [ScoreRequest(inst.context, c) for inst in instances for c in inst.continuations]
    print(f"{len(instances)} questions tokenized in {time.perf_counter() - t0:.1f}s", flush=True)

    hf, model, cfg = shared_models(model_dir, bool(args.preset), dev, dtype)
    peak = _peak_flops(dev, dtype)

    rows, preds, logprobs = [], {}, {}
    variants = args.variants.split(",")
    longest = max(len(r.prompt) for r in reqs)
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * torch.finfo(dtype).bits // 8
    free = torch.cuda.mem_get_info()[0] // 2 if dev.type == "cuda" else 4 << 30
    kv_tokens = args.kv_cache_tokens or max(longest + args.max_tokens_per_batch, min(free // per_token, 1 << 17))
    for name in variants:
        if name == "hf":
            score_choices(hf, instances[:8], args.hf_batch_tokens)  # warm-up
            _reset(dev)
            sample = instances[::args.hf_every]
            base = score_choices(hf, sample, args.hf_batch_tokens)
            if args.hf_every > 1:       # scaled to the whole set by prompt tokens; predictions of the sample
                total = sum(len(i.context) for i in instances)     # as score_choices counts them
                base = dataclasses.replace(base, seconds=base.seconds * total / base.prompt_tokens, prompt_tokens=total)
                print(f"hf: every {args.hf_every}th question, seconds scaled to the whole set", flush=True)
            preds[name] = {k * args.hf_every: p for k, p in enumerate(base.predictions)}
            logprobs[name] = {k * args.hf_every: lp for k, lp in enumerate(base.logprobs)}
            rows.append(_row(name, base.seconds, len(instances), base.prompt_tokens, base.prompt_tokens, None,
                             None, _flops(cfg, base.prompt_tokens, 0, [(len(i.context), 0) for i in instances]),
                             peak, dev))
            rows[-1]["kv_cache_tokens"] = None
            print(rows[-1], flush=True)
            continue
        schedule = {"dfs": "dfs", "dfs-small": "dfs", "fcfs": "fcfs", "random": "random", "nocache": "dfs",
                    "dfs-torch": "dfs", "dfs-triton": "dfs"}[name]
        backend = {"dfs-torch": "torch", "dfs-triton": "triton"}.get(name, args.backend)
        pool = kv_tokens if name in ("dfs", "dfs-torch", "dfs-triton") else max(args.ablation_kv_tokens,
                                                                   longest + args.max_tokens_per_batch)
        def engine():
            return Engine(model, kv_cache_tokens=pool, max_tokens_per_batch=args.max_tokens_per_batch,
                          cache=name != "nocache", attention=backend)
        engine().score(reqs[:64], schedule=schedule)          # warm-up: kernel JIT, allocator
        if args.torch_profile:
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                engine().score(reqs[:4000], schedule=schedule)
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25))
        eng = engine()
        _reset(dev)
        if args.profile:
            import cProfile
            import pstats
            prof = cProfile.Profile()
            results, stats = prof.runcall(eng.score, reqs, schedule=schedule)
            pstats.Stats(prof).sort_stats("tottime").print_stats(22)
        else:
            results, stats = eng.score(reqs, schedule=schedule)
        preds[name] = {k: max(range(4), key=lambda c: results[4 * k + c].logprob) for k in range(len(instances))}
        logprobs[name] = {k: [r.logprob for r in results[4 * k:4 * k + 4]] for k in range(len(instances))}
        pairs = [(results[j].prompt_tokens, results[j].cached_tokens) for j in stats.order]
        rows.append(_row(name, stats.execute_s, len(instances), stats.prompt_tokens, stats.computed_tokens,
                         stats.hit_rate, stats.optimal_hit_rate, _flops(cfg, stats.computed_tokens, len(pairs), pairs),
                         peak, dev))
        rows[-1]["kv_cache_tokens"] = pool
        print(rows[-1], flush=True)
        del eng
    for ref in ("dfs", "dfs-torch", "hf"):
        if ref in preds:
            for row in rows:
                p = preds[row["variant"]]
                both = [k for k in p if k in preds[ref]]      # questions both scored (hf may score a sample)
                row["agree_" + ref] = sum(p[k] == preds[ref][k] for k in both) / len(both)
                clear = [k for k in both if min(_margin(logprobs[row["variant"]][k]),
                                                _margin(logprobs[ref][k])) >= args.tie_margin]
                row["agree_" + ref + "_noties"] = sum(p[k] == preds[ref][k] for k in clear) / max(len(clear), 1)
                row["clear_questions_" + ref] = len(clear)
    base_s = next((r["seconds"] for r in rows if r["variant"] == "hf"), None)
    for row in rows:
        row["speedup_vs_hf"] = base_s / row["seconds"] if base_s else None
    _print(rows, dev, args, peak)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.Table.from_pylist(rows), out)


def shared_models(model_dir, dummy: bool, dev, dtype):
    """One set of weights for every variant: transformers' model (random weights of the preset's
    shape when `dummy`), copied into ours. Returns (hf model, our model, our config)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from lmbatch.model.config import ModelConfig
    from lmbatch.model.network import Transformer
    from lmbatch.model.weights import load_weights

    if dummy:
        torch.manual_seed(0)    # the same random weights in every run, so runs write the same text
        with torch.device(dev):
            hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=dtype,
                                                  attn_implementation="sdpa").eval()
    else:
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa").to(dev).eval()
    cfg = ModelConfig.from_dir(model_dir)
    model = Transformer.empty(cfg, dev, dtype)
    load_weights(model, hf.state_dict())
    return hf, model.eval(), cfg


def _margin(lps: list[float]) -> float:
    top = sorted(lps, reverse=True)
    return top[0] - top[1]


def _reset(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _peak_flops(dev, dtype) -> float:
    """Measured dense matmul rate of this device (the MFU denominator)."""
    n = 8192 if dev.type == "cuda" else 1024
    a, b = torch.randn(n, n, device=dev, dtype=dtype), torch.randn(n, n, device=dev, dtype=dtype)
    for _ in range(3):
        a @ b
    reps = 20 if dev.type == "cuda" else 3
    if dev.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return 2 * n ** 3 * reps / (time.perf_counter() - t)


def _flops(cfg, computed: int, scored: int, pairs) -> float:
    """Model FLOPs of the computed tokens: linear layers, attention over each token's context, LM head
    at scored positions."""
    h, L = cfg.hidden_size, cfg.num_layers
    per_token = 2 * cfg.active_linear_params()        # routed experts: the active ones only
    attn = sum((n * n - c * c) / 2 for n, c in pairs) * 4 * L * cfg.num_heads * cfg.head_dim
    return computed * per_token + attn + 2 * max(scored, len(pairs)) * h * cfg.vocab_size


def _row(name, seconds, programs, prompt, computed, hit, optimum, flops, peak, dev) -> dict:
    mem = torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else None
    return dict(variant=name, seconds=seconds, programs_per_s=programs / seconds, prompt_tokens=prompt,
                computed_tokens=computed, prompt_tokens_per_s=prompt / seconds,
                computed_tokens_per_s=computed / seconds, hit_rate=hit, optimal_hit_rate=optimum,
                mfu=flops / seconds / peak, peak_mem_gib=mem)


def _print(rows, dev, args, peak) -> None:
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    print(f"\n{name}, {args.preset or 'embedded SmolLM2-135M'}, measured peak {peak / 1e12:.0f} TFLOP/s")
    keys = list(rows[0])
    print(" | ".join(keys))
    for r in rows:
        print(" | ".join(f"{r[k]:.4g}" if isinstance(r[k], float) else str(r[k]) for k in keys))
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
