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
                    stride_am, stride_bn, stride_cm, stride_asm, stride_ask, stride_bsn,
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
        sa = tl.load(as_ptrs + kb * stride_ask, mask=offs_m < M, other=0.0)
        sb = tl.load(bs_ptrs + kb, mask=offs_n < N, other=0.0)
        acc += tl.dot(x, w) * sa[:, None] * sb[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    out = c + offs_m[:, None] * stride_cm + offs_n[None, :]
    tl.store(out, acc.to(c.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def config(m: int) -> tuple[int, int, int]:
    """(BLOCK_M, num_warps, num_stages) for M rows."""
    return (16, 4, 3) if m <= 16 else (32, 4, 3) if m <= 32 else (64, 4, 3)


def block_fp8_gemm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                   block: tuple[int, int], out_dtype: torch.dtype,
                   tiles: tuple[int, int, int] | None = None) -> torch.Tensor:
    """a [M, K] float8 with a_scale [M, ceil(K / block[1])] float32; b [N, K] float8 with b_scale
    [ceil(N / block[0]), ceil(K / block[1])] float32: a @ b^T in out_dtype. `tiles`: (BLOCK_M, num_warps,
    num_stages), default `config(M)` (benchmarks try others)."""
    M, K = a.shape
    N = b.shape[0]
    group_n, group_k = block
    assert a.stride(1) == 1 and b.stride(1) == 1 and group_k in (64, 128, 256)
    block_n = min(group_n, 128)
    assert group_n % block_n == 0
    block_m, warps, stages = tiles or config(M)
    c = torch.empty((M, N), dtype=out_dtype, device=a.device)
    grid = (triton.cdiv(M, block_m) * triton.cdiv(N, block_n),)
    _block_fp8_gemm[grid](a, b, c, a_scale, b_scale, M, N, K, group_n, a.stride(0), b.stride(0), c.stride(0),
                          a_scale.stride(0), a_scale.stride(1), b_scale.stride(0), BLOCK_M=block_m, BLOCK_N=block_n,
                          BLOCK_K=group_k, GROUP_M=8, num_warps=warps, num_stages=stages)
    return c


@triton.jit
def _quantize_kernel(x, q, s, M, K, stride_xm, stride_qm, stride_sm, stride_sg,  # type: ignore[no-untyped-def]
                     BLOCK_M: tl.constexpr, GROUP: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    g = tl.program_id(1)
    cols = g * GROUP + tl.arange(0, GROUP)
    inside = cols[None, :] < K
    v = tl.load(x + rows[:, None] * stride_xm + cols[None, :], mask=(rows[:, None] < M) & inside, other=0.0)
    v = v.to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(v), axis=1), 1e-12) / 448.0
    out = tl.minimum(tl.maximum(v / scale[:, None], -448.0), 448.0).to(q.dtype.element_ty)
    tl.store(q + rows[:, None] * stride_qm + cols[None, :], out, mask=inside)
    tl.store(s + rows * stride_sm + g * stride_sg, scale)


def quantize_rows(x: torch.Tensor, group: int, pad_to: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (last dim contiguous) quantized per token and group of `group` inputs in one pass, as
    model/fp8.quantize_activations computes it: e4m3 values [M', K] and float32 scales [M', ceil(K / group)],
    M' = M rounded up to `pad_to` (the rows past M zero); the scales laid out M-major (stride (1, M')), as
    cuBLAS's block-scaled GEMM takes the activations' 1x`group` scales."""
    m, k = x.shape
    assert x.stride(1) == 1 and group in (64, 128, 256)
    rows = -(-m // pad_to) * pad_to
    groups = -(-k // group)
    q = torch.empty((rows, k), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((groups, rows), dtype=torch.float32, device=x.device).t()
    block_m = 16
    _quantize_kernel[(triton.cdiv(rows, block_m), groups)](x, q, s, m, k, x.stride(0), q.stride(0), s.stride(0),
                                                          s.stride(1), BLOCK_M=block_m, GROUP=group, num_warps=4)
    return q, s


def cublas_block_scaled() -> bool:
    """Whether torch's `_scaled_mm` takes 1x128 activation and 128x128 weight scales here (cuBLAS's block-scaled
    FP8 GEMM: CUDA 12.9+, Hopper): tried once on a small product, never while a CUDA graph captures."""
    global _CUBLAS
    if _CUBLAS is None:
        if torch.cuda.is_current_stream_capturing():
            return False
        try:
            a = torch.ones((16, 128), device="cuda").to(torch.float8_e4m3fn)
            b = torch.ones((128, 128), device="cuda").to(torch.float8_e4m3fn)
            sa = torch.full((1, 16), 2.0, device="cuda").t()
            sb = torch.full((1, 1), 3.0, device="cuda")
            out = torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb.t(), out_dtype=torch.bfloat16)
            _CUBLAS = bool((out.float() == 6.0 * 128).all())
        except (RuntimeError, TypeError, ValueError):
            _CUBLAS = False
    return _CUBLAS


_CUBLAS: bool | None = None


def block_scaled_mm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                    block: tuple[int, int], out_dtype: torch.dtype, rows: int) -> torch.Tensor:
    """`quantize_rows`'s a and a_scale (M' rows) times b [N, K] with its block scales: cuBLAS's block-scaled GEMM
    where it takes the shape (128x128 blocks; N and K multiples of 512, so that each scale grid's sides are
    multiples of 4: with 3 K blocks it read the last output block's scales wrongly, H200, CUDA 13; measured
    1.8-2x faster than the Triton kernel at prefill sizes), else the Triton kernel; the first `rows` rows in
    out_dtype."""
    n, k = b.shape
    if block == (128, 128) and n % 512 == 0 and k % 512 == 0 and cublas_block_scaled():
        out = torch._scaled_mm(a, b.t(), scale_a=a_scale, scale_b=b_scale.t(), out_dtype=out_dtype)
        return out[:rows]
    return block_fp8_gemm(a[:rows], a_scale[:rows], b, b_scale, block, out_dtype)
