"""Decode speed with and without CUDA graphs, one process, same weights and prompts.

    python benchmarks/bench_decode.py --preset qwen2.5-1.5b --requests 64 --new-tokens 128
"""
from __future__ import annotations

import argparse
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen2.5-1.5b")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=128)
    args = ap.parse_args()

    from lmbatch.engine import Engine
    from lmbatch.requests import GenerateRequest, SamplingParams

    model = dummy_model(args.preset)
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    reqs = [GenerateRequest(torch.randint(0, 30000, (args.prompt_tokens,), generator=g).tolist(), params)
            for _ in range(args.requests)]
    rows = []
    for name, backend, graphs in (("graphs (triton attn)", "triton", True), ("eager triton", "triton", False),
                                  ("eager flashinfer", "flashinfer", False)):
        make = lambda: Engine(model, kv_cache_tokens=1 << 17, attention=backend, cuda_graphs=graphs)  # noqa: E731
        make().generate(reqs[:4])  # warm-up (JIT, graph capture of the small buckets)
        eng = make()
        eng.generate(reqs[: args.requests])  # captures this run's buckets
        results, stats = eng.generate(reqs)
        tok_s = stats.decode_tokens / stats.execute_s
        rows.append((name, stats.execute_s, tok_s, [r.token_ids for r in results]))
    base = rows[0][3]
    print(f"{torch.cuda.get_device_name()}, {args.preset}, {args.requests} requests x {args.new_tokens} new tokens")
    print("variant | seconds | decode tokens/s | speed-up vs eager triton | same tokens as graphs")
    for name, s, tok_s, toks in rows:
        print(f"{name} | {s:.2f} | {tok_s:,.0f} | {rows[1][1] / s:.2f}x | "
              f"{sum(a == b for a, b in zip(toks, base))}/{len(toks)}")


if __name__ == "__main__":
    main()
