"""A decode step's GEMMs alone, against their floor: each projection of a preset's shape at decode row counts,
F.linear (cuBLAS) as the network runs it, beside the same product on the weight stored transposed, and the
floor max(weight bytes / copy bandwidth, FLOPs / bf16 matmul peak), both measured here.

    python benchmarks/bench_gemm.py --presets qwen2.5-1.5b,qwen3-8b --rows 64,256,512 --out $OUT/gemm.jsonl
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent


def shapes(preset: str) -> dict[str, tuple[int, int]]:
    """Each projection's (in, out) features, for one layer, and the LM head."""
    from lmbatch.model.config import ModelConfig

    c = ModelConfig.from_dir(ROOT / "presets" / preset)
    return {"qkv": (c.hidden_size, (c.num_heads + 2 * c.num_kv_heads) * c.head_dim),
            "o": (c.num_heads * c.head_dim, c.hidden_size),
            "gate_up": (c.hidden_size, 2 * c.intermediate_size),
            "down": (c.intermediate_size, c.hidden_size),
            "lm_head": (c.hidden_size, c.vocab_size)}, c.num_layers


def main() -> None:
    import triton.testing
    from bench_decode import copy_bandwidth, matmul_peak

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", default="qwen2.5-1.5b")
    ap.add_argument("--rows", default="64,256,512")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    bw, peak = copy_bandwidth(), matmul_peak()
    print(f"{torch.cuda.get_device_name()}: {bw / 1e12:.2f} TB/s, {peak / 1e12:.0f} TFLOP/s", flush=True)
    print("preset | rows | proj | us (F.linear) | us (x @ W^T stored) | floor us | of floor")
    for preset in args.presets.split(","):
        projs, layers = shapes(preset)
        for rows in (int(r) for r in args.rows.split(",")):
            total, total_floor = 0.0, 0.0
            for name, (k, n) in projs.items():
                w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
                # several weight copies in turn: one layer's weights stay out of L2 as in a step
                ws = [w.clone() for _ in range(4)]
                wt = [x.t().contiguous() for x in ws]
                x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
                it = iter(range(1 << 30))
                us = triton.testing.do_bench(lambda: F.linear(x, ws[next(it) % 4]), warmup=25, rep=100,
                                             return_mode="median") * 1e3
                us_t = triton.testing.do_bench(lambda: x @ wt[next(it) % 4], warmup=25, rep=100,
                                               return_mode="median") * 1e3
                floor = max(n * k * 2 / bw, 2 * rows * n * k / peak) * 1e6
                times = 1 if name == "lm_head" else layers
                total += min(us, us_t) * times
                total_floor += floor * times
                row = {"preset": preset, "rows": rows, "proj": name, "us": round(us, 2),
                       "us_transposed": round(us_t, 2), "floor_us": round(floor, 2),
                       "of_floor": round(floor / min(us, us_t), 3),
                       "device": torch.cuda.get_device_name()}
                print(" | ".join(str(row[c]) for c in ("preset", "rows", "proj", "us", "us_transposed", "floor_us",
                                                        "of_floor")), flush=True)
                if args.out:
                    with open(args.out, "a") as f:
                        f.write(json.dumps(row) + "\n")
            print(f"{preset} | {rows} | a step's GEMMs | {total / 1e3:.3f} ms | floor {total_floor / 1e3:.3f} ms "
                  f"({total_floor / total:.0%})", flush=True)


if __name__ == "__main__":
    main()
