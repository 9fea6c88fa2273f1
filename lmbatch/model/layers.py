"""network.py's building blocks, each as plain PyTorch and, on CUDA, a fused Triton kernel rounding at the same
points: RMSNorm (with the residual add), RoPE applied to q and k, gated activations, linear layers (a fixed
row split where --deterministic asks for the same bits at any batch size) and a tensor-parallel row layer's
all-reduce."""
from __future__ import annotations

import functools
import importlib
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from lmbatch.model.tensor_parallel import TensorParallel


@functools.cache
def fused_kernels(name: str) -> ModuleType | None:
    """lmbatch.kernels.<name> (Triton), or None where it cannot run (no Triton)."""
    try:
        return importlib.import_module(f"lmbatch.kernels.{name}")
    except ImportError:
        return None


def use_fused(x: torch.Tensor) -> ModuleType | None:
    return fused_kernels("fused") if x.is_cuda else None


class RMSNorm(nn.Module):
    """Llama's RMSNorm: normalize in float32, round, scale by the weight. With an `offset` (Gemma),
    scale by (offset + weight) in float32 and round once."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor,
                residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x); or, given the residual stream, (norm(residual + x), residual + x)."""
        if (k := use_fused(x)) is not None:
            out = k.rmsnorm(x, self.weight, self.eps, residual, self.offset)  # updates residual in place
            return out if residual is None else (out, residual)
        if residual is not None:
            x = residual = residual + x
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        out = (xf * (self.offset + self.weight.float())).to(x.dtype) if self.offset else self.weight * xf.to(x.dtype)
        return out if residual is None else (out, residual)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (the HF Llama convention). x: [T, H, D]; cos/sin: [T, D/2]."""
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def rope_part(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dims: int) -> torch.Tensor:
    """RoPE on each head's first `dims` dimensions (partial rotary), the rest as they are."""
    return torch.cat([apply_rope(x[..., :dims], cos, sin), x[..., dims:]], dim=-1)


def act_mul(gate_up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """activation(gate) * up of [T, 2I] (gate | up): SiLU (SwiGLU) or tanh-approximated GELU (GeGLU)."""
    if (k := use_fused(gate_up)) is not None:
        return k.act_mul(gate_up, activation)
    gate, up = gate_up.chunk(2, dim=-1)
    return (F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")) * up


# rows of each GEMM in deterministic mode: on CUDA a loop of F.linear calls of exactly this many rows
# (one cuBLAS algorithm for all), on the CPU one batched matmul of blocks of this many rows
FIXED_ROWS = {"cuda": 256, "cpu": 32}


def fixed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear whose every output row depends on its input row alone: the rows run in blocks of exactly
    FIXED_ROWS rows (the last padded with zeros). A GEMM's kernel, and so its reduction order, may
    change with its row count; a fixed count keeps each row's sum the same whatever else is in the batch."""
    rows = FIXED_ROWS["cuda" if x.is_cuda else "cpu"]
    lead, k = x.shape[:-1], x.shape[-1]
    flat = x.reshape(-1, k)
    m = flat.shape[0]
    if m % rows:
        flat = torch.cat([flat, flat.new_zeros(rows - m % rows, k)])
    if x.is_cuda:
        out = torch.cat([F.linear(block, weight) for block in flat.split(rows)])
    else:
        blocks = flat.view(-1, rows, k)
        out = torch.bmm(blocks, weight.t().expand(blocks.shape[0], k, weight.shape[0])).view(-1, weight.shape[0])
    out = out[:m]
    if bias is not None:
        out = out + bias
    return out.view(*lead, weight.shape[0])


class Linear(nn.Linear):
    """nn.Linear; with `fixed` set (deterministic mode) it runs as `fixed_linear`; with an FP8 weight (an FP8
    checkpoint's, model/fp8.py) as an FP8 GEMM by its `weight_scale` grid of `fp8_block` blocks."""
    fixed = False
    weight_scale: torch.Tensor
    fp8_block: tuple[int, int] = (1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.dtype == torch.float8_e4m3fn:    # an FP8 checkpoint's layer as FP8 GEMMs (model/fp8.py)
            from lmbatch.model.fp8 import linear

            return linear(x, self.weight, self.weight_scale, self.fp8_block, self.bias)
        return fixed_linear(x, self.weight, self.bias) if self.fixed else super().forward(x)


def maybe_fixed_linear(x: torch.Tensor, weight: torch.Tensor, fixed: bool) -> torch.Tensor:
    return fixed_linear(x, weight) if fixed else F.linear(x, weight)


def tp_reduce(x: torch.Tensor, tp: TensorParallel | None) -> torch.Tensor:
    """The sum over a tensor-parallel group of a row-parallel projection's partial outputs."""
    return x if tp is None else tp.all_reduce(x)


def row_parallel(proj: Linear, x: torch.Tensor, tp: TensorParallel | None) -> torch.Tensor:
    """A row-parallel projection summed over the ranks, its bias (gpt-oss's o_proj) added once, after the sum."""
    if tp is None or proj.bias is None:
        return tp_reduce(proj(x), tp)
    return tp.all_reduce(maybe_fixed_linear(x, proj.weight, proj.fixed)) + proj.bias


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's experts' activation of [S, 2I] (gate | up): the gate clamped above at `limit`, the up on both
    sides, gate * sigmoid(alpha * gate) * (up + 1)."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return gate * torch.sigmoid(gate * alpha) * (up + 1)
