"""Random checkpoints of real shapes for the benchmarks, written with numpy alone (nothing imports torch,
so a benchmark's first `lmbatch` process still meets a cold machine): presets/PRESET/config.json's shape as
an HF folder in safetensors (a file per 4 GB, an index, the tokenizer's files), values about N(0, 0.02),
norms 1, biases and sinks 0. A preset whose config carries a `quantization_config` is written as the
releases store it:

- `quant_method: fp8` with `weight_block_size` (DeepSeek-V3, Qwen3 `-FP8`): every projection in e4m3 with a
  float32 `weight_scale_inv` per block (embeddings, norms, routers and the LM head as they are);
- `quant_method: mxfp4` (gpt-oss): the experts' `gate_up_proj` / `down_proj` as `_blocks` (e2m1 nibbles,
  [E, out, in / 32, 16] uint8) and `_scales` (e8m0, [E, out, in / 32]).

Families: llama, qwen2, qwen3 (and other dense llama-likes), gpt_oss, deepseek_v3 (names as
transformers 5 saves them; tests/unit/test_random_checkpoint.py holds them to save_pretrained's).
"""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Iterator

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
BLOCK = 1 << 24         # random values drawn once and tiled over every tensor
SHARD = 4 << 30

# dtype -> (safetensors name, bytes a value)
DTYPES = {"bf16": ("BF16", 2), "f32": ("F32", 4), "fp8": ("F8_E4M3", 1), "u8": ("U8", 1)}


def _attention(p: str, cfg: dict, h: int) -> Iterator[tuple[str, tuple[int, ...]]]:
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    d = cfg.get("head_dim") or h // heads
    bias = cfg["model_type"] == "qwen2" or cfg.get("attention_bias", False)
    for name, rows in (("q", heads * d), ("k", kv * d), ("v", kv * d)):
        yield p + f"self_attn.{name}_proj.weight", (rows, h)
        if bias:
            yield p + f"self_attn.{name}_proj.bias", (rows,)
    yield p + "self_attn.o_proj.weight", (h, heads * d)
    if cfg["model_type"] == "gpt_oss":
        yield p + "self_attn.o_proj.bias", (h,)
        yield p + "self_attn.sinks", (heads,)
    if cfg["model_type"] == "qwen3":
        yield p + "self_attn.q_norm.weight", (d,)
        yield p + "self_attn.k_norm.weight", (d,)


def _mla(p: str, cfg: dict, h: int) -> Iterator[tuple[str, tuple[int, ...]]]:
    heads, rank, qr = cfg["num_attention_heads"], cfg["kv_lora_rank"], cfg.get("q_lora_rank")
    nope, rope, v = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    if qr:
        yield p + "self_attn.q_a_proj.weight", (qr, h)
        yield p + "self_attn.q_a_layernorm.weight", (qr,)
        yield p + "self_attn.q_b_proj.weight", (heads * (nope + rope), qr)
    else:
        yield p + "self_attn.q_proj.weight", (heads * (nope + rope), h)
    yield p + "self_attn.kv_a_proj_with_mqa.weight", (rank + rope, h)
    yield p + "self_attn.kv_a_layernorm.weight", (rank,)
    yield p + "self_attn.kv_b_proj.weight", (heads * (nope + v), rank)
    yield p + "self_attn.o_proj.weight", (h, heads * v)


def _mlp(p: str, h: int, i: int) -> Iterator[tuple[str, tuple[int, ...]]]:
    yield p + "gate_proj.weight", (i, h)
    yield p + "up_proj.weight", (i, h)
    yield p + "down_proj.weight", (h, i)


def tensors(cfg: dict) -> dict[str, tuple[int, ...]]:
    """The HF checkpoint's tensor names and shapes (unquantized) of a config of a family above."""
    h, v, kind = cfg["hidden_size"], cfg["vocab_size"], cfg["model_type"]
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not cfg.get("tie_word_embeddings", False):
        out["lm_head.weight"] = (v, h)
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        out |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}
        out |= dict(_mla(p, cfg, h) if kind == "deepseek_v3" else _attention(p, cfg, h))
        if kind == "gpt_oss":
            e, i = cfg["num_local_experts"], cfg["intermediate_size"]
            q = p + "mlp."
            out |= {q + "router.weight": (e, h), q + "router.bias": (e,),
                    q + "experts.gate_up_proj": (e, h, 2 * i), q + "experts.gate_up_proj_bias": (e, 2 * i),
                    q + "experts.down_proj": (e, i, h), q + "experts.down_proj_bias": (e, h)}
        elif kind == "deepseek_v3" and n >= cfg.get("first_k_dense_replace", 0):
            e, i = cfg["n_routed_experts"], cfg["moe_intermediate_size"]
            q = p + "mlp."
            for x in range(e):
                out |= dict(_mlp(f"{q}experts.{x}.", h, i))
            out |= {q + "gate.weight": (e, h), q + "gate.e_score_correction_bias": (e,)}
            out |= dict(_mlp(q + "shared_experts.", h, i * cfg.get("n_shared_experts", 1)))
        else:
            out |= dict(_mlp(p + "mlp.", h, cfg["intermediate_size"]))
    return out


def _quantized(name: str, shape: tuple[int, ...], quant: dict | None) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, dtype, shape) of what the release stores for one unquantized tensor."""
    method = (quant or {}).get("quant_method")
    if method == "fp8" and len(shape) == 2 and "proj" in name and "embed" not in name:
        b0, b1 = quant["weight_block_size"]
        grid = (math.ceil(shape[0] / b0), math.ceil(shape[1] / b1))
        return [(name, "fp8", shape), (name.replace(".weight", ".weight_scale_inv"), "f32", grid)]
    if method == "mxfp4" and name.endswith(("experts.gate_up_proj", "experts.down_proj")):
        e, rows_in, cols_out = shape                     # stored [E, in, out] unquantized; packed out-major
        return [(name + "_blocks", "u8", (e, cols_out, rows_in // 32, 16)),
                (name + "_scales", "u8", (e, cols_out, rows_in // 32))]
    return [(name, "f32" if name.endswith("e_score_correction_bias") else "bf16", shape)]


def _fill(name: str, dtype: str) -> str:
    if dtype == "fp8" or (dtype == "u8" and name.endswith("_blocks")):
        return "random"
    if name.endswith("weight_scale_inv"):
        return "fp8-scale"
    if name.endswith("_scales"):
        return "mx-scale"
    if name.endswith(("norm.weight", "layernorm.weight")):
        return "one"
    if name.endswith(("bias", "sinks")):
        return "zero"
    return "random"


def _blocks() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    normal = rng.standard_normal(BLOCK, dtype=np.float32)
    bf16 = ((normal * 0.02).view(np.uint32) >> 16).astype(np.uint16)
    # e4m3 of N(0, 1) values (scaled by 0.02 through weight_scale_inv): sign, exponent, mantissa by hand
    mag = np.clip(np.abs(normal), 2.0 ** -6, 448.0)
    exp = np.floor(np.log2(mag)).astype(np.int32)
    man = np.clip(np.round((mag / 2.0 ** exp - 1) * 8), 0, 7).astype(np.int32)
    code = ((exp + 7) << 3 | man).clip(0, 0x7E)          # 0x7F is NaN
    fp8 = (code | (normal < 0) << 7).astype(np.uint8)
    return {"bf16": bf16, "fp8": fp8, "u8": rng.integers(0, 256, BLOCK, dtype=np.uint8)}


def _write_tensor(f, fill: str, dtype: str, count: int, blocks: dict[str, np.ndarray]) -> None:
    if fill == "random":
        for start in range(0, count, BLOCK):
            f.write(blocks[dtype][:min(BLOCK, count - start)].tobytes())
        return
    value = {("one", "bf16"): np.uint16(0x3F80), ("zero", "bf16"): np.uint16(0), ("zero", "f32"): np.float32(0),
             ("fp8-scale", "f32"): np.float32(0.02), ("mx-scale", "u8"): np.uint8(127 - 8)}[(fill, dtype)]
    f.write(np.full(count, value).tobytes())


def write_random_checkpoint(preset: str, target: Path, tokenizer: Path) -> Path:
    """presets/PRESET's shape as an HF folder of random weights, as the module says. Reused when present."""
    return write_checkpoint(json.loads((ROOT / "presets" / preset / "config.json").read_text()), target, tokenizer)


def write_checkpoint(cfg: dict, target: Path, tokenizer: Path | None = None) -> Path:
    """`cfg` (a config.json's dict) as an HF folder of random weights in `target` (kept if there)."""
    if not (target / "config.json").is_file():
        tmp = target.with_name(target.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        stored = [t for name, shape in tensors(cfg).items()
                  for t in _quantized(name, shape, cfg.get("quantization_config"))]
        shards: list[list[tuple[str, str, tuple[int, ...]]]] = [[]]
        size = 0
        for name, dtype, shape in stored:
            n = int(np.prod(shape)) * DTYPES[dtype][1]
            if size and size + n > SHARD:
                shards.append([])
                size = 0
            shards[-1].append((name, dtype, shape))
            size += n
        blocks = _blocks()
        weight_map = {}
        for k, shard in enumerate(shards):
            fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
            header, offset = {}, 0
            for name, dtype, shape in shard:
                n = int(np.prod(shape)) * DTYPES[dtype][1]
                header[name] = {"dtype": DTYPES[dtype][0], "shape": list(shape), "data_offsets": [offset, offset + n]}
                offset += n
                weight_map[name] = fname
            raw = json.dumps(header).encode()
            raw += b" " * (-len(raw) % 8)
            with open(tmp / fname, "wb") as f:
                f.write(len(raw).to_bytes(8, "little") + raw)
                for name, dtype, shape in shard:
                    _write_tensor(f, _fill(name, dtype), dtype, int(np.prod(shape)), blocks)
        (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
        (tmp / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k != "torch_dtype"}))
        tmp.rename(target)
    for f in tokenizer.iterdir() if tokenizer else ():
        if f.name.startswith(("tokenizer", "special_tokens")) or f.suffix == ".jinja":
            shutil.copy(f, target / f.name)
    return target
