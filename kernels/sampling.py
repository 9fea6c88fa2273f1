"""Temperature sampling in one pass over the logits (Triton): the Gumbel-max pick of
lmbatch.engine.sampling, the same noise and the same token, without the dozen [rows, vocab] int64
tensors the PyTorch ops write (at 512 rows of a 49k vocabulary, ~10 GB of device traffic a step,
more than a small model's decode step itself).

Each program takes one row and walks its vocabulary in blocks: the noise hash in wrapping int64
arithmetic (as torch's), the uniform and Gumbel noise in float32 with IEEE division and libdevice's
log (as torch's CUDA kernels compute them), and the first index of the maximum (as torch.argmax)."""
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
    best = tl.full((), float("-inf"), tl.float32)
    best_i = tl.full((), 0, tl.int64)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
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
        v = tl.where(ok, v, float("-inf"))
        m = tl.max(v, axis=0)
        i = tl.argmax(v, axis=0, tie_break_left=True).to(tl.int64) + start
        better = m > best
        best_i = tl.where(better, i, best_i)
        best = tl.where(better, m, best)
    tl.store(OUT + k, best_i)


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
