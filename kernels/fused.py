"""Fused small ops for the GPU forward pass (Triton). Each rounds where the plain PyTorch bf16 ops
round, so results match the reference path: residual add, RMSNorm (normalize in float32, round,
then scale by the weight; or, with an offset as Gemma's, scale by offset + weight in float32 and round
once), SiLU(gate) * up or GELU-tanh(gate) * up, and rotate-half RoPE with the KV pool's store (q rotated in
place, the rotated keys and the values written to their slots: one kernel where it took three)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rmsnorm_kernel(X, R, W, Y, N, stride_x, eps,  # type: ignore[no-untyped-def]
                        HAS_RES: tl.constexpr, OFFSET: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    x = tl.load(X + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RES:  # residual += x, rounded to the activation dtype, then normalized
        x = (x.to(tl.float32) + tl.load(R + row * N + cols, mask=ok, other=0.0).to(tl.float32)).to(X.dtype.element_ty)
        tl.store(R + row * N + cols, x, mask=ok)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / N + eps)
    w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
    if OFFSET != 0.0:
        y = (xf * rstd) * (OFFSET + w)
    else:
        y = w * (xf * rstd).to(X.dtype.element_ty).to(tl.float32)
    tl.store(Y + row * N + cols, y.to(Y.dtype.element_ty), mask=ok)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
            offset: float = 0.0) -> torch.Tensor:
    """RMSNorm of x (or, with residual, of residual += x, updated in place). x: [T, N], its rows at
    any stride (one KV head's slice of the fused q|k|v projection, as reshape leaves it); residual
    contiguous. Returns a contiguous [T, N]."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    T, N = x.shape
    y = torch.empty((T, N), dtype=x.dtype, device=x.device)
    _add_rmsnorm_kernel[(T,)](x, residual if residual is not None else x, weight, y, N, x.stride(0), eps,
                              HAS_RES=residual is not None, OFFSET=float(offset), BLOCK=triton.next_power_of_2(N),
                              num_warps=8)
    return y


@triton.jit
def _act_mul_kernel(GU, Y, I, GELU: tl.constexpr, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < I
    g = tl.load(GU + row * 2 * I + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(GU + row * 2 * I + I + cols, mask=ok, other=0.0).to(tl.float32)
    if GELU:    # 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))), tanh(z) = 2 sigmoid(2z) - 1
        z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        a = (g * tl.sigmoid(2.0 * z)).to(Y.dtype.element_ty).to(tl.float32)
    else:
        a = (g * tl.sigmoid(g)).to(Y.dtype.element_ty).to(tl.float32)
    tl.store(Y + row * I + cols, (a * u).to(Y.dtype.element_ty), mask=ok)


def act_mul(gate_up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """[T, 2I] (gate | up) -> act(gate) * up, [T, I]; act: "silu" or "gelu_tanh"."""
    T, I2 = gate_up.shape
    I = I2 // 2
    y = torch.empty(T, I, dtype=gate_up.dtype, device=gate_up.device)
    _act_mul_kernel[(T, triton.cdiv(I, 1024))](gate_up, y, I, GELU=activation == "gelu_tanh", BLOCK=1024,
                                               num_warps=4)
    return y


@triton.jit
def _rope_store_kernel(Q, K, V, COS, SIN, KP, VP, SLOTS, stride_qt, stride_kt, stride_vt,  # type: ignore[no-untyped-def]
                       stride_ps, NQ: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, BLOCK)
    ok = d < HALF
    cos = tl.load(COS + t * HALF + d, mask=ok, other=0.0)
    sin = tl.load(SIN + t * HALF + d, mask=ok, other=0.0)
    if h < NQ:          # a query head: rotated in place
        src = Q + t * stride_qt + h * 2 * HALF
        dst = src
    else:               # a KV head: its key rotated into the pool, its value copied there
        kv = h - NQ
        slot = tl.load(SLOTS + t).to(tl.int64)
        src = K + t * stride_kt + kv * 2 * HALF
        dst = KP + slot * stride_ps + kv * 2 * HALF
        vsrc = V + t * stride_vt + kv * 2 * HALF
        vdst = VP + slot * stride_ps + kv * 2 * HALF
        tl.store(vdst + d, tl.load(vsrc + d, mask=ok), mask=ok)
        tl.store(vdst + HALF + d, tl.load(vsrc + HALF + d, mask=ok), mask=ok)
    x1 = tl.load(src + d, mask=ok, other=0.0)
    x2 = tl.load(src + HALF + d, mask=ok, other=0.0)
    f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(dst + d, (f1 * cos - f2 * sin).to(x1.dtype), mask=ok)
    tl.store(dst + HALF + d, (f2 * cos + f1 * sin).to(x1.dtype), mask=ok)


def rope_store_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor) -> None:
    """Rotate-half RoPE and the KV pool's store in one kernel: q [T, H, D] rotated in place; token t's key (rotated)
    and value written to slot slots[t] of k_pool / v_pool ([slots, KVH, D], one layer's). k and v [T, KVH, D]
    (row strides may differ, heads contiguous) are left as they are; cos/sin: [T, D/2] float32. The rotation in
    float32 as model/layers.py's apply_rope computes it, rounded once (a multiply-add the compiler fuses may change
    a last bit), the value copied as it is."""
    T, H, D = q.shape
    assert k_pool.stride() == v_pool.stride() and k_pool.stride(-1) == 1 and k_pool.stride(1) == D
    _rope_store_kernel[(T, H + k.shape[1])](q, k, v, cos, sin, k_pool, v_pool, slots, q.stride(0), k.stride(0),
                                            v.stride(0), k_pool.stride(0), NQ=H, HALF=D // 2,
                                            BLOCK=triton.next_power_of_2(D // 2), num_warps=1)
