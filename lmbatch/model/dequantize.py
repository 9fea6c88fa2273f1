"""Quantized weights as the model's dtype, as they load (model/quantization.py says which tensors are what):
an FP8 weight times its scales, one per block of the weight (a 128x128 block, an output channel, a group of
inputs, the whole tensor), and MXFP4's e2m1 values times their e8m0 exponents. Done on the model's device,
one tensor (one expert of a stacked tensor) at a time, in float32 and rounded once to the model's dtype: in
float32 the values are exactly what the checkpoint encodes (transformers' `dequantize=True` multiplies the
same way)."""
from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from lmbatch.model.quantization import DROPPED, MX_GROUP, Quantization, QuantizationProblem, scale_block

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def e8m0(exponents: torch.Tensor) -> torch.Tensor:
    """Powers of two from e8m0 bytes (2 ** (byte - 127)), in float32."""
    if exponents.dtype != torch.uint8:
        exponents = exponents.view(torch.uint8)
    return torch.exp2(exponents.float() - 127.0)


def _expand(scale: torch.Tensor, block: tuple[int, int], rows: int, cols: int) -> torch.Tensor:
    """A [ceil(rows/b0), ceil(cols/b1)] grid of scales spread over the [rows, cols] it covers."""
    return scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]


def scaled_fp8(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
               dtype: torch.dtype) -> torch.Tensor:
    """weight ([..., rows, cols], float8) times its scales, one per `block` of it ([..., ceil(rows/b0),
    ceil(cols/b1)], or a channel's [..., rows] or one scale's [] / [1]), in `dtype`."""
    rows, cols = weight.shape[-2:]
    grid = (math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    s = scale.float().reshape(-1, *grid)
    w = weight.reshape(-1, rows, cols)
    out = torch.empty(w.shape, dtype=dtype, device=weight.device)
    for i in range(w.shape[0]):
        out[i] = w[i].float() * _expand(s[i], block, rows, cols)
    return out.view(weight.shape)


def mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, transposed: bool = False) -> torch.Tensor:
    """MXFP4 blocks ([..., rows, groups, 16] bytes, two e2m1 values each, the low nibble first) times their
    e8m0 scales ([..., rows, groups]): [..., rows, groups * 32] (transposed: [..., groups * 32, rows])."""
    *lead, rows, groups, width = blocks.shape
    lut = torch.tensor(E2M1, dtype=torch.float32, device=blocks.device)
    b = blocks.reshape(-1, rows, groups, width)
    s = scales.reshape(-1, rows, groups)
    out = torch.empty((b.shape[0], rows, groups * width * 2), dtype=dtype, device=blocks.device)
    for i in range(b.shape[0]):
        values = torch.stack((lut[(b[i] & 0x0F).long()], lut[(b[i] >> 4).long()]), dim=-1)
        out[i] = (values.view(rows, groups, MX_GROUP) * e8m0(s[i])[..., None]).view(rows, groups * MX_GROUP)
    out = out.view(*lead, rows, groups * MX_GROUP)
    return out.transpose(-1, -2).contiguous() if transposed else out


def gemm_scales(q: Quantization, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """A stored weight's scales as the FP8 GEMM's grid for `block` (float32): as stored, or, for a channel
    grid, a tensor's (or a block's of whole rows) spread over its channels."""
    rows, cols = weight.shape
    stored = scale_block(q, (rows, cols), tuple(scale.shape))
    s = e8m0(scale) if scale.dtype in (torch.uint8, getattr(torch, "float8_e8m0fnu", torch.uint8)) else scale.float()
    if stored is not None:
        s = s.reshape(math.ceil(rows / stored[0]), math.ceil(cols / stored[1]))
        if stored == block:
            return s.contiguous()
        if block[0] == 1 and stored[1] == cols:
            return s.repeat_interleave(stored[0], 0)[:rows].contiguous()
    raise QuantizationProblem(f"scales of shape {list(scale.shape)} do not give a {block} grid over a "
                              f"{[rows, cols]} weight")


class QuantizedCheckpoint:
    """The tensors of a quantized checkpoint's shard files as the model's: each weight dequantized with its
    scales (wherever the shards hold them), the companions the model has no place for left out."""

    def __init__(self, files: list[Path], q: Quantization, device: torch.device, dtype: torch.dtype,
                 transposed: bool = False):
        self.q, self.device, self.dtype, self.transposed = q, device, dtype, transposed
        self.handles = [safe_open(str(f), framework="pt") for f in files]
        self.where = {name: h for h in self.handles for name in h.keys()}
        # stored FP8 weights kept as they are (model/fp8.py's GEMMs), by name: the scale grid's block
        self.keep: dict[str, tuple[int, int]] = {}

    def dtypes(self) -> dict[str, str]:
        """Each stored tensor's safetensors dtype, by name."""
        return {name: h.get_slice(name).get_dtype() for name, h in self.where.items()}

    def _read(self, name: str) -> torch.Tensor:
        return self.where[name].get_tensor(name).to(self.device)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for h in self.handles:
            for name in h.keys():
                yield from self._items(name, h.get_slice(name).get_dtype())

    def _items(self, name: str, dtype: str) -> list[tuple[str, torch.Tensor]]:
        """The model's tensors that the stored tensor `name` gives: itself, dequantized, or (kept FP8) with its
        scales as `X.weight_scale`; none for a companion (read with its weight)."""
        q = self.q
        if q.method == "mxfp4":
            if name.endswith("_scales"):
                return []
            if not name.endswith("_blocks"):
                return [(name, self._read(name))]
            base = name.removesuffix("_blocks")
            return [(base, mxfp4(self._read(name), self._read(base + "_scales"), self.dtype, self.transposed))]
        base, _, suffix = name.rpartition(".")
        if suffix == q.scale or suffix in DROPPED:
            return []
        if not dtype.startswith("F8_"):
            return [(name, self._read(name))]
        weight, scale = self._read(name), self._read(f"{base}.{q.scale}")
        if name in self.keep:       # as stored, its scales as the GEMM's grid (model/fp8.py)
            return [(name, weight), (f"{base}.weight_scale", gemm_scales(q, weight, scale, self.keep[name]))]
        block = scale_block(q, tuple(weight.shape), tuple(scale.shape))
        if block is None:       # checkpoint.py checked the headers; a folder changed since says so too
            raise QuantizationProblem(f"{base}.{q.scale} of shape {list(scale.shape)} is not the scale grid of "
                                      f"{name} {list(weight.shape)} ({q.method})")
        if scale.dtype in (torch.uint8, getattr(torch, "float8_e8m0fnu", torch.uint8)):
            scale = e8m0(scale)
        return [(name, scaled_fp8(weight, scale, block, self.dtype))]
