"""CPU sampling's noise (lmbatch/engine/sampling.py): the whole batch's [rows, vocab] noise at once, as the
module's formula states it (and CUDA without the Triton kernel still runs it), beside `noisy_argmax`, a few
rows at a time in place, which the CPU runs; both give the same tokens (checked here too).

    python benchmarks/bench_cpu_sampling.py [--rows 64,256,1024] [--vocab 49152] [--repeat 3]
    python benchmarks/bench_cpu_sampling.py --write-tiny DIR --tokenizer TOK    # a Qwen2 of 64 wide, 2 layers, random
    # float32 weights, TOK's vocabulary (the embedded SmolLM2's: 49,152): its steps are mostly sampling
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from lmbatch.engine import sampling


def whole(z: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    return (z + -torch.log(-torch.log(sampling._uniform(seeds, steps, z.shape[-1])))).argmax(dim=-1)


def best_of(fn, repeat: int, *args) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t)
    return min(times)


def write_tiny(target: Path, tokenizer: Path) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from random_checkpoint import ROOT, write_checkpoint

    cfg = json.loads((ROOT / "presets" / "qwen2.5-1.5b" / "config.json").read_text())
    cfg.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               vocab_size=len(json.loads((tokenizer / "tokenizer.json").read_text())["model"]["vocab"]),
               torch_dtype="float32", bos_token_id=1, eos_token_id=2, max_position_embeddings=8192)
    write_checkpoint(cfg, target, tokenizer)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="64,256,1024")
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--write-tiny", type=Path)
    ap.add_argument("--tokenizer", type=Path)
    args = ap.parse_args()
    if args.write_tiny:
        write_tiny(args.write_tiny, args.tokenizer)
        return
    print(f"torch threads {torch.get_num_threads()}, vocab {args.vocab}, CPU_ROWS {sampling.CPU_ROWS}")
    for rows in map(int, args.rows.split(",")):
        g = torch.Generator().manual_seed(rows)
        z = torch.randn(rows, args.vocab, generator=g)
        seeds, steps = torch.randint(0, 2**40, (rows,), generator=g), torch.randint(0, 500, (rows,), generator=g)
        assert torch.equal(whole(z, seeds, steps), sampling.noisy_argmax(z, seeds, steps))
        a = best_of(whole, args.repeat, z, seeds, steps)
        b = best_of(sampling.noisy_argmax, args.repeat, z, seeds, steps)
        print(f"{rows:5d} rows: whole batch {a * 1e3:8.1f} ms, a few rows at a time {b * 1e3:8.1f} ms ({b / a:.2f}x)")


if __name__ == "__main__":
    main()
