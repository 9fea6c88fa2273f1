"""Temperature sampling in one pass over the logits (Triton): the Gumbel-max pick of
lmbatch.engine.sampling, the same noise and the same token, without the dozen [rows, vocab] int64
tensors the PyTorch ops write (at 512 rows of a 49k vocabulary, ~10 GB of device traffic a step,
more than a small model's decode step itself).

Each program takes one row and walks its vocabulary in blocks: the noise hash in wrapping int64
arithmetic (as torch's), the uniform and Gumbel noise in float32 with IEEE division and libdevice's
log (as torch's CUDA kernels compute them), and the first index of the maximum (as torch.argmax). Each
lane of a block keeps its own maximum and the first column it was at (a later column wins only if
larger); the lanes are reduced once at the end, to the least column at the overall maximum: no reduction
across the block at every one of its ~75 steps (a 152k vocabulary)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

try:
    from triton.language.extra import libdevice
except ImportError:     # Triton releases that keep it only under the CUDA backend
    from triton.language.extra.cuda import libdevice

BLOCK = 2048


@triton.jit
def _gumbel_argmax_kernel(L, ROWS, SEEDS, STEPS, TEMP, OUT, V, stride,  # type: ignore[no-untyped-def]
                          K_SEED, K_STEP, K_TOKEN, M1, M2, BLOCK: tl.constexpr):
    k = tl.program_id(0)
    row = tl.load(ROWS + k).to(tl.int64)
    base = tl.load(SEEDS + k) * K_SEED + tl.load(STEPS + k) * K_STEP
    temp = tl.load(TEMP + k)
    lane = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)      # each lane's maximum so far, and its first column
    best_i = tl.zeros([BLOCK], tl.int32)
    for start in range(0, V, BLOCK):
        cols = start + lane
        ok = cols < V
        z = tl.load(L + row * stride + cols, mask=ok, other=float("-inf")).to(tl.float32)
        z = libdevice.div_rn(z, temp)
        x = base + cols.to(tl.int64) * K_TOKEN
        x = (x ^ ((x >> 33) & 0x7FFFFFFF)) * M1
        x = (x ^ ((x >> 33) & 0x7FFFFFFF)) * M2
        x = x ^ ((x >> 33) & 0x7FFFFFFF)
        bits = (x >> 8) & 0xFFFFFF
        u = tl.minimum((bits.to(tl.float32) + 0.5) * 5.960464477539063e-08, 0.9999999403953552)  # 2^-24, 1 - 2^-24
        v = z + -libdevice.log(-libdevice.log(u))
        better = ok & (v > best)
        best_i = tl.where(better, cols, best_i)
        best = tl.where(better, v, best)
    m = tl.max(best, axis=0)
    tl.store(OUT + k, tl.min(tl.where(best == m, best_i, V), axis=0).to(tl.int64))   # the first column at the maximum


def gumbel_argmax(logits: torch.Tensor, rows: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor,
                  temperature: torch.Tensor, constants: tuple[int, int, int, int, int]) -> torch.Tensor:
    """For each k: argmax over the vocabulary of logits[rows[k]] / temperature[k] + Gumbel noise of
    (seeds[k], steps[k], token) (`constants`: the hash's K_SEED, K_STEP, K_TOKEN, M1, M2). logits:
    [*, V] with a unit last stride; rows, seeds, steps int64 and temperature float32, on its device."""
    assert logits.stride(-1) == 1, "logits rows must be contiguous"
    n = len(rows)
    out = torch.empty(n, dtype=torch.int64, device=logits.device)
    if n:
        _gumbel_argmax_kernel[(n,)](logits, rows, seeds, steps, temperature, out, logits.shape[-1],
                                    logits.stride(0), *constants, BLOCK=BLOCK, num_warps=8)
    return out
