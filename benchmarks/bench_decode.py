"""Decode throughput against the GPU's memory-bandwidth roofline, one process, random weights.

    python benchmarks/bench_decode.py --presets qwen2.5-1.5b,qwen3-8b --rows 64,256,512 \
        --contexts 256,1000,4000 --new-tokens 256 --kernels decode,extend
    python benchmarks/bench_decode.py --rows 256 --contexts 100 --shared-prefix 2000 --kernels decode,cascade

For each shape, number of rows and prompt length that its KV pool holds: distinct random prompts are
prefilled (untimed, they stay cached), then every row generates `--new-tokens` greedy tokens, timed
(`execute_s`: the prompts' last tokens again, then the decode steps, CUDA graphs as a run uses them).

With `--shared-prefix N` every prompt starts with the same N tokens (a fixed few-shot prompt, a
prompt's k samples), then its own `--contexts` tokens.

The roofline: a decode step must read every weight once (the embedding table only at its rows, unless
tied to the LM head), the shared prefix's KV once and each row's own KV so far; that many bytes over
the device's copy bandwidth, measured here (a 2 GiB device-to-device copy), is the fastest a step can
be (`per_row_roofline_tok_s`: the same with the prefix read once per row, as plain decode reads it).
`--kernels` compares variants side by side over the same cached prompts, graphs captured afresh for
each: `decode` (what runs by default: kernels/decode_attention.py, each row's keys on their own, steps
overlapped with the host), `cascade` (`--attention cascade`: kernels/cascade_attention.py reads the
prefixes rows share once a step), `deterministic` (`--deterministic`: GEMMs in fixed row blocks, the
extend kernel's fixed key blocks), `sync` (each step waits for the host to see the last one's tokens)
and `extend` (the extend kernel, one query per row).
"""
from __future__ import annotations

import argparse
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
    g.levels = g._cascade if kernel == "cascade" else None
    g._plan = ([], None)
    g.graphs.clear()
    g.pool_handle = None
    torch.cuda.empty_cache()
    g.capture_all()


def profile(engine, prompts: list[list[int]], steps: int, kernel: str) -> None:
    """`steps` decode steps under torch.profiler: the wall, the device's busy time (sum of its kernels'
    times) and the 10 kernels that take most of it."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from lmbatch.requests import GenerateRequest, SamplingParams

    reqs = [GenerateRequest(p, SamplingParams(max_new_tokens=steps, ignore_eos=True)) for p in prompts]
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        _, stats = engine.generate(reqs)
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.self_device_time_total for e in events) / 1e3
    print(f"profile {kernel}: {steps} steps, execute {stats.execute_s * 1e3:.1f} ms, device busy {busy:.1f} ms",
          flush=True)
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:10]:
        print(f"  {e.self_device_time_total / 1e3:9.2f} ms  {e.count:6d}x  {e.key[:100]}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", default="qwen2.5-1.5b")
    ap.add_argument("--rows", default="64,256,512")
    ap.add_argument("--contexts", default="256,1000,4000")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--shared-prefix", type=int, default=0, help="tokens every prompt starts with")
    ap.add_argument("--kernels", default="decode,extend")
    ap.add_argument("--memory-fraction", type=float, default=0.7, help="of the free memory, for the KV pool")
    ap.add_argument("--out", default=None, help="a JSONL file, a line per measurement")
    ap.add_argument("--profile", type=int, default=0, help="then N steps of each variant under torch.profiler: "
                    "the device's busy time against the wall, and its top kernels")
    args = ap.parse_args()

    from lmbatch.engine import Engine
    from lmbatch.requests import GenerateRequest, SamplingParams

    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    rows_list = [int(x) for x in args.rows.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]
    g = torch.Generator().manual_seed(0)
    for preset in args.presets.split(","):
        model = dummy_model(preset)
        cfg = model.cfg
        kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2
        free = torch.cuda.mem_get_info()[0]
        pool = int(free * args.memory_fraction) // kv_per_token
        attention = "cascade" if "cascade" in args.kernels.split(",") else "triton"
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
                prefix = torch.randint(0, cfg.vocab_size, (shared,), generator=g).tolist()
                prompts = [prefix + torch.randint(0, cfg.vocab_size, (ctx,), generator=g).tolist()
                           for _ in range(rows)]
                eng.generate([GenerateRequest(p, SamplingParams(max_new_tokens=1, ignore_eos=True)) for p in prompts])
                params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
                reqs = [GenerateRequest(p, params) for p in prompts]
                ideal = rows / (step_bytes(model, rows, ctx + args.new_tokens / 2, shared) / bw)
                per_row = rows / (step_bytes(model, rows, shared + ctx + args.new_tokens / 2) / bw)
                for kernel in args.kernels.split(","):
                    recapture(eng, kernel)
                    results, stats = eng.generate(reqs)
                    assert all(len(r.token_ids) == args.new_tokens for r in results)
                    tok_s = stats.decode_tokens / stats.execute_s
                    row = {"preset": preset, "rows": rows, "context": ctx, "shared_prefix": shared, "kernel": kernel,
                           "execute_s": round(stats.execute_s, 3),
                           "ms_per_step": round(1e3 * stats.execute_s / args.new_tokens, 3),
                           "decode_tok_s": round(tok_s), "roofline_tok_s": round(ideal),
                           "of_roofline": round(tok_s / ideal, 3), "per_row_roofline_tok_s": round(per_row),
                           "device": torch.cuda.get_device_name(),
                           "copy_tb_s": round(bw / 1e12, 3)}
                    print(" | ".join(str(row[k]) for k in ("preset", "rows", "context", "kernel", "execute_s",
                                                            "ms_per_step", "decode_tok_s", "roofline_tok_s",
                                                            "of_roofline")), flush=True)
                    if args.out:
                        with open(args.out, "a") as f:
                            f.write(json.dumps(row) + "\n")
                    if args.profile:
                        profile(eng, prompts, args.profile, kernel)
        recapture(eng, "decode")
        del eng, model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    from lmbatch.engine import graphs as _graphs
    from lmbatch.engine.sampler import Sampler as _Sampler

    _ORIGINAL, _PLAIN = _graphs._GraphAttention.forward, _Sampler.plain
    main()
