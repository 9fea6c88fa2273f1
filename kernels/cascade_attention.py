"""Shared-prefix (cascade) decode attention over a paged KV pool with page size 1.

Rows of a decode step whose contexts share a prefix of the radix tree (a prompt's k samples, a
program's forked branches, every question after one fixed few-shot prompt) hold the same KV slots
for it. Plain decode reads that prefix once per row; here it is read once per block of rows:

- a *shared level* is a run of keys that a set of rows all hold (a segment of the tree); its rows
  are cut into blocks of ROWS rows, and a program takes one block, one KV head and one of SPLITS
  ranges of the level's keys. The block's rows' query heads of that KV head are the rows of one
  matrix (ROWS x GROUP of them), so each key block feeds one tensor-core dot for the whole block.
  It writes each row's softmax-weighted values and log-sum-exp for its level;
- each row's own keys (past its deepest shared level: its output tokens) go through the decode kernel
  (kernels/decode_attention.py), which skips the row's first `skip[row]` keys, and the row's levels
  are weighed in by their log-sum-exp, as FlashInfer's cascade attention and Hydragen merge a prefix's
  attention with a suffix's: where rows fill the GPU, in the same program as the own keys (one
  (row, KV head) a program, `_whole_kernel`); where they are few, the own keys in ranges of their own
  and a merge per (row, head) after.

The level table lives on the device and is read by a fixed grid (PROGRAMS programs walk the blocks),
so a CUDA graph captures a step once whatever the sharing; with no level the step is plain decode.
No sliding window here (a windowed layer reads its rows' last keys only: plain decode).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmbatch.kernels.decode_attention import decode_partials, splits_for, whole
from lmbatch.kernels.extend_attention import attend_block

LEVELS = 3          # shared levels a row may have (deeper sharing is read as the row's own keys)
# measured side by side (benchmarks/bench_decode_attention.py, H200, 1.5B shape, 2026-11-28): query rows of
# 128 on 8 warps beat 64 on 4 by 10-20% at 256-512 rows; a level's keys cut into as many ranges as give
# about TARGET_PROGRAMS programs (4 at 256 rows, 2 at 512: 53 and 95 us a layer, against 65 and 122 with 8)
BLOCK_M = 128       # query rows of a shared program: ROWS rows x GROUP query heads
SHARED_SPLITS = 8   # the most key ranges per (block, KV head) of a shared level
TARGET_PROGRAMS = 128
PROGRAMS = 64       # programs walking the level blocks, per (KV head, key range)
SHARED_BLOCK_N, SHARED_WARPS, SHARED_STAGES = 64, 8, 3      # the shared program's key block, warps, stages
# 3 stages against 2, one layer as a graph replays it (1.5B shape, H200, bench_decode_attention.py): 0.86-0.93x
# at 256, 512 and 1,024 rows, for 16 samples of 800 keys and for a shared 2,000-key prefix (BENCHMARKS.md).
# Heads wider than 128 keep 2: three stages of their key and value blocks with the query block pass the
# shared memory


def rows_per_block(group: int) -> int:
    """Rows a shared program takes: as many as fill BLOCK_M query rows with their GROUP heads."""
    return BLOCK_M // group


def shared_splits(rows: int, group: int, kv_heads: int) -> int:
    """Key ranges a shared level is cut into for a step of `rows` rows: a power of two (at most SHARED_SPLITS)
    that gives about TARGET_PROGRAMS programs where every row shares one level. Fewer ranges mean fewer
    partials to write and merge; more, more programs to read the level."""
    blocks = -(-rows // rows_per_block(group)) * kv_heads
    want = max(1, TARGET_PROGRAMS // blocks)
    return min(SHARED_SPLITS, 1 << (want.bit_length() - 1))


@triton.jit
def _shared_kernel(Q, K, V, MidO, MidL, kv_indices, blocks, block_rows, n_blocks,  # type: ignore[no-untyped-def]
                   scale, stride_qt, stride_qh, stride_ks, stride_kh,
                   SOFTCAP: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_M: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr,
                   LEVELS: tl.constexpr, PROGRAMS: tl.constexpr):
    pid, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    num_heads = GROUP * tl.num_programs(1)
    m = tl.arange(0, BLOCK_M)
    local, heads = m // GROUP, kv_head * GROUP + m % GROUP
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    for blk in range(pid, tl.load(n_blocks), PROGRAMS):
        kv_start = tl.load(blocks + blk * 4)            # [start in kv_indices, keys, level, rows]
        kv_len = tl.load(blocks + blk * 4 + 1)
        level = tl.load(blocks + blk * 4 + 2)
        row_ok = local < tl.load(blocks + blk * 4 + 3)
        rows = tl.load(block_rows + blk * ROWS + local, mask=row_ok, other=0)
        q = tl.load(Q + rows[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :],
                    mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
        per = tl.cdiv(tl.cdiv(kv_len, SPLITS), BLOCK_N) * BLOCK_N
        lo = split * per
        hi = tl.minimum(lo + per, kv_len)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for n0 in range(lo, hi, BLOCK_N):
            cols = n0 + tl.arange(0, BLOCK_N)
            col_ok = cols < hi
            slots = tl.load(kv_indices + kv_start + cols, mask=col_ok, other=0).to(tl.int64)
            kv_off = slots[:, None] * stride_ks + kv_head * stride_kh + dims[None, :]
            m_i, l_i, acc = attend_block(q, K, V, kv_off, col_ok[:, None] & dim_ok[None, :], col_ok[None, :], scale,
                                         m_i, l_i, acc, SOFTCAP)
        seen = l_i > 0
        out = tl.where(seen[:, None], acc / tl.where(seen, l_i, 1.0)[:, None], 0.0)
        lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
        mid = ((rows * LEVELS + level) * num_heads + heads) * SPLITS + split    # MidL[row, level, head, split]
        tl.store(MidO + mid[:, None] * HEAD_DIM + dims[None, :], out, mask=row_ok[:, None] & dim_ok[None, :])
        tl.store(MidL + mid, lse, mask=row_ok)


@triton.jit
def _merge_kernel(OwnO, OwnL, MidO, MidL, levels, O, stride_ot, stride_oh,  # type: ignore[no-untyped-def]
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, OWN_SPLITS: tl.constexpr, SPLITS: tl.constexpr,
                  LEVELS: tl.constexpr):
    row, head = tl.program_id(0), tl.program_id(1)
    num_heads = tl.num_programs(1)
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    base = row * num_heads + head
    s = tl.arange(0, OWN_SPLITS)
    lse = tl.load(OwnL + base * OWN_SPLITS + s)
    mx = tl.max(lse, axis=0)                            # finite: a row's own keys hold at least its new token
    w = tl.exp(lse - mx)                                # an empty range: lse -inf, weight 0
    den = tl.sum(w, axis=0)
    acc = tl.sum(w[:, None] * tl.load(OwnO + (base * OWN_SPLITS + s)[:, None] * HEAD_DIM + dims[None, :],
                                      mask=dim_ok[None, :], other=0.0), axis=0)
    n = tl.load(levels + row)
    t = tl.arange(0, SPLITS)
    for level in tl.static_range(LEVELS):
        mid = ((row * LEVELS + level) * num_heads + head) * SPLITS + t
        on = (t * 0 + level) < n        # [SPLITS]: whether the row has this level (a mask of the block's shape)
        lse_l = tl.load(MidL + mid, mask=on, other=float("-inf"))
        mx_l = tl.maximum(mx, tl.max(lse_l, axis=0))
        w_l = tl.exp(lse_l - mx_l)
        o_l = tl.load(MidO + mid[:, None] * HEAD_DIM + dims[None, :], mask=on[:, None] & dim_ok[None, :], other=0.0)
        alpha = tl.exp(mx - mx_l)
        den = den * alpha + tl.sum(w_l, axis=0)
        acc = acc * alpha + tl.sum(w_l[:, None] * o_l, axis=0)
        mx = mx_l
    tl.store(O + row * stride_ot + head * stride_oh + dims, (acc / den).to(O.dtype.element_ty), mask=dim_ok)


def cascade_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, kv_indices: torch.Tensor,
                      kv_indptr: torch.Tensor, scale: float, softcap: float, levels: "CascadeLevels") -> torch.Tensor:
    """q: [T, H, D], one query per row over keys kv_indices[kv_indptr[i]:kv_indptr[i + 1]] as plain decode;
    `levels` says which of those keys rows share (see CascadeLevels). Returns [T, H, D]."""
    T, H, D = q.shape
    kvh = k_pool.shape[1]
    group = H // kvh
    ranges = shared_splits(T, group, kvh)
    mid_o = torch.empty((T, LEVELS, H, ranges, D), dtype=torch.float32, device=q.device)
    mid_l = torch.empty((T, LEVELS, H, ranges), dtype=torch.float32, device=q.device)
    block_d = triton.next_power_of_2(D)
    _shared_kernel[(PROGRAMS, kvh, ranges)](
        q, k_pool, v_pool, mid_o, mid_l, kv_indices, levels.blocks, levels.block_rows, levels.n_blocks, scale,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), SOFTCAP=float(softcap), GROUP=group,
        HEAD_DIM=D, BLOCK_D=block_d, BLOCK_M=BLOCK_M, ROWS=rows_per_block(group), BLOCK_N=SHARED_BLOCK_N,
        SPLITS=ranges, LEVELS=LEVELS, PROGRAMS=PROGRAMS, num_warps=SHARED_WARPS,
        num_stages=SHARED_STAGES if block_d <= 128 else min(SHARED_STAGES, 2))
    if splits_for(T, kvh) == 1:     # rows fill the GPU: own keys and the merge in one program a (row, KV head)
        return whole(q, k_pool, v_pool, kv_indices, kv_indptr, scale, None, softcap,
                     (levels.skip[:T], levels.levels[:T], mid_o, mid_l))
    own_o, own_l, splits = decode_partials(q, k_pool, v_pool, kv_indices, kv_indptr, scale, None, softcap,
                                           skip=levels.skip[:T])
    out = torch.empty_like(q)
    _merge_kernel[(T, H)](own_o, own_l, mid_o, mid_l, levels.levels, out, out.stride(0), out.stride(1),
                          HEAD_DIM=D, BLOCK_D=block_d, OWN_SPLITS=splits, SPLITS=ranges, LEVELS=LEVELS)
    return out


class CascadeLevels:
    """The device tables of a step's shared levels, for up to `rows` rows (int32):
    skip [rows] (keys at the start of a row read by its levels), levels [rows] (how many), blocks
    [max_blocks, 4] (start in kv_indices, keys, level, rows), block_rows [max_blocks, ROWS], n_blocks [1]."""

    def __init__(self, rows: int, group: int, device: torch.device | str):
        self.per_block = rows_per_block(group)
        self.max_blocks = max(LEVELS * rows // 2, 1)
        self.skip = torch.zeros(rows, dtype=torch.int32, device=device)
        self.levels = torch.zeros(rows, dtype=torch.int32, device=device)
        self.blocks = torch.zeros((self.max_blocks, 4), dtype=torch.int32, device=device)
        self.block_rows = torch.zeros((self.max_blocks, self.per_block), dtype=torch.int32, device=device)
        self.n_blocks = torch.zeros(1, dtype=torch.int32, device=device)

    def clear(self) -> None:
        """No level (every row's keys its own): the tables a capture runs over. A capture's warm-up runs
        the kernels on its bucket's rows, which the last step's tables (rows and keys of a larger step)
        would read and write past."""
        self.n_blocks.zero_()
        self.skip.zero_()
        self.levels.zero_()
