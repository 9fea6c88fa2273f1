"""Block-scaled FP8 GEMM (DeepSeek-V3's layout): out[M, N] = sum over K blocks of (a[M, k] @ b[N, k]^T) times
a's scale of (row, k block) and b's of (N block, k block), accumulated in float32 and rounded once to the
output dtype. `a` is the activations quantized per token and group of `group_k` inputs as they run
(model/fp8.py), `b` the checkpoint's weight with its [ceil(N / group_n), ceil(K / group_k)] scales. Each
program computes a BLOCK_M x BLOCK_N tile; BLOCK_K is the scale group, so one scale of each operand covers
a k step."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _block_fp8_gemm(a, b, c, a_scale, b_scale, M, N, K, group_n,  # type: ignore[no-untyped-def]
                    stride_am, stride_bn, stride_cm, stride_asm, stride_bsn,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * tiles_n            # tiles of GROUP_M row blocks, walked column by column (L2 reuse)
    first_m = (pid // in_group) * GROUP_M
    rows_here = min(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % rows_here
    pid_n = (pid % in_group) // rows_here
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a + offs_m[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b + offs_n[None, :] * stride_bn + offs_k[:, None]
    as_ptrs = a_scale + offs_m * stride_asm
    bs_ptrs = b_scale + (offs_n // group_n) * stride_bsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        left = K - kb * BLOCK_K
        x = tl.load(a_ptrs, mask=(offs_m[:, None] < M) & (offs_k[None, :] < left), other=0.0)
        w = tl.load(b_ptrs, mask=(offs_n[None, :] < N) & (offs_k[:, None] < left), other=0.0)
        sa = tl.load(as_ptrs + kb, mask=offs_m < M, other=0.0)
        sb = tl.load(bs_ptrs + kb, mask=offs_n < N, other=0.0)
        acc += tl.dot(x, w) * sa[:, None] * sb[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    out = c + offs_m[:, None] * stride_cm + offs_n[None, :]
    tl.store(out, acc.to(c.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def block_fp8_gemm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                   block: tuple[int, int], out_dtype: torch.dtype) -> torch.Tensor:
    """a [M, K] float8 with a_scale [M, ceil(K / block[1])] float32; b [N, K] float8 with b_scale
    [ceil(N / block[0]), ceil(K / block[1])] float32: a @ b^T in out_dtype."""
    M, K = a.shape
    N = b.shape[0]
    group_n, group_k = block
    assert a.stride(1) == 1 and b.stride(1) == 1 and group_k in (64, 128, 256)
    block_n = min(group_n, 128)
    assert group_n % block_n == 0
    block_m = 16 if M <= 16 else 32 if M <= 32 else 64
    c = torch.empty((M, N), dtype=out_dtype, device=a.device)
    grid = (triton.cdiv(M, block_m) * triton.cdiv(N, block_n),)
    _block_fp8_gemm[grid](a, b, c, a_scale, b_scale, M, N, K, group_n, a.stride(0), b.stride(0), c.stride(0),
                          a_scale.stride(0), b_scale.stride(0), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=group_k,
                          GROUP_M=8, num_warps=4, num_stages=3)
    return c
