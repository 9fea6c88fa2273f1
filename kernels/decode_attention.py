"""Triton decode attention over a paged KV pool with page size 1: one query token per row.

A decode step is bound by reading each row's KV. The extend kernel gives every query head its own
program, so a KV head's keys are read once per query head that shares it (6 times for Qwen2.5-1.5B);
and a long row is one program walking all its keys while others wait. Here a program takes one row,
one KV head with all its query heads (a block of the dot product), and one of SPLITS contiguous
ranges of the row's keys; it writes that range's softmax-weighted values and log-sum-exp, and a
second kernel merges the ranges of each (row, head). SPLITS is fixed per call, so a CUDA graph
captures it; a short row leaves its last ranges empty (they weigh nothing in the merge).

Where rows are many (every SM holds several programs without splitting keys), one program per (row, KV
head) walks all of the row's keys and writes the output itself (`_whole_kernel`): no partials to write and
read back, one kernel instead of two (a decode step's kernels are short: each launch and drain is a
few microseconds of a step's few milliseconds). The same kernel ends cascade attention: it merges the
partials of a row's shared levels (kernels/cascade_attention.py) into its own keys' softmax.

WINDOW and SOFTCAP as in the extend kernel: the row's query sits at its last position. SINKS (gpt-oss)
enter where a row is normalized (the merge, or the one-program kernel's end): each head's sink logit
joins the summed weights, once.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmbatch.kernels.extend_attention import attend_block


@triton.jit
def _split_kernel(Q, K, V, MidO, MidL, kv_indices, kv_indptr, kv_skip,  # type: ignore[no-untyped-def]
                  scale, window, stride_qt, stride_qh, stride_ks, stride_kh,
                  SOFTCAP: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, SKIP: tl.constexpr):
    row, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    kv_start = tl.load(kv_indptr + row)
    kv_len = tl.load(kv_indptr + row + 1) - kv_start
    if SKIP:                                        # the row's first keys are read elsewhere (cascade levels)
        skipped = tl.load(kv_skip + row)
        kv_start += skipped
        kv_len -= skipped
    begin = 0
    if window > 0:                                  # the query (position kv_len - 1) sees the last WINDOW keys
        begin = tl.maximum(kv_len - window, 0)
    per = tl.cdiv(tl.cdiv(kv_len - begin, SPLITS), BLOCK_N) * BLOCK_N
    lo = begin + split * per
    hi = tl.minimum(lo + per, kv_len)

    h = tl.arange(0, BLOCK_H)
    heads = kv_head * GROUP + h
    head_ok = h < GROUP
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    q = tl.load(Q + row * stride_qt + heads[:, None] * stride_qh + dims[None, :],
                mask=head_ok[:, None] & dim_ok[None, :], other=0.0)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < hi
        slots = tl.load(kv_indices + kv_start + cols, mask=col_ok, other=0).to(tl.int64)
        kv_off = slots[:, None] * stride_ks + kv_head * stride_kh + dims[None, :]
        m_i, l_i, acc = attend_block(q, K, V, kv_off, col_ok[:, None] & dim_ok[None, :], col_ok[None, :], scale, m_i,
                                     l_i, acc, SOFTCAP)
    seen = l_i > 0
    out = tl.where(seen[:, None], acc / tl.where(seen, l_i, 1.0)[:, None], 0.0)
    lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
    mid = (row * (GROUP * tl.num_programs(1)) + heads) * SPLITS + split        # MidL[row, head, split]
    tl.store(MidO + mid[:, None] * HEAD_DIM + dims[None, :], out, mask=head_ok[:, None] & dim_ok[None, :])
    tl.store(MidL + mid, lse, mask=head_ok)


@triton.jit
def _merge_kernel(MidO, MidL, O, Sinks, stride_ot, stride_oh,  # type: ignore[no-untyped-def]
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS: tl.constexpr, HAS_SINKS: tl.constexpr):
    row, head = tl.program_id(0), tl.program_id(1)
    base = row * tl.num_programs(1) + head
    s = tl.arange(0, SPLITS)
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    lse = tl.load(MidL + base * SPLITS + s)
    top = tl.max(lse, axis=0)
    if HAS_SINKS:
        sink = tl.load(Sinks + head).to(tl.float32)
        top = tl.maximum(top, sink)
    w = tl.exp(lse - top)                           # an empty range: lse -inf, weight 0
    o = tl.load(MidO + (base * SPLITS + s)[:, None] * HEAD_DIM + dims[None, :], mask=dim_ok[None, :], other=0.0)
    total = tl.sum(w, axis=0)
    if HAS_SINKS:
        total += tl.exp(sink - top)
    out = tl.sum(w[:, None] * o, axis=0) / total
    tl.store(O + row * stride_ot + head * stride_oh + dims, out.to(O.dtype.element_ty), mask=dim_ok)


@triton.jit
def _whole_kernel(Q, K, V, O, MidO, MidL, kv_indices, kv_indptr, kv_skip, levels,  # type: ignore[no-untyped-def]
                  Sinks, scale, window, stride_qt, stride_qh, stride_ks, stride_kh, stride_ot, stride_oh,
                  SOFTCAP: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, LEVELS: tl.constexpr, SPLITS: tl.constexpr,
                  HAS_SINKS: tl.constexpr):
    """One (row, KV head): the row's keys past its first skip[row] (its shared levels', LEVELS > 0) in one
    online softmax, then the levels' partials MidO/MidL [row, level, head, split] merged in, then the output."""
    row, kv_head = tl.program_id(0), tl.program_id(1)
    kv_start = tl.load(kv_indptr + row)
    kv_len = tl.load(kv_indptr + row + 1) - kv_start
    begin = 0
    if LEVELS > 0:
        begin = tl.load(kv_skip + row)
    if window > 0:
        begin = tl.maximum(kv_len - window, 0)
    h = tl.arange(0, BLOCK_H)
    heads = kv_head * GROUP + h
    head_ok = h < GROUP
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    q = tl.load(Q + row * stride_qt + heads[:, None] * stride_qh + dims[None, :],
                mask=head_ok[:, None] & dim_ok[None, :], other=0.0)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for n0 in range(begin, kv_len, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < kv_len
        slots = tl.load(kv_indices + kv_start + cols, mask=col_ok, other=0).to(tl.int64)
        kv_off = slots[:, None] * stride_ks + kv_head * stride_kh + dims[None, :]
        m_i, l_i, acc = attend_block(q, K, V, kv_off, col_ok[:, None] & dim_ok[None, :], col_ok[None, :], scale, m_i,
                                     l_i, acc, SOFTCAP)
    if LEVELS > 0:      # each shared level's key ranges: normalized values and log-sum-exp, weighed in
        n = tl.load(levels + row)
        num_heads = GROUP * tl.num_programs(1)
        for level in tl.static_range(LEVELS):
            on = head_ok & ((h * 0 + level) < n)     # a mask of the block's shape (interpreters refuse a scalar one)
            for split in tl.static_range(SPLITS):
                mid = ((row * LEVELS + level) * num_heads + heads) * SPLITS + split
                lse = tl.load(MidL + mid, mask=on, other=float("-inf"))
                part = tl.load(MidO + mid[:, None] * HEAD_DIM + dims[None, :], mask=on[:, None] & dim_ok[None, :],
                               other=0.0)
                m_new = tl.maximum(m_i, lse)
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha, beta = tl.exp(m_i - m_safe), tl.exp(lse - m_safe)
                l_i = l_i * alpha + beta
                acc = acc * alpha[:, None] + beta[:, None] * part
                m_i = m_new
    if HAS_SINKS:       # one more column of each head's softmax: its sink logit
        sink = tl.load(Sinks + heads, mask=head_ok, other=0.0).to(tl.float32)
        top = tl.maximum(m_i, sink)
        alpha = tl.exp(m_i - top)
        l_i = l_i * alpha + tl.exp(sink - top)
        acc = acc * alpha[:, None]
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(O + row * stride_ot + heads[:, None] * stride_oh + dims[None, :], out.to(O.dtype.element_ty),
             mask=head_ok[:, None] & dim_ok[None, :])


# programs (rows x KV heads) from which a row's keys stay in one program (`_whole_kernel`): H200, 1.5B
# shape (benchmarks/bench_decode_attention.py, issue 55's step table)
WHOLE_FROM = 512


def splits_for(rows: int, kv_heads: int) -> int:
    """Key ranges per (row, KV head): enough programs to fill a large GPU when rows are few; one where
    rows alone fill it."""
    programs = rows * kv_heads
    return 16 if programs < 256 else 8 if programs < WHOLE_FROM else 1


def whole(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, kv_indices: torch.Tensor,
          kv_indptr: torch.Tensor, scale: float, window: int | None = None, softcap: float = 0.0,
          shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
          sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention with each (row, KV head) in one program. `shared` = (skip, levels, MidO, MidL): a
    row's first skip[row] keys are its levels', given as partials (kernels/cascade_attention.py); `sinks`:
    [H], each head's sink logit (gpt-oss)."""
    T, H, D = q.shape
    kvh = k_pool.shape[1]
    group = H // kvh
    out = torch.empty_like(q)
    skip, levels, mid_o, mid_l = shared if shared is not None else (kv_indptr, kv_indptr, out, out)
    n_levels, n_splits = (mid_l.shape[1], mid_l.shape[3]) if shared is not None else (0, 1)
    assert shared is None or not window, "a windowed layer reads its rows' last keys only"
    _whole_kernel[(T, kvh)](q, k_pool, v_pool, out, mid_o, mid_l, kv_indices, kv_indptr, skip, levels,
                            kv_indptr if sinks is None else sinks, scale, window or 0, q.stride(0), q.stride(1),
                            k_pool.stride(0), k_pool.stride(1), out.stride(0), out.stride(1),
                            SOFTCAP=float(softcap), GROUP=group, HEAD_DIM=D, BLOCK_D=triton.next_power_of_2(D),
                            BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_N=64, LEVELS=n_levels,
                            SPLITS=n_splits, HAS_SINKS=sinks is not None, num_warps=4, num_stages=2)
    return out


def decode_partials(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, kv_indices: torch.Tensor,
                    kv_indptr: torch.Tensor, scale: float, window: int | None = None, softcap: float = 0.0,
                    splits: int | None = None, skip: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Each (row, head)'s key ranges: weighted values [T, H, splits, D] and log-sum-exps [T, H, splits]
    (float32), and the number of ranges. With `skip` ([T] int32, no window), row i's first skip[i] keys
    are left out."""
    T, H, D = q.shape
    kvh = k_pool.shape[1]
    group = H // kvh
    splits = splits or splits_for(T, kvh)
    mid_o = torch.empty((T, H, splits, D), dtype=torch.float32, device=q.device)
    mid_l = torch.empty((T, H, splits), dtype=torch.float32, device=q.device)
    assert skip is None or not window, "a windowed layer reads its rows' last keys only"
    _split_kernel[(T, kvh, splits)](q, k_pool, v_pool, mid_o, mid_l, kv_indices, kv_indptr,
                                    kv_indptr if skip is None else skip, scale, window or 0,
                                    q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1),
                                    SOFTCAP=float(softcap), GROUP=group, HEAD_DIM=D, BLOCK_D=triton.next_power_of_2(D),
                                    BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_N=64, num_warps=4,
                                    num_stages=2, SPLITS=splits, SKIP=skip is not None)
    return mid_o, mid_l, splits


def decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, kv_indices: torch.Tensor,
                     kv_indptr: torch.Tensor, scale: float, window: int | None = None, softcap: float = 0.0,
                     splits: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q: [T, H, D], one query per row, row i over keys kv_indices[kv_indptr[i]:kv_indptr[i + 1]] (its
    last key its own position); k_pool/v_pool: [slots, KVH, D]; `sinks`: [H], each head's sink logit
    (gpt-oss). Returns [T, H, D]."""
    T, H, D = q.shape
    if (splits or splits_for(T, k_pool.shape[1])) == 1:
        return whole(q, k_pool, v_pool, kv_indices, kv_indptr, scale, window, softcap, sinks=sinks)
    mid_o, mid_l, splits = decode_partials(q, k_pool, v_pool, kv_indices, kv_indptr, scale, window, softcap, splits)
    out = torch.empty_like(q)
    _merge_kernel[(T, H)](mid_o, mid_l, out, mid_l if sinks is None else sinks, out.stride(0), out.stride(1),
                          HEAD_DIM=D, BLOCK_D=triton.next_power_of_2(D), SPLITS=splits, HAS_SINKS=sinks is not None)
    return out
