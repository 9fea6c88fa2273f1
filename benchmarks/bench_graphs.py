"""Device time of one decode-graph replay by row count (bucket), and the host time of the call that
prepares and launches it; dummy weights of a preset's shape, every row attending to `--context`
tokens of its own.

    python benchmarks/bench_graphs.py --preset llama-3.1-8b --context 250
    python benchmarks/bench_graphs.py --preset smollm2-135m --context 250
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from bench_decode import dummy_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="llama-3.1-8b")
    ap.add_argument("--context", type=int, default=250)
    ap.add_argument("--rows", default="8,16,24,32,36,40,44,48,56,64")
    ap.add_argument("--replays", type=int, default=50)
    args = ap.parse_args()

    from lmbatch.attention.kv_pool import KVPool
    from lmbatch.engine.graphs import DecodeGraphs

    model = dummy_model(args.preset)
    cfg = model.cfg
    rows = [int(r) for r in args.rows.split(",")]
    pool = KVPool(max(rows) * args.context + 1, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16,
                  "cuda")
    graphs = DecodeGraphs(model, pool, int(pool.alloc(1)), max(rows))
    rng = np.random.default_rng(0)
    with torch.inference_mode():
        graphs.capture_all()
        for b in rows:
            seqs = [np.asarray(pool.alloc(args.context)) for _ in range(b)]
            tokens, positions = rng.integers(0, 1000, b).tolist(), [args.context - 1] * b
            for _ in range(3):
                graphs.run(tokens, positions, seqs)
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            host = 0.0
            start.record()
            for _ in range(args.replays):
                t = time.perf_counter()
                graphs.run(tokens, positions, seqs)
                host += time.perf_counter() - t
            end.record()
            torch.cuda.synchronize()
            bucket = next(x for x in graphs.buckets if x >= b)
            print(f"{args.preset}, context {args.context}, {b} rows (bucket {bucket}): "
                  f"{start.elapsed_time(end) / args.replays:.3f} ms per replay on the device, "
                  f"{1e3 * host / args.replays:.3f} ms of host per call")
            for s in seqs:
                pool.free(torch.from_numpy(s))


if __name__ == "__main__":
    main()
