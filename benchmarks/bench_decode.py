"""Decode throughput against the GPU's memory-bandwidth roofline, one process, random weights.

    python benchmarks/bench_decode.py --presets qwen2.5-1.5b,qwen3-8b --rows 64,256,512 \
        --contexts 256,1000,4000 --new-tokens 256 --kernels decode,extend
    python benchmarks/bench_decode.py --rows 256 --contexts 100 --shared-prefix 2000 --kernels decode,cascade

For each shape, number of rows and prompt length that its KV pool holds: distinct random prompts are
prefilled (untimed, they stay cached), then every row generates `--new-tokens` greedy tokens, timed
(`execute_s`: the prompts' last tokens again, then the decode steps, CUDA graphs as a run uses them).

With `--shared-prefix N` every prompt starts with the same N tokens (a fixed few-shot prompt), then its
own `--contexts` tokens; with `--samples K` the rows are K samples of each of rows / K prompts of
`--contexts` tokens (maj@k, pass@k: temperature 0.8, a seed a row, so no two rows are one request).

The roofline: a decode step must read every weight once (the embedding table only at its rows, unless
tied to the LM head), the shared prefix's KV once and each row's own KV so far; that many bytes over
the device's copy bandwidth, measured here (a 2 GiB device-to-device copy), is the fastest a step can
be (`per_row_roofline_tok_s`: the same with the prefix read once per row, as plain decode reads it).
`--kernels` compares variants side by side over the same cached prompts, graphs captured afresh for
each: `decode` (plain decode: kernels/decode_attention.py, each row's keys on their own, steps
overlapped with the host), `auto` (what runs by default: plain decode in small steps, cascade attention
in steps whose rows fill the GPU), `cascade` (`--attention cascade`: kernels/cascade_attention.py reads
the prefixes rows share once a step, in every step), `deterministic` (`--deterministic`: GEMMs in fixed row blocks, the
extend kernel's fixed key blocks), `sync` (each step waits for the host to see the last one's tokens)
and `extend` (the extend kernel, one query per row).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def dummy_model(preset: str):
    """Our model of a preset's shape with dummy weights, bf16 on the GPU."""
    from lmbatch.model.config import ModelConfig
    from lmbatch.model.network import Transformer
    from lmbatch.model.weights import init_dummy

    with torch.device("cuda"):
        model = Transformer(ModelConfig.from_dir(ROOT / "presets" / preset)).to(torch.bfloat16)
    init_dummy(model)
    return model.eval()


def copy_bandwidth() -> float:
    """Bytes per second a device-to-device copy moves (read + write), best of 5."""
    x = torch.empty(1 << 30, dtype=torch.int16, device="cuda")
    y = torch.empty_like(x)
    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize()
        t = time.perf_counter()
        y.copy_(x)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return 2 * x.numel() * 2 / best


def step_bytes(model, rows: int, context: float, shared: int = 0) -> float:
    """Bytes a decode step must read: the weights (the embedding only at its rows, unless it is the LM head
    too), a `shared` prefix's KV once and `rows` rows of `context` tokens of KV of their own."""
    cfg = model.cfg
    embed = model.embed_tokens.weight if hasattr(model, "embed_tokens") else None
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    if embed is not None and not cfg.tie_word_embeddings:
        weights -= embed.numel() * embed.element_size() - rows * embed.shape[1] * embed.element_size()
    kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2
    return weights + (shared + rows * context) * kv_per_token


def _extend_forward(qo: torch.Tensor):
    """The decode graphs' attention swapped for the extend kernel (q_len 1), to compare side by side."""
    def forward(attn, layer, q, k, v, window=None):
        from lmbatch.kernels.extend_attention import extend_attention

        attn.store(layer, k, v)
        return extend_attention(q, attn.pool.k[layer], attn.pool.v[layer], attn.kv_indices, qo[:q.shape[0] + 1],
                                attn.kv, 1, attn.scale, window, attn.softcap)
    return forward


def recapture(engine, kernel: str) -> None:
    """Graphs captured afresh for a variant: `decode` (what runs by default), `cascade` (shared prefixes
    read once a step), `deterministic` (`--deterministic`'s GEMMs and attention), `sync` (decode, each
    step waiting for the last one's tokens on the host: no overlap), `extend` (the extend kernel for attention)."""
    from lmbatch.engine import graphs
    from lmbatch.engine.sampler import Sampler

    Sampler.plain = staticmethod(_PLAIN if kernel != "sync" else (lambda r: False))
    det = kernel == "deterministic"
    engine.model.set_deterministic(det)
    engine.attn.deterministic = engine.model_runner.graphs.deterministic = det
    graphs._GraphAttention.forward = (_ORIGINAL if kernel != "extend" else
                                      _extend_forward(torch.arange(1025, dtype=torch.int32, device="cuda")))
    g = engine.model_runner.graphs
    if not hasattr(g, "_cascade"):
        g._cascade = g.levels
    g.levels = g._cascade if kernel in ("cascade", "auto") else None
    if kernel == "auto":        # what --attention auto runs: cascade where rows fill the GPU, else plain decode
        from lmbatch.kernels.decode_attention import WHOLE_FROM
        g.cascade_from = -(-WHOLE_FROM // engine.cfg.num_kv_heads)
    else:
        g.cascade_from = 1
    g._plan = ([], None)
    g.graphs.clear()
    g.pool_handle = None
    torch.cuda.empty_cache()
    g.capture_all()


# a kernel's part of the step, by its name (first match); the rest is "other"
PARTS = (("attention", ("split_kernel", "merge_kernel", "shared_kernel", "whole_kernel", "cascade", "extend_kernel",
                        "flashinfer", "BatchPrefill", "BatchDecode", "attention")),
         ("kv store", ("index_put", "scatter", "rope_store")),
         ("gemm", ("gemm", "Gemm", "xmma", "cutlass", "nvjet", "sm90", "cublas", "matmul", "gemv")),
         ("norm", ("rmsnorm",)), ("rope", ("rope",)), ("act", ("act_mul",)),
         ("sampling", ("gumbel", "argmax", "sampl")), ("embed", ("embedding", "index_select")),
         ("copy", ("copy", "Memcpy", "Memset", "fill", "cat", "where", "clamp")))


def part_of(name: str) -> str:
    for part, keys in PARTS:
        if any(k in name for k in keys):
            return part
    return "other"


def gaps(prof, steps: int) -> dict:
    """The device's idle time between kernels, ms a step: gaps under 20 us (one kernel after another in a
    graph or a queue: launch and drain) and longer ones (the device waiting for the host), and kernels a step."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    between = [b[0] - a[1] for a, b in zip(spans, spans[1:]) if b[0] > a[1]]
    short = sum(g for g in between if g < 20) / 1e3 / steps
    return {"gaps_short": round(short, 3), "gaps_long": round(sum(between) / 1e3 / steps - short, 3),
            "kernels": round(len(spans) / steps)}


def profile(engine, prompts: list[list[int]], steps: int, kernel: str, params=None) -> dict:
    """`steps` decode steps under torch.profiler: the wall, the device's busy time (sum of its kernels'
    times), each part of the step (attention, GEMMs, KV stores, norms, ...) a step, and the 10 kernels
    that take most of it. Returns {part: ms a step} with "wall", "busy" and "idle"."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from lmbatch.requests import GenerateRequest, SamplingParams

    params = params or [SamplingParams(max_new_tokens=steps, ignore_eos=True)] * len(prompts)
    reqs = [GenerateRequest(p, dataclasses.replace(q, max_new_tokens=steps)) for p, q in zip(prompts, params)]
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        _, stats = engine.generate(reqs)
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.self_device_time_total for e in events) / 1e3
    print(f"profile {kernel}: {steps} steps, execute {stats.execute_s * 1e3:.1f} ms, device busy {busy:.1f} ms",
          flush=True)
    parts: dict[str, float] = {}
    for e in events:
        part = part_of(e.key)
        parts[part] = parts.get(part, 0.0) + e.self_device_time_total / 1e3 / steps
    parts = {k: round(v, 3) for k, v in sorted(parts.items(), key=lambda kv: -kv[1])}
    parts.update(wall=round(stats.execute_s * 1e3 / steps, 3), busy=round(busy / steps, 3),
                 idle=round((stats.execute_s * 1e3 - busy) / steps, 3), **gaps(prof, steps))
    print("  a step, ms: " + ", ".join(f"{k} {v}" for k, v in parts.items()), flush=True)
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:12]:
        print(f"  {e.self_device_time_total / 1e3:9.2f} ms  {e.count:6d}x  [{part_of(e.key)}] {e.key[:90]}",
              flush=True)
    return parts


def matmul_peak() -> float:
    """bf16 FLOP/s of a large matrix product here (random data), best of 5."""
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    best = float("inf")
    for _ in range(6):
        torch.cuda.synchronize()
        t = time.perf_counter()
        a @ b
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return 2 * 8192 ** 3 / best


def workload(cfg, rows: int, ctx: int, shared: int, samples: int, new_tokens: int, g: torch.Generator):
    """The rows' prompts and sampling parameters, and the KV tokens read once a step beside each row's own
    (a shared prefix once; a prompt once per `samples` rows)."""
    from lmbatch.requests import SamplingParams

    if samples > 1:
        prompts = [torch.randint(0, cfg.vocab_size, (ctx,), generator=g).tolist() for _ in range(rows // samples)]
        prompts = [p for p in prompts for _ in range(samples)]
        params = [SamplingParams(max_new_tokens=new_tokens, ignore_eos=True, temperature=0.8, seed=i)
                  for i in range(len(prompts))]
        return prompts, params, (rows // samples) * ctx, 0
    prefix = torch.randint(0, cfg.vocab_size, (shared,), generator=g).tolist()
    prompts = [prefix + torch.randint(0, cfg.vocab_size, (ctx,), generator=g).tolist() for _ in range(rows)]
    return prompts, [SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)] * rows, shared, ctx


def floors(model, rows: int, once: int, own: float, bw: float, peak: float) -> dict:
    """ms a step must take at least: the GEMMs (the weights read once, or their FLOPs at `rows` rows,
    whichever is longer), attention (`once` keys of KV read once, `own` keys a row) and the whole step."""
    cfg = model.cfg
    kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2
    weights = step_bytes(model, rows, 0)
    params = weights / 2 - (0 if cfg.tie_word_embeddings else rows * cfg.hidden_size)
    gemm = max(weights / bw, 2 * params * rows / peak)
    attn = (once + rows * own) * kv_per_token / bw
    return {"gemm": round(gemm * 1e3, 3), "attention": round(attn * 1e3, 3), "step": round((gemm + attn) * 1e3, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", default="qwen2.5-1.5b")
    ap.add_argument("--rows", default="64,256,512")
    ap.add_argument("--contexts", default="256,1000,4000")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--shared-prefix", type=int, default=0, help="tokens every prompt starts with")
    ap.add_argument("--samples", type=int, default=1, help="rows that are samples of one prompt")
    ap.add_argument("--kernels", default="decode,extend")
    ap.add_argument("--memory-fraction", type=float, default=0.7, help="of the free memory, for the KV pool")
    ap.add_argument("--out", default=None, help="a JSONL file, a line per measurement")
    ap.add_argument("--profile", type=int, default=0, help="then N steps of each variant under torch.profiler: "
                    "the device's busy time against the wall, each part of a step, and the top kernels")
    args = ap.parse_args()

    from lmbatch.engine import Engine
    from lmbatch.requests import GenerateRequest, SamplingParams

    bw, peak = copy_bandwidth(), matmul_peak()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bw / 1e12:.2f} TB/s, bf16 matmul {peak / 1e12:.0f} TFLOP/s",
          flush=True)
    rows_list = [int(x) for x in args.rows.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]
    g = torch.Generator().manual_seed(0)
    for preset in args.presets.split(","):
        model = dummy_model(preset)
        cfg = model.cfg
        kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2
        free = torch.cuda.mem_get_info()[0]
        pool = int(free * args.memory_fraction) // kv_per_token
        attention = "cascade" if {"cascade", "auto"} & set(args.kernels.split(",")) else "triton"
        eng = Engine(model, kv_cache_tokens=pool, max_tokens_per_batch=16384, attention=attention, cuda_graphs=True,
                     max_running=max(rows_list))
        print(f"{preset}: pool {pool:,} tokens ({pool * kv_per_token / 2**30:.1f} GiB)", flush=True)
        print("shape | rows | context | kernel | execute s | ms/step | decode tok/s | roofline tok/s | of roofline")
        for rows in rows_list:
            for ctx in contexts:
                shared = args.shared_prefix
                need = shared + rows * (ctx + args.new_tokens + 1)
                if need > pool:
                    print(f"{preset} | {rows} | {ctx} | - | does not fit ({need:,} tokens of KV) | | | |", flush=True)
                    continue
                prompts, params, once, own = workload(cfg, rows, ctx, shared, args.samples, args.new_tokens, g)
                eng.generate([GenerateRequest(p, SamplingParams(max_new_tokens=1, ignore_eos=True)) for p in prompts])
                reqs = [GenerateRequest(p, q) for p, q in zip(prompts, params)]
                mean_own = own + args.new_tokens / 2
                floor = floors(model, rows, once, mean_own, bw, peak)
                ideal = rows / (floor["step"] / 1e3)
                per_row = rows / (step_bytes(model, rows, shared + ctx + args.new_tokens / 2) / bw)
                for kernel in args.kernels.split(","):
                    recapture(eng, kernel)
                    eng.generate([GenerateRequest(p, dataclasses.replace(q, max_new_tokens=4))    # kernels' JIT
                                  for p, q in zip(prompts, params)])
                    results, stats = eng.generate(reqs)
                    assert all(len(r.token_ids) == args.new_tokens for r in results)
                    tok_s = stats.decode_tokens / stats.execute_s
                    row = {"preset": preset, "rows": rows, "context": ctx, "shared_prefix": shared,
                           "samples": args.samples, "kernel": kernel,
                           "execute_s": round(stats.execute_s, 3),
                           "ms_per_step": round(1e3 * stats.execute_s / args.new_tokens, 3),
                           "decode_tok_s": round(tok_s), "roofline_tok_s": round(ideal),
                           "of_roofline": round(tok_s / ideal, 3), "per_row_roofline_tok_s": round(per_row),
                           "floor_ms": floor, "device": torch.cuda.get_device_name(),
                           "copy_tb_s": round(bw / 1e12, 3), "matmul_tflop_s": round(peak / 1e12)}
                    print(" | ".join(str(row[k]) for k in ("preset", "rows", "context", "kernel", "execute_s",
                                                            "ms_per_step", "decode_tok_s", "roofline_tok_s",
                                                            "of_roofline")), flush=True)
                    if args.profile:
                        row["profile_ms_per_step"] = profile(eng, prompts, args.profile, kernel, params)
                        print(f"  floors, ms a step: {floor}", flush=True)
                    if args.out:
                        with open(args.out, "a") as f:
                            f.write(json.dumps(row) + "\n")
        recapture(eng, "decode")
        del eng, model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    from lmbatch.engine import graphs as _graphs
    from lmbatch.engine.sampler import Sampler as _Sampler

    _ORIGINAL, _PLAIN = _graphs._GraphAttention.forward, _Sampler.plain
    main()
