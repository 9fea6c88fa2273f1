"""Routed experts on the GPU as two grouped GEMMs (Triton), with no host synchronization, so a decode
step that routes to experts can be captured in a CUDA graph.

Each token's k routed (token, expert) pairs are numbered slot = token * k + j. The slots are sorted
by expert and each expert's run of slots is padded to a multiple of BLOCK_M, so a block of BLOCK_M
rows belongs to one expert; a block past the last expert's rows is marked with expert E and exits.
The first GEMM multiplies each slot's token row by its expert's gate/up weights ([E, 2I, H]); the
activation runs over the slots ([T*k, 2I] -> [T*k, I]); the second GEMM multiplies each slot's row
by its expert's down weights ([E, H, I]) and by its routing weight; the k slots of a token are then
summed in float32 and rounded once.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl


@triton.jit
def _grouped_gemm_kernel(A, B, C, sorted_slots, block_expert, route_w,  # type: ignore[no-untyped-def]
                         num_slots, N, K, stride_am, stride_be, stride_bn, stride_bk, stride_cm,
                         A_ROW_DIV: tl.constexpr, WEIGHTED: tl.constexpr, NUM_EXPERTS: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         PRECISION: tl.constexpr):
    """C[slot, n] = sum_k A[slot // A_ROW_DIV, k] * B[expert, n, k] (times route_w[slot] if WEIGHTED)."""
    block, nblock = tl.program_id(0), tl.program_id(1)
    expert = tl.load(block_expert + block)
    if expert >= NUM_EXPERTS:
        return
    slots = tl.load(sorted_slots + block * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = slots < num_slots
    a_rows = (slots // A_ROW_DIV).to(tl.int64)
    cols = nblock * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    b_base = B + expert.to(tl.int64) * stride_be + cols[None, :] * stride_bn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + ks) < K
        a = tl.load(A + a_rows[:, None] * stride_am + (k0 + ks)[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)
        b = tl.load(b_base + (k0 + ks)[:, None] * stride_bk, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc += tl.dot(a, b, input_precision=PRECISION)
    if WEIGHTED:
        acc *= tl.load(route_w + slots, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    c_rows = slots.to(tl.int64)
    tl.store(C + c_rows[:, None] * stride_cm + cols[None, :], acc.to(C.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def _sort_slots(experts: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_slots, block_expert): slots grouped by expert, each group padded to block_m with the
    sentinel T*k; each block's expert (num_experts past the last group). Device ops only."""
    flat = experts.reshape(-1)
    n = flat.numel()
    order = torch.sort(flat, stable=True).indices
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    start = padded_end - padded                                   # each group's first padded row
    first = torch.cumsum(counts, 0) - counts                      # each group's first row, unpadded
    sorted_experts = flat[order]
    dest = start[sorted_experts] + torch.arange(n, device=flat.device) - first[sorted_experts]
    max_rows = n + num_experts * (block_m - 1)
    max_rows = (max_rows + block_m - 1) // block_m * block_m
    sorted_slots = torch.full((max_rows,), n, dtype=torch.int32, device=flat.device)
    sorted_slots[dest] = order.to(torch.int32)
    block_start = torch.arange(0, max_rows, block_m, device=flat.device)
    block_expert = torch.searchsorted(padded_end, block_start, right=True).to(torch.int32)
    return sorted_slots, block_expert


def _gemm(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, sorted_slots: torch.Tensor, block_expert: torch.Tensor,
          route_w: torch.Tensor | None, num_slots: int, row_div: int, block_m: int) -> None:
    E, N, K = b.shape
    grid = (block_expert.numel(), triton.cdiv(N, 64))
    _grouped_gemm_kernel[grid](a, b, c, sorted_slots, block_expert, route_w if route_w is not None else a,
                               num_slots, N, K, a.stride(0), b.stride(0), b.stride(1), b.stride(2), c.stride(0),
                               A_ROW_DIV=row_div, WEIGHTED=route_w is not None, NUM_EXPERTS=E,
                               BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=64, PRECISION=_precision(a.dtype),
                               num_warps=4, num_stages=3)


def _precision(dtype: torch.dtype) -> str:
    """float32 stays float32 ("ieee"): Triton's default would round both operands to tf32 (10 bits),
    an error of about 1e-3 that float32's parity with transformers does not allow."""
    return "ieee" if dtype == torch.float32 else "tf32"


def fused_moe(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
              experts: torch.Tensor, act_mul: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """x: [T, H]; gate_up: [E, 2I, H]; down: [E, H, I]; weights/experts: [T, k] routing (weights float32
    or the model dtype). act_mul: [S, 2I] -> [S, I]. Returns [T, H] in x's dtype."""
    T, H = x.shape
    k = experts.shape[1]
    E, I2 = gate_up.shape[0], gate_up.shape[1]
    block_m = 16 if T * k <= 4 * E else 64       # decode: a few rows per expert
    sorted_slots, block_expert = _sort_slots(experts, E, block_m)
    h = torch.empty(T * k, I2, dtype=x.dtype, device=x.device)
    _gemm(x, gate_up, h, sorted_slots, block_expert, None, T * k, k, block_m)
    a = act_mul(h)
    y = torch.empty(T * k, H, dtype=torch.float32, device=x.device)
    _gemm(a, down, y, sorted_slots, block_expert, weights.reshape(-1).contiguous(), T * k, 1, block_m)
    return y.view(T, k, H).sum(dim=1).to(x.dtype)
