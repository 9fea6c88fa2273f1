"""Quantized checkpoints, read without torch: which format config.json's `quantization_config` names, and what
each stored tensor is in the model's terms (its logical name and shape once dequantized), so that checkpoint.py
checks a quantized folder's names and shapes as it checks an unquantized one's, and says in one line which
tensor of which format it cannot read. model/dequantize.py turns the stored tensors into those logical ones.

Three formats, each a weight stored in a narrow type beside the scales that give its values:

- `fp8` (DeepSeek-V3, Qwen3's `-FP8` releases): `X.weight` in float8 e4m3 and `X.weight_scale_inv` (float32,
  or e8m0 bytes with `scale_fmt: ue8m0`), one scale per `weight_block_size` block ([128, 128]: a scale grid
  of [ceil(out/128), ceil(in/128)]); the value is weight * scale.
- `compressed-tensors` FP8 (`format: float-quantized` or `naive-quantized`, llm-compressor's releases):
  `X.weight` in float8 and `X.weight_scale`, one per tensor, output channel, group of `group_size` inputs or
  `block_structure` block, as the config groups declare; `input_scale` (static activations) beside it.
- `mxfp4` (gpt-oss): `X_blocks` (bytes, two e2m1 values each, low nibble first, [..., rows, groups, 16]) and
  `X_scales` (e8m0 exponents, one per 32 values, [..., rows, groups]): the tensor `X` of [..., rows, groups*32]
  (transposed to [..., groups*32, rows] where the unquantized checkpoint stores X so: `Architecture.
  mxfp4_transposed`).

A weight is quantized where it is stored so (a float8 weight, a `_blocks` pair); the rest of the checkpoint
(embeddings, norms, a router, the modules a config leaves out) is stored in its float type and loads as ever.
Activations and the KV cache run in the model's dtype: dequantized on load, the weights are what the checkpoint
holds, as transformers' `dequantize=True` loads them (the FP8 GEMM path, model/fp8.py, quantizes activations).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

METHODS = ("fp8", "compressed-tensors", "mxfp4")
FLOAT_TYPES = ("F32", "F16", "BF16", "F64")             # safetensors dtypes of an unquantized tensor
FP8_TYPES = {"F8_E4M3": "e4m3", "F8_E5M2": "e5m2"}
E8M0_TYPES = ("U8", "F8_E8M0")                          # fp8's ue8m0 scales: exponents, stored so
CT_FORMATS = ("float-quantized", "naive-quantized")
CT_STRATEGIES = ("tensor", "channel", "group", "block")
MX_GROUP = 32           # MXFP4: values per e8m0 scale (16 bytes of two e2m1 values)
# tensors a format stores beside its weights that the dequantized model has no place for: activation and KV
# scales (activations and the KV cache run in the model's dtype) and a symmetric scheme's zero points
DROPPED = ("input_scale", "activation_scale", "k_scale", "v_scale", "weight_zero_point", "input_zero_point",
           "output_scale")


class StoredTensor(NamedTuple):
    shape: tuple[int, ...]
    dtype: str          # safetensors' name: F32, BF16, F8_E4M3, U8, ...
    file: str


class QuantizationProblem(ValueError):
    """A quantization_config or a stored tensor lmbatch cannot read; its message is one phrase."""


@dataclass(frozen=True)
class Quantization:
    """A checkpoint's quantization as its config.json declares it."""
    method: str                                 # METHODS
    scale: str                                  # the scale tensor's suffix beside X.weight ("" for mxfp4)
    block: tuple[int, int] | None = None        # fp8: weight_block_size (None: one scale per tensor)
    strategies: tuple[str, ...] = ()            # compressed-tensors: the weight strategies its groups declare
    group_size: int | None = None               # compressed-tensors "group"
    block_structure: tuple[int, int] | None = None  # compressed-tensors "block"
    activations: str = "none"                   # the checkpoint's activation scheme: dynamic, static or none
    e8m0_scales: bool = False                   # fp8 `scale_fmt: ue8m0`
    declared: dict = field(default_factory=dict, compare=False)   # quantization_config as written

    def record(self) -> dict[str, Any]:
        """What summary.json, a run's fingerprint and the score cache say of it."""
        if self.method == "mxfp4":
            weights = "MXFP4 (e2m1 values, an e8m0 scale per 32)"
        elif self.method == "fp8":
            weights = "FP8 e4m3, " + (f"a scale per {self.block[0]}x{self.block[1]} block" if self.block
                                      else "a scale per tensor")
        else:
            weights = "FP8, a scale per " + "/".join(self.strategies)
        return {"method": self.method, "weights": weights, "activations": self.activations}


def read_quantization(config: dict) -> Quantization | None:
    """The quantization config.json declares (None: an unquantized checkpoint); QuantizationProblem, naming
    the field, for a method or scheme lmbatch does not read."""
    qc = config.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise QuantizationProblem(f"quantization_config is not a JSON object (it holds {qc!r})")
    method = qc.get("quant_method")
    if method == "fp8":
        return _fp8(qc)
    if method == "compressed-tensors":
        return _compressed(qc)
    if method == "mxfp4":
        return Quantization("mxfp4", "", activations="none", declared=qc)
    raise QuantizationProblem(f"quantization_config.quant_method {method!r} is not a format lmbatch reads "
                              f"({', '.join(METHODS)})")


def _fp8(qc: dict) -> Quantization:
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise QuantizationProblem(f"quantization_config.fmt {fmt!r}: lmbatch reads fp8 checkpoints of e4m3 weights")
    block = qc.get("weight_block_size")
    if block is not None and not (isinstance(block, list) and len(block) == 2
                                  and all(type(b) is int and b > 0 for b in block)):
        raise QuantizationProblem(f"quantization_config.weight_block_size {block!r} is not two positive integers")
    scale_fmt = qc.get("scale_fmt")
    if scale_fmt not in (None, "ue8m0", "float32"):
        raise QuantizationProblem(f"quantization_config.scale_fmt {scale_fmt!r}: lmbatch reads float scales "
                                  "or ue8m0 exponents")
    return Quantization("fp8", "weight_scale_inv", block=tuple(block) if block else None,
                        activations=str(qc.get("activation_scheme") or "dynamic"), e8m0_scales=scale_fmt == "ue8m0",
                        declared=qc)


def _compressed(qc: dict) -> Quantization:
    fmt = qc.get("format")
    if fmt not in CT_FORMATS:
        raise QuantizationProblem(f"quantization_config.format {fmt!r}: lmbatch reads compressed-tensors FP8 "
                                  f"checkpoints ({', '.join(CT_FORMATS)})")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise QuantizationProblem("quantization_config.config_groups is missing: compressed-tensors declares its "
                                  "schemes there")
    strategies, group_size, block, activations = [], None, None, set()
    for name, group in groups.items():
        w = group.get("weights") if isinstance(group, dict) else None
        where = f"quantization_config.config_groups.{name}.weights"
        if not isinstance(w, dict):
            raise QuantizationProblem(f"{where} is missing: lmbatch reads weight-quantized checkpoints")
        if w.get("type") != "float" or w.get("num_bits") != 8:
            raise QuantizationProblem(f"{where} are {w.get('num_bits')}-bit {w.get('type')}: lmbatch reads "
                                      "compressed-tensors checkpoints of 8-bit float (FP8) weights")
        if w.get("symmetric") is False:
            raise QuantizationProblem(f"{where} are asymmetric (zero points): lmbatch reads symmetric FP8 weights")
        strategy = w.get("strategy") or "tensor"
        if strategy not in CT_STRATEGIES:
            raise QuantizationProblem(f"{where}.strategy {strategy!r}: lmbatch reads {', '.join(CT_STRATEGIES)}")
        strategies.append(strategy)
        group_size = w.get("group_size") if strategy == "group" else group_size
        block = w.get("block_structure") if strategy == "block" else block
        a = group.get("input_activations")
        activations.add("none" if not a else "dynamic" if a.get("dynamic") else "static")
    return Quantization("compressed-tensors", "weight_scale", strategies=tuple(dict.fromkeys(strategies)),
                        group_size=group_size, block_structure=tuple(block) if block else None,
                        activations="/".join(sorted(activations)), declared=qc)


# ---- stored tensors as the model's -------------------------------------------------------------------------
def _fmt(shape: tuple[int, ...]) -> str:
    return str(list(shape))


def scale_block(q: Quantization, weight: tuple[int, ...], scale: tuple[int, ...]) -> tuple[int, int] | None:
    """The (rows, columns) of a 2-D weight (the last two dimensions of `weight`) that one scale of shape `scale`
    covers, where it fits the format; None where it does not."""
    rows, cols = weight[-2], weight[-1]
    lead = weight[:-2]
    if scale[:len(lead)] != lead:
        return None
    if q.method == "fp8":
        blocks = [q.block or (rows, cols)]
    else:
        blocks = [b for s in q.strategies for b in _ct_blocks(q, s, rows, cols)]
    for b in blocks:
        if _same_grid(scale[len(lead):], (math.ceil(rows / b[0]), math.ceil(cols / b[1]))):
            return b
    return None


def _ct_blocks(q: Quantization, strategy: str, rows: int, cols: int) -> list[tuple[int, int]]:
    if strategy == "tensor":
        return [(rows, cols)]
    if strategy == "channel":
        return [(1, cols)]
    if strategy == "group" and q.group_size:
        return [(1, int(q.group_size))]
    if strategy == "block" and q.block_structure:
        return [(int(q.block_structure[0]), int(q.block_structure[1]))]
    return []


def _same_grid(got: tuple[int, ...], want: tuple[int, int]) -> bool:
    """A scale grid as stored against the one a block gives: [r, c]; a channel scale may be [r]; one
    scale [], [1] or [1, 1]."""
    return got == want or (want[1] == 1 and got == want[:1]) or (want == (1, 1) and math.prod(got) == 1)


def wants(q: Quantization) -> str:
    """The format's weights and scales, in words, for a message."""
    return {"fp8": f"fp8 ({q.record()['weights']}: X.weight in F8_E4M3 beside X.weight_scale_inv)",
            "compressed-tensors": f"compressed-tensors ({q.record()['weights']}: X.weight in F8_E4M3 beside "
                                  "X.weight_scale)",
            "mxfp4": "mxfp4 (X_blocks and X_scales in U8)"}[q.method]


def logical_tensors(q: Quantization | None, tensors: dict[str, StoredTensor], transposed: bool = False,
                    where: str = "the weights") -> dict[str, StoredTensor]:
    """The checkpoint's tensors as the model sees them once dequantized (by name: shape, and the dtype
    `float` for a dequantized one): scales and the other companions gone, `X_blocks` as `X`. Raises
    QuantizationProblem naming the tensor, its file and the format for a tensor it cannot read: a weight
    without its scale or a scale without its weight, a scale grid that does not fit its weight, a dtype
    the format does not store (a quantized tensor in a checkpoint that declares no quantization)."""
    out: dict[str, StoredTensor] = {}
    for name, t in tensors.items():
        if q is None:
            if t.dtype not in FLOAT_TYPES:
                raise QuantizationProblem(f"{t.file} holds {name} in {t.dtype}, not a float type, but config.json "
                                          "declares no quantization_config (fp8, compressed-tensors, mxfp4)")
            out[name] = t
        elif q.method == "mxfp4":
            _mxfp4_tensor(name, t, tensors, out, transposed)
        else:
            _fp8_tensor(q, name, t, tensors, out)
    return out


def _fp8_tensor(q: Quantization, name: str, t: StoredTensor, tensors: dict[str, StoredTensor],
                out: dict[str, StoredTensor]) -> None:
    base, _, suffix = name.rpartition(".")
    if suffix == q.scale:
        if f"{base}.weight" not in tensors:
            raise QuantizationProblem(f"{t.file} holds {name}, a scale of {wants(q)}, but no {base}.weight")
        return
    if suffix in DROPPED:
        return
    if t.dtype in FLOAT_TYPES:
        out[name] = t
        return
    if t.dtype not in FP8_TYPES or suffix != "weight":
        raise QuantizationProblem(f"{t.file} holds {name} in {t.dtype}, which {wants(q)} does not store")
    scale = tensors.get(f"{base}.{q.scale}")
    if scale is None:
        raise QuantizationProblem(f"{t.file} holds {name} in {t.dtype} but not its scale {base}.{q.scale} ({wants(q)})")
    if len(t.shape) < 2 or scale_block(q, t.shape, scale.shape) is None:
        raise QuantizationProblem(f"{scale.file} holds {base}.{q.scale} of shape {_fmt(scale.shape)}, which is "
                                  f"not the scale grid of a {_fmt(t.shape)} weight in {wants(q)}")
    if scale.dtype not in FLOAT_TYPES and not (scale.dtype in E8M0_TYPES and q.e8m0_scales):
        raise QuantizationProblem(f"{scale.file} holds {base}.{q.scale} in {scale.dtype}: {wants(q)} stores "
                                  "float scales or (scale_fmt ue8m0) U8 exponents")
    out[name] = StoredTensor(t.shape, "float", t.file)


def _mxfp4_tensor(name: str, t: StoredTensor, tensors: dict[str, StoredTensor], out: dict[str, StoredTensor],
                  transposed: bool) -> None:
    if name.endswith("_scales"):
        if name.removesuffix("_scales") + "_blocks" not in tensors:
            raise QuantizationProblem(f"{t.file} holds {name}, MXFP4 scales, but no {name.removesuffix('_scales')}"
                                      "_blocks")
        return
    if not name.endswith("_blocks"):
        if t.dtype not in FLOAT_TYPES:
            raise QuantizationProblem(f"{t.file} holds {name} in {t.dtype}, which mxfp4 (X_blocks and X_scales "
                                      "in U8) does not store")
        out[name] = t
        return
    base = name.removesuffix("_blocks")
    scales = tensors.get(base + "_scales")
    if t.dtype != "U8" or len(t.shape) < 3 or t.shape[-1] != MX_GROUP // 2:
        raise QuantizationProblem(f"{t.file} holds {name} of shape {_fmt(t.shape)} in {t.dtype}: MXFP4 blocks are "
                                  f"U8 of [..., rows, groups, {MX_GROUP // 2}]")
    if scales is None or scales.dtype != "U8" or scales.shape != t.shape[:-1]:
        got = "nothing" if scales is None else f"{_fmt(scales.shape)} in {scales.dtype}"
        raise QuantizationProblem(f"{t.file} holds {name} of shape {_fmt(t.shape)}, whose MXFP4 scales "
                                  f"{base}_scales must be U8 of {_fmt(t.shape[:-1])}, not {got}")
    rows, cols = t.shape[-3], t.shape[-2] * MX_GROUP
    out[base] = StoredTensor(t.shape[:-3] + ((cols, rows) if transposed else (rows, cols)), "float", t.file)


def declared(model_dir: Path) -> dict[str, Any] | None:
    """The quantization of the model folder's checkpoint as config.json declares it (None: unquantized), for a
    run's fingerprint, the score cache's key and summary.json: a native format's record, else (a format only
    the transformers fallback reads) its quant_method. Never raises: a folder that cannot be read is checked
    elsewhere."""
    try:
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    try:
        q = read_quantization(config)
    except QuantizationProblem:
        qc = config.get("quantization_config")
        return {"method": str(qc.get("quant_method")) if isinstance(qc, dict) else "unknown"}
    return None if q is None else q.record()
