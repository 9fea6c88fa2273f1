"""Block-scaled FP8 GEMMs against bf16 at a model's shapes (default Qwen3-8B's projections), CUDA events,
median of 20 after a warm-up: bf16 `F.linear`; the activations' quantization alone; lmbatch's path
(`model/fp8.linear`: quantization + the Triton kernel at its default tiles); the Triton kernel alone at
other tiles; torch's `_scaled_mm` with block-wise scales (cuBLAS, where this torch and CUDA have it). Each
FP8 result is checked against the dequantized reference first (relative error printed).

    python benchmarks/bench_fp8_gemm.py --rows 16,256,4096,16384 [--out F.jsonl]
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
TILES = [(64, 4, 3), (64, 4, 4), (128, 4, 3), (128, 8, 3), (128, 8, 4)]


def timed(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="16,256,4096,16384")
    ap.add_argument("--out")
    args = ap.parse_args()
    from lmbatch.kernels.fp8_gemm import block_fp8_gemm
    from lmbatch.model.dequantize import scaled_fp8
    from lmbatch.model.fp8 import linear, quantize_activations

    g = torch.Generator("cuda").manual_seed(0)
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, generator=g, device="cuda").to(torch.float8_e4m3fn)
        ws = torch.rand(n // 128, k // 128, generator=g, device="cuda") * 0.02 + 0.01
        wd = scaled_fp8(w, ws, (128, 128), torch.bfloat16)
        for m in map(int, args.rows.split(",")):
            x = torch.randn(m, k, generator=g, device="cuda").to(torch.bfloat16)
            ref = F.linear(x.float(), wd.float())
            row = {"shape": name, "m": m, "n": n, "k": k, "tflop": 2 * m * n * k / 1e12}
            row["bf16_ms"] = timed(lambda: F.linear(x, wd))
            row["quantize_ms"] = timed(lambda: quantize_activations(x, 128))
            row["ours_ms"] = timed(lambda: linear(x, w, ws, (128, 128)))
            xq, xs = quantize_activations(x, 128)
            for t in TILES:
                try:
                    out = block_fp8_gemm(xq, xs, w, ws, (128, 128), torch.bfloat16, t)
                    err = float((out.float() - ref).norm() / ref.norm())
                    row[f"triton{t}_ms"] = timed(lambda t=t: block_fp8_gemm(xq, xs, w, ws, (128, 128),
                                                                            torch.bfloat16, t))
                    row[f"triton{t}_err"] = round(err, 4)
                except Exception as e:      # noqa: BLE001 - a config a card can't take is a finding
                    row[f"triton{t}"] = repr(e)[:200]
            try:
                sa = xs.t().contiguous().t()         # 1x128 blocks: scales outer-dim-major
                out = torch._scaled_mm(xq, w.t(), scale_a=sa, scale_b=ws.t(), out_dtype=torch.bfloat16)
                row["cublas_err"] = round(float((out.float() - ref).norm() / ref.norm()), 4)
                row["cublas_ms"] = timed(lambda: torch._scaled_mm(xq, w.t(), scale_a=sa, scale_b=ws.t(),
                                                                  out_dtype=torch.bfloat16))
            except Exception as e:          # noqa: BLE001
                row["cublas"] = repr(e)[:300]
            print(json.dumps(row), flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
