"""How many devices a run uses, decided before torch is imported (so data-parallel workers start at
once): the GPUs this process may use and their memory, read from NVML (or the driver's /proc
entries), and `--data-parallel auto` / `--tensor-parallel auto` from them and the model's size.

- tensor parallel, auto: 1 where the model's weights fit one GPU with room for its KV cache, else the
  fewest GPUs (a power of two dividing its heads) whose share fits;
- data parallel, auto: every visible GPU over that (on a Ray cluster, every GPU of the cluster), but one
  engine for a job whose model work is known to be small (a cached scoring workload's figures); on CPU 1.
  A run whose steps the host sets puts up to GENERATING_SHARE workers on each local GPU (SHARED_WORKERS in
  all at most) where the machine has the cores: one that generates in several stages (`EngineSpec.stages`,
  tree of thought's 7) on a model of SMALL_MODEL_BYTES at most, so one worker's host work (its step loop,
  the next stage's tokenizing and planning) runs beside the others' kernels. Where a step's device time
  is longer (an 8B model), or a run is one or two stages (lm-eval's generate_until, thinking then JSON),
  two workers a GPU measured no faster or slower: each reads the weights for half the rows (BENCHMARKS.md,
  "Workers a GPU").
  A number of workers beyond the GPUs (a multiple of them, one GPU a model) puts as many on each GPU
  (`EngineSpec.gpu_share`): they share its memory, and one's host work runs beside another's kernels.
"""
from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from lmbatch.engine.sizes import HOST_BOUND_STAGES, SMALL_MODEL_BYTES, weight_bytes
from lmbatch.errors import UserError

if TYPE_CHECKING:
    from lmbatch.engine.options import EngineSpec
    from lmbatch.model.config import ModelConfig

FIT_SHARE = 0.6     # the weights may take this share of a GPU's memory: the rest holds KV cache and activations
# a job of less model work than this (about 3 s of one GPU at 400 TFLOP/s) runs on one engine: its workers
# would start later than one engine does for less than they could save (BENCHMARKS.md, "Figures behind
# rules in the code")
SMALL_JOB_FLOPS = 1.2e15
GENERATING_SHARE = 4    # workers a GPU that `auto` gives a run whose steps the host sets (`_share`), at most ...
SHARED_WORKERS = 8      # ... and workers in all (the most measured: 8 on 4 GPUs; 4 on one, BENCHMARKS.md), for a
# run that generates in HOST_BOUND_STAGES or more on a model of SMALL_MODEL_BYTES (engine/sizes.py) ...
CORES_A_WORKER = 4      # ... where the machine has this many cores for each worker


class GPUs(NamedTuple):
    visible: int                # GPUs this process may use
    memory: int | None          # bytes of the smallest (None: not known without CUDA)


class Layout(NamedTuple):
    data_parallel: int
    tensor_parallel: int
    why: str                    # what decided them, for the summary


def visible_gpus() -> GPUs:
    """The GPUs CUDA would show this process (CUDA_VISIBLE_DEVICES applied), without starting CUDA."""
    total, memory = _nvml()
    if total is None:
        folder = Path("/proc/driver/nvidia/gpus")
        total = len(list(folder.iterdir())) if folder.is_dir() else 0
    seen = os.environ.get("CUDA_VISIBLE_DEVICES")
    if seen is not None:
        names = []
        for name in seen.split(","):
            name = name.strip()
            if not name or name.startswith("-"):      # CUDA stops at the first entry it cannot use
                break
            names.append(name)
        total = min(total, len(names))
    return GPUs(total, memory if total else None)


def _nvml() -> tuple[int | None, int | None]:
    """(GPUs, the smallest one's memory) from NVML, or (None, None) where it is missing."""
    try:
        import pynvml
    except ImportError:
        return None, None
    try:
        pynvml.nvmlInit()
        try:
            n = pynvml.nvmlDeviceGetCount()
            mem = [int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(k)).total) for k in range(n)]
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001  pynvml's own error types (no driver, no GPU): as if it were missing
        return None, None
    return n, min(mem) if mem else None


def check_count(flag: str, wanted: int | str) -> None:
    """A --data-parallel / --tensor-parallel value: a whole number, at least 1, or auto."""
    wanted = str(wanted)
    if wanted != "auto" and not (wanted.isdigit() and int(wanted) >= 1):
        what = "a number of workers" if flag == "--data-parallel" else "a number of devices"
        raise UserError(f"{flag} {wanted}: use {what} (at least 1) or auto")


def layout(spec: EngineSpec, cfg: ModelConfig, gpus: GPUs | None = None, work: float | None = None,
           cores: int | None = None) -> Layout:
    """The run's data- and tensor-parallel sizes (`spec`'s, with auto decided) and why (`work`: the job's
    model FLOPs, where known; `cores`: the machine's, else this process's usable ones)."""
    dp, tp = str(spec.data_parallel), str(spec.tensor_parallel)
    check_count("--data-parallel", dp)
    check_count("--tensor-parallel", tp)
    gpus = gpus if gpus is not None else visible_gpus()
    cuda = spec.device == "cuda" or (spec.device == "auto" and gpus.visible > 0)
    if not cuda:
        auto = [flag for flag, v in (("--data-parallel", dp), ("--tensor-parallel", tp)) if v == "auto"]
        return Layout(1 if dp == "auto" else int(dp), 1 if tp == "auto" else int(tp),
                      f"{' and '.join(auto)} auto: 1 on CPU" if auto else "asked for")
    if spec.ray_address is not None:
        from lmbatch.engine.cluster import cluster_gpus
        gpus = GPUs(cluster_gpus(spec.ray_address), None)
    why = []
    if tp == "auto":
        t, why_tp = _tensor_parallel(cfg, spec.dtype or "bfloat16", gpus)
        why.append(why_tp)
    else:
        t = int(tp)
    share = _share(spec, cfg, gpus, t, cores) if dp == "auto" else 1
    if dp == "auto" and work is not None and work < SMALL_JOB_FLOPS and gpus.visible // t * share > 1:
        n = 1
        why.append(f"1 worker: a small job ({work / 1e12:.0f} TFLOP of model work)")
    elif dp == "auto":
        n = max(1, gpus.visible // t) * share
        shared = f", {share} a GPU: {spec.stages} stages" if share > 1 else ""
        why.append(f"{n} worker{'s' if n > 1 else ''}: {gpus.visible} GPU{'s' if gpus.visible != 1 else ''} visible"
                   + (f", {t} a model" if t > 1 else "") + shared)
    else:
        n = int(dp)
        if n * t > gpus.visible and t == 1 and gpus.visible and spec.ray_address is None:
            if n % gpus.visible:
                raise UserError(f"--data-parallel {dp}: {n} workers do not share {gpus.visible} GPUs evenly "
                                f"(use a multiple of {gpus.visible})")
            return Layout(n, t, f"asked for: {n} workers on {gpus.visible} GPU{'s' if gpus.visible > 1 else ''}, "
                                f"{n // gpus.visible} a GPU")
        if n * t > gpus.visible:
            what = f"--data-parallel {dp}" + (f" x --tensor-parallel {t}" if t > 1 else "")
            raise UserError(f"{what}: {n * t} GPUs needed, {gpus.visible} visible")
    return Layout(n, t, "; ".join(why) or "asked for")



def _share(spec: EngineSpec, cfg: ModelConfig, gpus: GPUs, t: int, cores: int | None) -> int:
    """Workers a GPU for auto, for a run that generates in HOST_BOUND_STAGES or more on local GPUs, each
    alone on a model of SMALL_MODEL_BYTES at most: as many as GENERATING_SHARE, SHARED_WORKERS in all,
    the cores (CORES_A_WORKER each) and the GPU's memory (FIT_SHARE of it for their weights) allow, where
    that is 2 or more; else 1."""
    size = weight_bytes(cfg, spec.dtype or "bfloat16")
    if not (spec.graphs_ahead and spec.stages >= HOST_BOUND_STAGES) or t > 1 or spec.ray_address is not None \
            or gpus.memory is None or size > SMALL_MODEL_BYTES or not gpus.visible:
        return 1
    if cores is None:
        from lmbatch.engine.threads import usable_cores
        cores = usable_cores()
    k = min(GENERATING_SHARE, SHARED_WORKERS // gpus.visible, cores // (CORES_A_WORKER * gpus.visible),
            int(FIT_SHARE * gpus.memory // size))
    return k if k >= 2 else 1


def _tensor_parallel(cfg: ModelConfig, dtype: str, gpus: GPUs) -> tuple[int, str]:
    """The fewest GPUs a model's weights fit (each its share of FIT_SHARE of a GPU), and why."""
    size = weight_bytes(cfg, dtype)
    gib = f"{size / 2**30:.1f} GiB of weights"
    if gpus.memory is None or size <= FIT_SHARE * gpus.memory:
        return 1, f"the model fits one GPU ({gib})" if gpus.memory else "one GPU a model"
    t = 2
    while t <= gpus.visible:
        kv_heads_split = cfg.num_kv_heads % t == 0 or cfg.keys_are_values   # latent attention's entry: on every rank
        if cfg.num_heads % t == 0 and kv_heads_split and size / t <= FIT_SHARE * gpus.memory:
            return t, f"{gib} split over {t} GPUs"
        t *= 2
    raise UserError(f"the model ({gib}) does not fit the {gpus.visible} visible GPUs of {gpus.memory / 2**30:.0f} GiB "
                    "(--tensor-parallel N splits it; --dtype, a smaller model)")


def resolved(spec: EngineSpec, cfg: ModelConfig, work: float | None = None) -> tuple[EngineSpec, str]:
    """`spec` with its data- and tensor-parallel sizes decided (and, for several GPUs, the device
    named), and why (`work`: as `layout`)."""
    gpus = visible_gpus()
    lay = layout(spec, cfg, gpus, work)
    device = spec.device
    if device == "auto" and lay.data_parallel * lay.tensor_parallel > 1 and gpus.visible:
        device = "cuda"
    local = device == "cuda" and spec.ray_address is None       # Ray's workers are placed on the cluster's GPUs
    share = lay.data_parallel // gpus.visible if local and lay.data_parallel > gpus.visible > 0 else 1
    return replace(spec, device=device, data_parallel=lay.data_parallel, tensor_parallel=lay.tensor_parallel,
                   gpu_share=share), lay.why
