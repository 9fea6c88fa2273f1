"""What an engine is built from, declared once (`EngineSpec`: `lmbatch run`, the lm-eval backend and
each data-parallel worker build theirs from one), how what a user left open is fitted to the device
and the model (`fit`), and `build_engine` (one engine in this process).

Defaults, and why: on CPU float32 (bfloat16 matmuls are ~100x slower on most CPUs), a KV pool of
4 GiB and batches of 4096 tokens; on CUDA bfloat16, a pool of half the free memory (at most 1,048,576
tokens: scoring in DFS order needs only its working set and runs as fast in it as in a larger one, but
generation decodes as many rows at once as the pool holds, and a pool too small for every row runs them
in waves: BENCHMARKS.md, "GPU: generation") and the largest batch up
to 16,384 tokens whose activations take at most a tenth of the free memory. Attention: our Triton
kernels on CUDA, FlashInfer only where its kernels for this model are built already (its first use
compiles them for a minute or two), the PyTorch reference on CPU and for float32.
"""
from __future__ import annotations

import os
import sys
from dataclasses import replace
from typing import TYPE_CHECKING, NamedTuple

from lmbatch.attention.registry import BACKENDS, DEFAULT_CUDA, REFERENCE, REGISTRY, able
from lmbatch.engine.options import EngineSpec
from lmbatch.errors import UserError
from lmbatch.timing import Phases

if TYPE_CHECKING:
    from lmbatch.engine.engine import Engine
    from lmbatch.model.config import ModelConfig
    from lmbatch.model.tensor_parallel import TensorParallel

DTYPES = ("float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
ATTENTION = ("auto", *BACKENDS)    # auto, flashinfer, triton, cascade, torch
CPU_BATCH_TOKENS = 4096
CPU_KV_BYTES = 4 << 30
CUDA_MAX_KV_TOKENS = 1 << 20
CUDA_MAX_BATCH_TOKENS = 16384


class Attention(NamedTuple):
    name: str       # the backend (lmbatch.attention.REGISTRY)
    why: str        # what decided it, for the summary


def pick_device(device: str, dtype: str | None) -> tuple[str, str]:
    """(device, dtype name): auto is CUDA when a GPU is visible; float32 on CPU, bfloat16 on CUDA."""
    import torch

    if device not in DEVICES:
        raise UserError(f"--device {device}: use auto, cpu or cuda")
    if dtype is not None and dtype not in DTYPES:
        raise UserError(f"--dtype {dtype}: use one of {', '.join(DTYPES)}")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA GPU is visible here")
    dtype = dtype or ("float32" if device == "cpu" else "bfloat16")
    if device == "cpu" and dtype == "float16":
        raise UserError("--dtype float16 on CPU: use float32 (or bfloat16, ~100x slower on most CPUs)")
    return device, dtype


def _bytes(dtype: str) -> int:
    return {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]


def default_kv_tokens(cfg: ModelConfig, device: str, dtype: str, share: int = 1) -> int:
    """The KV pool: half of the GPU's free memory, of its `share` (workers on one GPU), or CPU_KV_BYTES."""
    per_token = (1 if cfg.keys_are_values else 2) * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * _bytes(dtype)
    if device == "cpu":
        return min(CPU_KV_BYTES // per_token, 1 << 20)
    return min(_free_cuda() // share // 2 // per_token, CUDA_MAX_KV_TOKENS)


def default_batch_tokens(cfg: ModelConfig, device: str, dtype: str, share: int = 1) -> int:
    """The prefill batch: its activations within a tenth of the GPU's free memory (of its `share`)."""
    if device == "cpu":
        return CPU_BATCH_TOKENS
    width = 3 * cfg.intermediate_size + 4 * cfg.hidden_size + (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    per_token = width * _bytes(dtype)
    budget = CUDA_MAX_BATCH_TOKENS
    free = _free_cuda() // share
    while budget > 1024 and budget * per_token > free // 10:
        budget //= 2
    return budget


def _free_cuda() -> int:
    import torch

    return int(torch.cuda.mem_get_info()[0])


SINKS = "attention sinks (gpt-oss)"


def pick_attention(wanted: str, device: str, dtype: str, cfg: ModelConfig) -> Attention:
    """The attention backend and why: see the module's docstring."""
    from lmbatch.attention.gpu import flashinfer_built

    if wanted not in ATTENTION:
        raise UserError(f"--attention {wanted}: use one of {', '.join(ATTENTION)}")
    if cfg.runtime != "native":
        return Attention(REFERENCE, "the transformers fallback attends by itself")
    if wanted == REFERENCE:
        return Attention(REFERENCE, "asked for")
    entry = REGISTRY.get(wanted)        # None: auto
    why_torch = cfg.torch_attention_only()
    if why_torch and device == "cuda" and dtype != "float32":
        if entry is not None and not entry.latent:
            raise UserError(f"--attention {wanted}: {cfg.model_type} has {why_torch}; use {REFERENCE} or auto")
        return Attention(REFERENCE, why_torch) if entry is None else Attention(wanted, "asked for")
    if cfg.attn_sinks and device == "cuda" and dtype != "float32":
        if entry is not None and not entry.sinks:
            raise UserError(f"--attention {wanted}: {cfg.model_type} has {SINKS}, which only the {able('sinks')} "
                            "backends compute")
        return Attention(DEFAULT_CUDA if entry is None else wanted, f"{SINKS}: Triton's kernels have them")
    if device != "cuda":
        if entry is not None and entry.cuda:
            raise UserError(f"--attention {wanted} needs CUDA; on CPU lmbatch runs the {REFERENCE} backend")
        return Attention(REFERENCE, "CPU") if entry is None else Attention(wanted, "asked for")
    if dtype == "float32":
        if entry is not None and not entry.float32:
            raise UserError(f"--attention {wanted}: float32 runs the {REFERENCE} backend (FlashInfer has no float32 "
                            "kernels; Triton would round float32 inputs to tf32)")
        return Attention(REFERENCE, "float32") if entry is None else Attention(wanted, "asked for")
    windowed = any(w is not None for w in cfg.layer_windows)
    built, where = flashinfer_built(cfg.head_dim, dtype, windowed, cfg.attn_softcap > 0)
    if entry is not None and wanted != "flashinfer":
        return Attention(wanted, "asked for")
    if wanted == "flashinfer":
        if where == "not installed":
            raise UserError("--attention flashinfer: FlashInfer is not installed (pip install -e '.[gpu]')")
        if not built:
            print("lmbatch: FlashInfer compiles its attention kernels for this model first (once per machine, "
                  "about 1-2 minutes)", file=sys.stderr)
        return Attention("flashinfer", "asked for" + ("" if built else " (compiled at first use)"))
    if built:
        return Attention("flashinfer", f"its kernels for this model are built ({where})")
    return Attention(DEFAULT_CUDA, "FlashInfer is not installed" if where == "not installed" else
                     "FlashInfer's kernels for this model are not built yet (--attention flashinfer builds them)")


def fit(spec: EngineSpec, cfg: ModelConfig) -> tuple[EngineSpec, Attention]:
    """The spec with every open value of one engine decided (device, dtype, sizes, attention backend: its
    data- and tensor-parallel sizes are decided before, engine/devices.py), and the backend's reason."""
    device, dtype = pick_device(spec.device, spec.dtype)
    o = spec.options
    attention = pick_attention(o.attention or "auto", device, dtype, cfg)
    if o.deterministic and not REGISTRY[attention.name].deterministic:
        if (o.attention or "auto") != "auto":     # their sums depend on the batch (split keys, shared levels)
            raise UserError(f"--attention {attention.name} is not deterministic: use {DEFAULT_CUDA} or auto with "
                            "--deterministic")
        attention = Attention(DEFAULT_CUDA, "deterministic")
    share = spec.gpu_share
    kv = o.kv_cache_tokens if o.kv_cache_tokens is not None else default_kv_tokens(cfg, device, dtype, share)
    batch = o.max_tokens_per_batch if o.max_tokens_per_batch is not None else \
        default_batch_tokens(cfg, device, dtype, share)
    fp8_gemm = o.fp8_gemm if o.fp8_gemm is not None else fp8_fits(spec, cfg, device, dtype)
    rows = o.max_running if o.max_running is not None else decode_rows(cfg, device, dtype, spec.stages)
    wide = o.wide_rows if o.wide_rows is not None else \
        rows if o.max_running is not None else max(rows, wide_rows(cfg, device, dtype))
    options = replace(o, kv_cache_tokens=kv, max_tokens_per_batch=batch, attention=attention.name, fp8_gemm=fp8_gemm,
                      max_running=rows, wide_rows=wide)
    return replace(spec, device=device, dtype=dtype, options=options), attention


def decode_rows(cfg: ModelConfig, device: str, dtype: str, stages: int = 1) -> int:
    """Decode rows: SMALL_DECODE_ROWS for a run whose host sets the pace (one that generates in
    HOST_BOUND_STAGES or more, on a model of SMALL_MODEL_BYTES at most, on a GPU: tree of thought at 1.5B,
    decode steps 11.3 -> 9.6 s, half of them, BENCHMARKS.md), else DECODE_ROWS: a larger model's step is its
    GEMMs' FLOPs at 512 rows already, and a run of one stage of long prompts took longer with 1,024 (lm-eval's
    gsm8k at 1.5B, 1,319 rows of ~1,260 tokens: execute 14.2 s against 12.7, H200, 2026-11-29)."""
    from lmbatch.engine.options import DECODE_ROWS, SMALL_DECODE_ROWS
    from lmbatch.engine.sizes import HOST_BOUND_STAGES, SMALL_MODEL_BYTES, weight_bytes

    host_bound = device == "cuda" and stages >= HOST_BOUND_STAGES and weight_bytes(cfg, dtype) <= SMALL_MODEL_BYTES
    return SMALL_DECODE_ROWS if host_bound else DECODE_ROWS


def wide_rows(cfg: ModelConfig, device: str, dtype: str) -> int:
    """Decode rows of a stream of many generations (options.WIDE_FROM: k samples of every question): on a GPU, a
    small model's (SMALL_MODEL_BYTES) step reads its weights in less time than 512 rows' FLOPs take, so twice
    the rows share that read (lm-eval's gsm8k_cot_self_consistency, 16 samples of 330 questions at 1.5B: execute
    15.4, 15.0 s with 1,024 rows against 16.3, 16.6 with 512; `bench_decode.py`, 16 samples of 800: 105k tok/s
    against 86k, 2,048 rows 106k; H200, 2026-11-29). A stream of fewer keeps the engine's rows: 1,319 gsm8k
    questions at 1,024 rows took longer (`decode_rows`)."""
    from lmbatch.engine.options import DECODE_ROWS, SMALL_DECODE_ROWS
    from lmbatch.engine.sizes import SMALL_MODEL_BYTES, weight_bytes

    return SMALL_DECODE_ROWS if device == "cuda" and weight_bytes(cfg, dtype) <= SMALL_MODEL_BYTES else DECODE_ROWS


def fp8_fits(spec: EngineSpec, cfg: ModelConfig, device: str, dtype: str) -> bool:
    """Whether an FP8 checkpoint's linear layers run as FP8 GEMMs here (model/fp8.py `fits`), else its weights
    are dequantized on load."""
    from pathlib import Path

    from lmbatch.model.fp8 import Where, fits
    from lmbatch.model.quantization import read_quantization

    try:
        import json

        q = read_quantization(json.loads((Path(spec.model_dir) / "config.json").read_text(encoding="utf-8")))
    except (OSError, ValueError):       # checked with the folder (checkpoint.py); a fallback's own format
        return False
    if q is None:
        return False
    import torch

    capability = torch.cuda.get_device_capability() if device == "cuda" else None
    return fits(q, cfg, Where(device, dtype, capability, spec.ranks, spec.options.deterministic))[0]


def fit_pool(spec: EngineSpec, longest: int, user_set: bool) -> EngineSpec:
    """The pool must hold the longest request plus one batch: a fitted pool grows to that; one the
    user set (`user_set`) is an error."""
    o = spec.options
    assert o.kv_cache_tokens is not None and o.max_tokens_per_batch is not None, "fit the spec first"
    need = longest + o.max_tokens_per_batch
    if o.kv_cache_tokens >= need:
        return spec
    if user_set:
        raise UserError(f"--kv-cache-tokens {o.kv_cache_tokens} is too small: the longest prompt ({longest}) "
                        f"plus one batch ({o.max_tokens_per_batch}) needs {need}")
    return replace(spec, options=replace(o, kv_cache_tokens=need))


def gpus(n: int, share: int = 1) -> list[str]:
    """The CUDA_VISIBLE_DEVICES entry of each of n processes: the first n / `share` GPUs this process sees,
    each given to `share` of them in turn."""
    seen = os.environ.get("CUDA_VISIBLE_DEVICES")
    m = -(-n // share)
    names = ([s.strip() for s in seen.split(",")] if seen else [str(k) for k in range(m)])[:m]
    return [names[k % m] for k in range(n)]


def several(spec: EngineSpec) -> bool:
    """Whether the spec's engine is processes of their own (workers, a split model, a Ray cluster)."""
    return int(spec.data_parallel) > 1 or int(spec.tensor_parallel) > 1 or spec.ray_address is not None


def build_engine(spec: EngineSpec, tokenizer: object, clock: Phases, tp: TensorParallel | None = None) -> Engine:
    """One fitted spec's engine in this process (`tp`: this process's rank of a split model), warmed up."""
    import torch

    from lmbatch.engine.engine import Engine, Weights

    assert spec.dtype is not None, "fit the spec first"
    with clock("weights"):
        engine = Engine.from_pretrained(spec.model_dir, spec.options, device=spec.device,
                                        dtype=getattr(torch, spec.dtype), tokenizer=tokenizer,
                                        weights=Weights(spec.load_format, tp))
    with clock("compile"):
        engine.warm_up(graphs=False)
    if spec.graphs_ahead:
        with clock("graphs"):
            engine.model_runner.capture_graphs()
    return engine


def start_cuda(device: str) -> None:
    """CUDA's context, now (its start is a phase of its own, not the first allocation's)."""
    if device == "cuda":
        import torch

        torch.cuda.init()
        torch.empty(1, device="cuda")
