"""Triton extend/decode attention over a paged KV pool with page size 1.

Each program handles one sequence, one query head and a block of BLOCK_M of the sequence's new
tokens (the last q_len of its kv_len tokens). It walks the sequence's slot table in blocks of
BLOCK_N, gathers K/V rows from the pool, and keeps an online softmax (running max and sum), so a
cached prefix and the causal new part are one loop. Decode is the case q_len == 1.

With a WINDOW (> 0) a query at position p sees keys p - WINDOW + 1 .. p only (transformers' sliding
window), and the walk starts at the first key the block's first row sees; with a SOFTCAP (> 0) each
scaled score s becomes SOFTCAP * tanh(s / SOFTCAP) before masking (Gemma 2); with SINKS (gpt-oss) each
head's learned logit joins its softmax's denominator, once, when the row is normalized.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def attend_block(q, K, V, kv_off, kv_ok, visible, scale, m_i, l_i, acc,  # type: ignore[no-untyped-def]
                 SOFTCAP: tl.constexpr):
    """A block of keys into the online softmax of the query rows `q`: K/V rows at `kv_off` (loaded where
    `kv_ok`), scores where `visible`; returns the running max, sum and weighted values."""
    k = tl.load(K + kv_off, mask=kv_ok, other=0.0)
    s = tl.dot(q, tl.trans(k)).to(tl.float32) * scale
    if SOFTCAP > 0:
        s = SOFTCAP * (2.0 * tl.sigmoid(2.0 * s / SOFTCAP) - 1.0)     # SOFTCAP * tanh(s / SOFTCAP)
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(V + kv_off, mask=kv_ok, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
    return m_new, l_i, acc


@triton.jit
def sink_normalize(acc, m_i, l_i, Sinks, head, HAS_SINKS: tl.constexpr):  # type: ignore[no-untyped-def]
    """The weighted values over their weights' sum; with sinks, the head's sink logit exp'd into that sum
    (against the larger of it and the running max, so neither overflows)."""
    if HAS_SINKS:
        sink = tl.load(Sinks + head).to(tl.float32)
        top = tl.maximum(m_i, sink)
        keep = tl.exp(m_i - top)
        return acc * (keep / (l_i * keep + tl.exp(sink - top)))[:, None]
    return acc / l_i[:, None]


@triton.jit
def _extend_kernel(Q, K, V, O, kv_indices, qo_indptr, kv_indptr, Sinks,  # type: ignore[no-untyped-def]
                   scale, window, stride_qt, stride_qh, stride_ks, stride_kh, stride_ot, stride_oh,
                   SOFTCAP: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_SINKS: tl.constexpr):
    seq, head, mblock = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start = tl.load(qo_indptr + seq)
    q_len = tl.load(qo_indptr + seq + 1) - q_start
    if mblock * BLOCK_M >= q_len:
        return
    kv_start = tl.load(kv_indptr + seq)
    kv_len = tl.load(kv_indptr + seq + 1) - kv_start
    prefix = kv_len - q_len
    kv_head = head // GROUP

    rows = mblock * BLOCK_M + tl.arange(0, BLOCK_M)          # index among the new tokens
    dims = tl.arange(0, BLOCK_D)
    row_ok = rows < q_len
    dim_ok = dims < HEAD_DIM
    q = tl.load(Q + (q_start + rows)[:, None] * stride_qt + head * stride_qh + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    qpos = prefix + rows                                     # position in the sequence

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    kv_end = tl.minimum(kv_len, prefix + (mblock + 1) * BLOCK_M)  # keys the block's last row sees
    kv_begin = 0
    if window > 0:                                           # keys the block's first row sees
        kv_begin = tl.maximum(prefix + mblock * BLOCK_M - window + 1, 0) // BLOCK_N * BLOCK_N
    for n0 in range(kv_begin, kv_end, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < kv_end
        slots = tl.load(kv_indices + kv_start + cols, mask=col_ok, other=0).to(tl.int64)
        kv_off = slots[:, None] * stride_ks + kv_head * stride_kh + dims[None, :]
        visible = (cols[None, :] <= qpos[:, None]) & col_ok[None, :]
        if window > 0:
            visible = visible & (cols[None, :] > qpos[:, None] - window)
        m_i, l_i, acc = attend_block(q, K, V, kv_off, col_ok[:, None] & dim_ok[None, :], visible, scale, m_i, l_i,
                                     acc, SOFTCAP)
    out = sink_normalize(acc, m_i, l_i, Sinks, head, HAS_SINKS)
    tl.store(O + (q_start + rows)[:, None] * stride_ot + head * stride_oh + dims[None, :],
             out.to(O.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


def extend_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, kv_indices: torch.Tensor,
                     qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, max_q_len: int, scale: float,
                     window: int | None = None, softcap: float = 0.0, fixed: bool = False,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q: [T, H, D]; k_pool/v_pool: [slots, KVH, D]; indptrs int32 on the device. Returns [T, H, D].
    `fixed` (deterministic mode): blocks of 16 queries whatever the batch's longest (the dot's shape, and
    so its order of sums, stays one). `sinks`: [H], each head's sink logit (gpt-oss)."""
    T, H, D = q.shape
    group = H // k_pool.shape[1]
    out = torch.empty_like(q)
    block_m = 64 if max_q_len > 16 and not fixed else 16
    grid = (qo_indptr.numel() - 1, H, triton.cdiv(max_q_len, block_m))
    _extend_kernel[grid](q, k_pool, v_pool, out, kv_indices, qo_indptr, kv_indptr,
                         q if sinks is None else sinks, scale, window or 0,
                         q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), out.stride(0), out.stride(1),
                         SOFTCAP=float(softcap), GROUP=group, HEAD_DIM=D, BLOCK_D=triton.next_power_of_2(D),
                         BLOCK_M=block_m, BLOCK_N=64, HAS_SINKS=sinks is not None, num_warps=4, num_stages=2)
    return out
