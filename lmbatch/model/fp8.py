"""FP8 checkpoints' linear layers run as FP8 GEMMs: the weight stays as the checkpoint stores it (float8 e4m3)
beside its scales, one per block of it (DeepSeek-V3 / Qwen3 `-FP8`: 128x128) or per output channel
(compressed-tensors' channel and tensor scales, a tensor's spread over its channels), and the activations are
quantized as they run, per token and group of the block's width of inputs (a channel-scaled weight: per token),
each by its largest magnitude. On CUDA a block-scaled GEMM quantizes its activations in one Triton pass and
runs as cuBLAS's block-scaled GEMM (torch's `_scaled_mm`) where it takes the shape, else as
lmbatch.kernels.fp8_gemm's Triton kernel; a channel-scaled one is torch's `_scaled_mm` (row-wise scales);
elsewhere `reference` computes the same products from the dequantized operands, so the CPU runs and tests
the path's loading and dispatch. Routed experts, the
embedding, the LM head and the router are dequantized on load (model/dequantize.py) whatever the path.

Whether a run takes this path is fitted per engine (engine/build.py `fit`, `EngineOptions.fp8_gemm`): a GPU
with FP8 tensor cores (compute capability 8.9 or later), bfloat16, one device per model (tensor-parallel
slices of block scales are not cut), not --deterministic, and a layout the kernels take (blocks whose q/k/v
and gate/up parts start on a block's edge)."""
from __future__ import annotations

import functools
import importlib
import math
from types import ModuleType
from typing import NamedTuple, cast

import torch
import torch.nn.functional as F
from torch import nn

from lmbatch.model.config import ModelConfig
from lmbatch.model.dequantize import scaled_fp8
from lmbatch.model.quantization import Quantization

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
# the parameters of a Transformer that an FP8 checkpoint's weights may fill as FP8 (its dense linear layers)
DENSE = ("self_attn.qkv_proj.weight", "self_attn.o_proj.weight", "mlp.gate_up_proj.weight", "mlp.down_proj.weight")


@functools.cache
def _kernel() -> ModuleType | None:
    try:
        return importlib.import_module("lmbatch.kernels.fp8_gemm")
    except ImportError:
        return None


def gemm_block(q: Quantization, in_features: int) -> tuple[int, int] | None:
    """The (rows, columns) one weight scale covers when the checkpoint's linear layers run as FP8 GEMMs
    (a channel's: (1, in_features)), or None where its scales are of a layout the GEMMs do not take."""
    if q.method == "fp8":
        return q.block if q.block else (1, in_features)      # one scale per tensor: spread over its channels
    if q.method == "compressed-tensors":
        if set(q.strategies) <= {"tensor", "channel"}:
            return (1, in_features)
        if q.strategies == ("block",) and q.block_structure:
            return (int(q.block_structure[0]), int(q.block_structure[1]))
    return None


class Where(NamedTuple):
    """Where an engine runs, as far as the FP8 GEMMs care."""
    device: str
    dtype: str
    capability: tuple[int, int] | None = None      # CUDA's compute capability
    ranks: int = 1                                  # tensor-parallel ranks
    deterministic: bool = False


def fits(q: Quantization | None, cfg: ModelConfig, where: Where) -> tuple[bool, str]:
    """Whether an engine runs the checkpoint's linear layers as FP8 GEMMs, and why (or why not)."""
    device, dtype, capability, ranks, deterministic = where
    if q is None or q.method not in ("fp8", "compressed-tensors"):
        return False, "not an FP8 checkpoint"
    if cfg.runtime != "native":
        return False, "the transformers fallback loads it"
    if device != "cuda" or capability is None or capability < (8, 9):
        return False, "no FP8 tensor cores (CUDA compute capability 8.9 or later)"
    if dtype != "bfloat16":
        return False, f"{dtype} (the FP8 GEMMs write bfloat16)"
    if ranks > 1 or deterministic:
        return False, "tensor parallelism" if ranks > 1 else "--deterministic"
    block = gemm_block(q, cfg.hidden_size)
    parts = (cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size)
    if block is None or (block[0] > 1 and block[1] not in (64, 128, 256)) or any(p % block[0] for p in parts):
        return False, "its scale blocks do not fit the fused q/k/v and gate/up layers"
    return True, "FP8 tensor cores"


def quantize_activations(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] as float8 e4m3 and its scales [M, ceil(K / group)] (float32): each token's group of `group`
    inputs divided by its largest magnitude over 448."""
    m, k = x.shape
    groups = math.ceil(k / group)
    xf = F.pad(x.float(), (0, groups * group - k)).view(m, groups, group)
    scale = xf.abs().amax(-1).clamp(min=1e-12) / FP8_MAX
    q = (xf / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(m, groups * group)[:, :k]
    return q.contiguous(), scale


def reference(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """What the FP8 GEMM computes, from the dequantized operands in float32 ([M, K] rows in, [M, N] out in
    x's dtype): the CPU's path and the GPU tests' reference."""
    m, k = x.shape
    xq, xs = quantize_activations(x, block[1])
    xd = xq.float() * xs.repeat_interleave(block[1], 1)[:, :k]
    return F.linear(xd, scaled_fp8(weight, scale, block, torch.float32)).to(x.dtype)


def linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ dequantized(weight)^T (+ bias) with x quantized per token and group of block[1] inputs."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    kern = _kernel() if x.is_cuda else None
    if kern is None:
        out = reference(x2, weight, scale, block)
    elif block[0] == 1:                    # a scale per output channel: cuBLAS with row-wise scales
        rows = x2.shape[0]
        pad = -rows % 16                   # cuBLAS's FP8 GEMMs take rows in sixteens
        xq, xs = quantize_activations(F.pad(x2, (0, 0, 0, pad)) if pad else x2, k)
        out = torch._scaled_mm(xq, weight.t(), scale_a=xs, scale_b=scale.view(1, -1), out_dtype=x.dtype)[:rows]
    else:
        xq, xs = kern.quantize_rows(x2, block[1])
        out = kern.block_scaled_mm(xq, xs, weight, scale, block, x.dtype, x2.shape[0])
    if bias is not None:
        out = out + bias
    return out.view(*lead, weight.shape[0])


def make_fp8(module: nn.Linear, block: tuple[int, int]) -> None:
    """The layer's weight made float8 (uninitialized, filled by loading) beside its scales' grid, float32."""
    out_features, in_features = module.weight.shape
    device = module.weight.device
    module.weight = nn.Parameter(torch.empty((out_features, in_features), dtype=FP8, device=device),
                                 requires_grad=False)
    grid = (math.ceil(out_features / block[0]), math.ceil(in_features / block[1]))
    module.register_parameter("weight_scale", nn.Parameter(torch.empty(grid, dtype=torch.float32, device=device),
                                                           requires_grad=False))
    setattr(module, "fp8_block", block)


def gemm_targets(cfg: ModelConfig, dtypes: dict[str, str]) -> set[str]:
    """The dense linear layers' weights (our names) whose every stored part is float8: those the checkpoint
    quantized (a module it left in its float type, and so a fused layer holding one, is dequantized as ever)."""
    from lmbatch.model.names import target

    parts: dict[str, bool] = {}
    for name, dtype in dtypes.items():
        key = target(name, cfg)
        if key is not None and key.endswith(DENSE) and name.endswith(".weight"):
            parts[key] = parts.get(key, True) and dtype.startswith("F8_")
    return {key for key, fp8 in parts.items() if fp8}


def convert(model: nn.Module, q: Quantization, keys: set[str]) -> dict[str, tuple[int, int]]:
    """Makes each weight of `keys` an FP8 one (`make_fp8`); returns each one's scale block by our name."""
    blocks = {}
    for key in keys:
        module = cast(nn.Linear, model.get_submodule(key.removesuffix(".weight")))
        block = gemm_block(q, module.in_features)
        assert block is not None, "fits() said the checkpoint's scales are of a layout the GEMMs take"
        make_fp8(module, block)
        blocks[key] = block
    return blocks

