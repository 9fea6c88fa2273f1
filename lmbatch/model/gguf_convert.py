"""Convert a llama GGUF into a float32 Hugging Face folder with numpy, safetensors and tokenizers alone.

Why not transformers' own GGUF loading (`from_pretrained(gguf_file=...)` then `save_pretrained`): it
builds a whole model and a slow tokenizer on the way (BENCHMARKS.md, "Figures behind rules in the
code"), where the job is a few array operations: parse the header, dequantize each tensor, undo
llama.cpp's Q/K row order, and write the weights, the config and the tokenizer. The result is the same
folder, weights bitwise equal: tests/unit/test_models.py compares it with the transformers route.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any, cast

import numpy as np

# GGUF metadata value types (gguf-py's GGUFValueType) -> numpy dtype; 8 is a string, 9 an array.
_VALUE_DTYPES = {
    0: "u1", 1: "i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"
}
_STRING, _ARRAY = 8, 9
_F32, _Q4_1, _Q8_0 = 0, 3, 8  # ggml type ids
_CONTROL, _USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values

# blk.N.<part> -> model.layers.N.<module>; the rest by their whole name.
_LAYER_MODULES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_MODULES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# Pre-tokenizers that split text as GPT-2's byte-level regex does; others (llama3, qwen2...) need their own split.
_GPT2_SPLIT_PRE = ("default", "gpt-2", "smollm")


def convert_gguf(gguf_path: Path, out: Path) -> None:
    """Write model.safetensors, config.json, generation_config.json and the tokenizer files into out."""
    from safetensors.numpy import save_file

    meta, raw = read_gguf(gguf_path)
    if meta.get("general.architecture") != "llama":
        raise ValueError(f"only llama GGUFs are supported, not {meta.get('general.architecture')!r}")
    config = hf_config(meta, tied="output.weight" not in raw)
    tensors = {hf_name(name): hf_tensor(name, data, kind, config) for name, (kind, data) in raw.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})  # "pt": transformers wants it
    del tensors
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    special_ids: dict[str, Any] = {key: config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")
                                   if key in config}
    generation = {"_from_model_config": True, **special_ids}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2, sort_keys=True) + "\n")
    write_tokenizer(meta, out)


class _Reader:
    """Values of a GGUF file's header, read in order from `pos`."""

    def __init__(self, buf: bytes, pos: int):
        self.buf, self.pos = buf, pos

    def take(self, dtype: str, count: int = 1) -> np.ndarray:
        values = np.frombuffer(self.buf, dtype, count, self.pos)
        self.pos += values.nbytes
        return values

    def count(self) -> int:  # a uint64 (sizes, counts); struct is much quicker than numpy for one value
        self.pos += 8
        return struct.unpack_from("<Q", self.buf, self.pos - 8)[0]

    def string(self) -> str:
        size = self.count()
        self.pos += size
        return self.buf[self.pos - size : self.pos].decode("utf-8")

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, size = int(self.take("<u4")[0]), self.count()
            if item in _VALUE_DTYPES:
                return self.take(_VALUE_DTYPES[item], size).tolist()
            return [self.value(item) for _ in range(size)]
        return self.take(_VALUE_DTYPES[kind])[0].item()


def read_gguf(path: Path) -> tuple[dict[str, Any], dict[str, tuple[int, np.ndarray]]]:
    """Metadata and raw tensors (ggml type, bytes shaped as the HF weight's rows) of a GGUF v2/v3 file.

    Our own parser rather than gguf.GGUFReader: that one makes several numpy views for each string of
    the ~100k-entry vocabulary and merges arrays, an order of magnitude slower than this (BENCHMARKS.md).
    """
    buf = path.read_bytes()
    magic, version = buf[:4], struct.unpack_from("<I", buf, 4)[0]
    if magic != b"GGUF" or version not in (2, 3):
        raise ValueError(f"{path} is not a little-endian GGUF v2/v3 file")
    r = _Reader(buf, 8)
    n_tensors, n_values = r.count(), r.count()
    meta = {}
    for _ in range(n_values):
        key = r.string()
        meta[key] = r.value(int(r.take("<u4")[0]))
    infos = []
    for _ in range(n_tensors):
        name = r.string()
        dims = r.take("<u8", int(r.take("<u4")[0])).tolist()
        kind, offset = int(r.take("<u4")[0]), r.count()
        infos.append((name, dims, kind, offset))
    from gguf import GGML_QUANT_SIZES  # (elements, bytes) per block of each ggml type

    align = meta.get("general.alignment", 32)
    start = -(-r.pos // align) * align
    tensors = {}
    for name, dims, kind, offset in infos:
        block, block_bytes = cast("dict[int, tuple[int, int]]", GGML_QUANT_SIZES)[kind]  # IntEnum keys: ints work
        rows = math.prod(dims[1:])  # GGUF lists dims innermost first: dims[0] is the row length
        data = np.frombuffer(buf, np.uint8, rows * dims[0] // block * block_bytes, start + offset)
        tensors[name] = (kind, data.reshape(*dims[:0:-1], -1))
    return meta, tensors


def dequantize(data: np.ndarray, kind: int) -> np.ndarray:
    """float32 values of raw GGUF bytes (..., row bytes) -> (..., row length), bitwise as gguf-py's.

    transformers dequantizes with gguf.quants.dequantize, which makes a float32 temporary at every
    step. Q4_1 (the embedded model's layers) and Q8_0 (its embeddings) are done here in fewer passes
    (faster: BENCHMARKS.md), with the same float32 operations in the same order so the bits do not change.
    """
    rows = data.shape[:-1]
    if kind == _Q4_1:  # blocks of 32: f16 scale d, f16 minimum m, 16 bytes of nibbles (low ones first)
        blocks = data.reshape(-1, 20)
        scale, low = blocks[:, 0:2].view(np.float16).astype(np.float32), blocks[:, 2:4].view(np.float16)
        nibbles = np.empty((len(blocks), 2, 16), np.uint8)
        np.bitwise_and(blocks[:, 4:], 0x0F, out=nibbles[:, 0])
        np.right_shift(blocks[:, 4:], 4, out=nibbles[:, 1])
        values = np.multiply(nibbles.reshape(-1, 32), scale, dtype=np.float32)
        values += low.astype(np.float32)
    elif kind == _Q8_0:  # blocks of 32: f16 scale d, 32 int8
        blocks = data.reshape(-1, 34)
        scale = blocks[:, 0:2].view(np.float16).astype(np.float32)
        values = np.multiply(blocks[:, 2:].view(np.int8), scale, dtype=np.float32)
    elif kind == _F32:
        values = data.view(np.float32).copy()
    else:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize as gguf_dequantize

        values = gguf_dequantize(data, GGMLQuantizationType(kind))
    return values.reshape(*rows, -1)


def hf_name(gguf_name: str) -> str:
    """HF llama parameter name of a GGUF tensor: blk.3.attn_q.weight -> model.layers.3.self_attn.q_proj.weight."""
    base, suffix = gguf_name.rsplit(".", 1)
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_MODULES:
        return f"model.layers.{parts[1]}.{_LAYER_MODULES[parts[2]]}.{suffix}"
    if base in _TOP_MODULES:
        return f"{_TOP_MODULES[base]}.{suffix}"
    raise ValueError(f"GGUF tensor {gguf_name} has no llama counterpart")


def hf_tensor(gguf_name: str, data: np.ndarray, kind: int, config: dict[str, Any]) -> np.ndarray:
    """The float32 HF weight of a GGUF tensor, with llama.cpp's Q/K row permutation undone.

    llama.cpp's converter reorders each head's rows of q_proj and k_proj from HF's rotate-half RoPE
    layout (first half, second half) to its interleaved one (pairs). Within each head, row i*2+j of
    the GGUF is row j*half+i of HF: view the rows as (heads, half, 2) and swap the last two axes back,
    as transformers' GGUF loader does.
    """
    values = dequantize(data, kind)
    part = gguf_name.split(".")[2] if gguf_name.startswith("blk.") else ""
    if part in ("attn_q", "attn_k"):
        heads = config["num_attention_heads"] if part == "attn_q" else config["num_key_value_heads"]
        shape = values.shape
        values = values.reshape(heads, shape[0] // heads // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)
    return values


def hf_config(meta: dict[str, Any], tied: bool) -> dict[str, Any]:
    """config.json of a LlamaForCausalLM, with the keys and values transformers' GGUF loading writes.

    rope_theta is written both plainly (what transformers 4.x reads) and inside rope_parameters
    (what 5.x writes); 5.x reads either.
    """
    if any(key.startswith("llama.rope.scaling.") for key in meta):
        raise ValueError("GGUFs with RoPE scaling are not supported")
    heads = meta["llama.attention.head_count"]
    hidden = meta["llama.embedding_length"]
    theta = float(meta.get("llama.rope.freq_base", 10000.0))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "dtype": "float32",
        "head_dim": meta.get("llama.rope.dimension_count", hidden // heads),
        "hidden_act": "silu",
        "hidden_size": hidden,
        "initializer_range": 0.02,
        "intermediate_size": meta["llama.feed_forward_length"],
        "max_position_embeddings": meta["llama.context_length"],
        "mlp_bias": False,
        "num_attention_heads": heads,
        "num_hidden_layers": meta["llama.block_count"],
        "num_key_value_heads": meta.get("llama.attention.head_count_kv", heads),
        "pretraining_tp": 1,
        "rms_norm_eps": meta["llama.attention.layer_norm_rms_epsilon"],
        "rope_parameters": {"rope_theta": theta, "rope_type": "default"},
        "rope_theta": theta,
        "tie_word_embeddings": tied,
        "use_cache": True,
        "vocab_size": meta.get("llama.vocab_size", len(meta["tokenizer.ggml.tokens"])),
    }
    config.update({f"{name}_token_id": token_id for name, token_id in _special_ids(meta).items()})
    return config


def _special_ids(meta: dict[str, Any]) -> dict[str, int]:
    """The ids of the bos/eos/unk/pad tokens the GGUF names, by those short names."""
    keys = {"bos": "bos", "eos": "eos", "unk": "unknown", "pad": "padding"}
    ids = {name: meta.get(f"tokenizer.ggml.{key}_token_id") for name, key in keys.items()}
    return {name: token_id for name, token_id in ids.items() if token_id is not None}


def _byte_chars() -> list[str]:
    """GPT-2's printable stand-in for each byte value: how byte-level BPE vocabularies spell tokens."""
    kept = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    spare = iter(range(256, 512))
    return [chr(byte) if byte in kept else chr(next(spare)) for byte in range(256)]


def write_tokenizer(meta: dict[str, Any], out: Path) -> None:
    """tokenizer.json, tokenizer_config.json and chat_template.jinja of the GGUF's byte-level BPE.

    Built as transformers builds a GGUF's "gpt2" tokenizer (a GPT2Tokenizer, then the file's control
    tokens added as special and its user-defined ones as plain added tokens), with no BOS on plain
    text, like the hub tokenizer; directly with `tokenizers`, which is much faster.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    pre = meta.get("tokenizer.ggml.pre", "default")
    if meta.get("tokenizer.ggml.model") != "gpt2" or pre not in _GPT2_SPLIT_PRE:
        raise ValueError(f"unsupported GGUF tokenizer {meta.get('tokenizer.ggml.model')!r} / {pre!r}")
    tokens = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type") or [0] * len(tokens)
    chars = _byte_chars()
    alphabet = set(chars)
    # Tokens the file writes in plain text rather than the byte alphabet get spelled in it.
    spelled = [t if set(t) <= alphabet else "".join(chars[b] for b in t.encode("utf-8")) for t in tokens]
    merges = [tuple(merge.split(" ")) for merge in meta["tokenizer.ggml.merges"]]
    bpe = models.BPE(
        {token: i for i, token in enumerate(spelled)}, merges, continuing_subword_prefix="", end_of_word_suffix=""
    )
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1")  # no BOS
    # A control token outside the byte alphabet is a llama.cpp mislabel; transformers skips those too.
    special = [t for t, kind in zip(tokens, types) if kind == _CONTROL and set(t) <= alphabet]
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in special])
    tok.add_tokens([AddedToken(t, normalized=False) for t, kind in zip(tokens, types) if kind == _USER_DEFINED])
    tok.save(str(out / "tokenizer.json"))

    tok_config: dict[str, Any] = {
        "backend": "tokenizers",
        "model_max_length": int(1e30),  # transformers' "no limit"
        "tokenizer_class": "PreTrainedTokenizerFast",  # transformers 5.x: an alias of TokenizersBackend
    }
    tok_config.update({f"{name}_token": tokens[token_id] for name, token_id in _special_ids(meta).items()})
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2, sort_keys=True) + "\n")
    if "tokenizer.chat_template" in meta:
        (out / "chat_template.jinja").write_text(meta["tokenizer.chat_template"])
