"""Next-token choice for a batch of rows: greedy, or temperature + top-p sampling.

Sampling is the Gumbel-max trick with noise from a counter-based hash of (request seed, step,
token id): a request's draws depend on nothing else in its batch, and the whole batch samples on
its device in a few vectorized ops (no per-row host round trip).
"""
from __future__ import annotations

from operator import attrgetter

import numpy as np
import torch

from lmbatch.attention.base import to_device
from lmbatch.requests import SamplingParams

_M1, _M2 = -49064778989728563, -4265267296055464877   # 0xff51afd7ed558ccd, 0xc4ceb9fe1a85ec53 as int64
_K_SEED, _K_STEP, _K_TOKEN = 0x9E3779B97F4A7C15 - (1 << 64), 0x632BE59BD9B4E019, 0x2545F4914F6CDD1D
_TEMPERATURE, _SEED, _TOP_P = attrgetter("temperature"), attrgetter("seed"), attrgetter("top_p")
CPU_ROWS = 4    # rows of noise at a time on the CPU (`noisy_argmax`): 4 x 49,152 int64s stay in the cache


def _uniform(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, vocab] uniforms in (0, 1), a pure function of (seed, step, token id) (splitmix-style)."""
    tok = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    x = seeds[:, None] * _K_SEED + steps[:, None] * _K_STEP + tok[None] * _K_TOKEN
    for m in (_M1, _M2):
        x = (x ^ ((x >> 33) & ((1 << 31) - 1))) * m
    x = x ^ ((x >> 33) & ((1 << 31) - 1))
    return _unit((x >> 8) & ((1 << 24) - 1))


def _unit(bits: torch.Tensor) -> torch.Tensor:
    """24 random bits as a float32 in (0, 1), never 0 or 1: the top value, (2^24 - 0.5) / 2^24, rounds
    to 1.0 in float32, whose Gumbel noise is +inf: that token would win whatever its logit, and a
    masked one (-inf + inf = NaN, which argmax takes for the maximum) in spite of its grammar."""
    return ((bits.float() + 0.5) / (1 << 24)).clamp_(max=1 - 2 ** -24)


def sample(logits: torch.Tensor, params: list[SamplingParams], steps: list[int]) -> list[int]:
    """One token per row; `steps[i]` is how many tokens row i's request has sampled before."""
    return sample_on_device(logits, params, steps).tolist()


def sample_on_device(logits: torch.Tensor, params: list[SamplingParams], steps: list[int],
                     fused: bool = True) -> torch.Tensor:
    """As `sample`, the tokens left on the logits' device (launched: nothing waits for them). On CUDA,
    rows without top-p are picked by one Triton kernel (lmbatch.kernels.sampling: the same noise and
    token as the PyTorch ops here, which `fused=False` runs instead)."""
    n = len(params)
    temperature = np.fromiter(map(_TEMPERATURE, params), dtype=np.float32, count=n)
    hot = np.flatnonzero(temperature > 0)
    # every row sampled: no greedy pick to make first (a pass over the whole batch's logits)
    out = logits.argmax(dim=-1) if len(hot) < n else torch.empty(n, dtype=torch.int64, device=logits.device)
    if len(hot):
        # the rows' settings in two host arrays, each one copy that waits for nothing (a tensor made on
        # the device from a list waits for the work queued before it: the step's forward pass)
        seeds = np.fromiter(map(_SEED, params), dtype=np.int64, count=n)[hot]
        top_ps = np.fromiter(map(_TOP_P, params), dtype=np.float32, count=n)[hot]
        ints = to_device(torch.from_numpy(np.stack([hot, seeds, np.asarray(steps, dtype=np.int64)[hot]])),
                         logits.device)
        floats = to_device(torch.from_numpy(np.stack([temperature[hot], top_ps])), logits.device)
        idx, seeds_t, st = ints[0], ints[1], ints[2]
        nucleus = bool((top_ps < 1.0).any())
        if fused and logits.is_cuda and not nucleus and logits.stride(-1) == 1:
            from lmbatch.kernels.sampling import gumbel_argmax

            out[idx] = gumbel_argmax(logits, idx, seeds_t, st, floats[0], (_K_SEED, _K_STEP, _K_TOKEN, _M1, _M2))
            return out
        temp, top_p = floats[0][:, None], floats[1][:, None]
        z = logits[idx].float() / temp
        if nucleus:   # keep the smallest set of tokens reaching top_p
            probs = torch.softmax(z, dim=-1)
            sorted_p, order = probs.sort(dim=-1, descending=True)
            drop_sorted = sorted_p.cumsum(-1) - sorted_p >= top_p
            z = z.masked_fill(torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted), float("-inf"))
        if logits.is_cuda:
            gumbel = -torch.log(-torch.log(_uniform(seeds_t, st, z.shape[-1])))
            out[idx] = (z + gumbel).argmax(dim=-1)
        else:
            out[idx] = noisy_argmax(z, seeds_t, st)
    return out


def noisy_argmax(z: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """`(z - log(-log(_uniform(seeds, steps, vocab)))).argmax(-1)`, the same bits, CPU_ROWS rows at a time in
    buffers made once and updated in place: the whole batch's noise as [rows, vocab] int64 temporaries (ten of
    them, 400 MB each at 1,024 rows of a 49,152-token vocabulary) took a quarter of a CPU decode step, most of it
    their pages' first touch. Each row's noise is computed to a width of a multiple of 16, so every element takes
    the ops' vectorized path whatever the batch. `_uniform` states the same hash out of place on purpose: CUDA's
    unfused path runs it, and the tests hold this in-place form to it bit for bit."""
    rows, vocab = z.shape
    width = -(-vocab // 16) * 16
    tok = torch.arange(width, dtype=torch.int64).mul_(_K_TOKEN)
    base = seeds.mul(_K_SEED).add_(steps.mul(_K_STEP))
    n = min(rows, CPU_ROWS)
    x, t = torch.empty(n, width, dtype=torch.int64), torch.empty(n, width, dtype=torch.int64)
    u = torch.empty(n, width, dtype=torch.float32)
    out = torch.empty(rows, dtype=torch.int64)
    for a in range(0, rows, n):
        k = min(n, rows - a)
        xs, ts, us = x[:k], t[:k], u[:k]
        torch.add(base[a:a + k, None], tok[None], out=xs)
        for m in (_M1, _M2, None):
            torch.bitwise_right_shift(xs, 33, out=ts).bitwise_and_((1 << 31) - 1)
            xs.bitwise_xor_(ts)
            if m is not None:
                xs.mul_(m)
        us.copy_(xs.bitwise_right_shift_(8).bitwise_and_((1 << 24) - 1))
        us.add_(0.5).div_(1 << 24).clamp_(max=1 - 2 ** -24).log_().neg_().log_()
        out[a:a + k] = torch.sub(z[a:a + k], us[:, :vocab]).argmax(dim=-1)
    return out
