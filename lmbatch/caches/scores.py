"""The scores of an `lmbatch lm-eval` loglikelihood call, kept so that a repeat of the same command on the
same model computes nothing: the same requests (the workload cache's key: their text, the backend's
tokenization options, the model folder's small files, lmbatch's source) scored by the same weights
(each file of the model folder by name and content hash, as a resumed run checks them:
model/identity.py, and a quantized checkpoint's format, model/quantization.py; the hash is kept under the
file's size, modification and change times, so weights rewritten in place are hashed again even with
their modification time put back) on the same numerics
(device and dtype, the engine's options, the GPU or CPU model and thread count, driver, torch, Triton,
FlashInfer, lmbatch's kernels). A whole call is one
entry: the engine's batching of a call decides a score's last bits, so only the same call's scores are
the same scores.

Hits are said (`LMBatch.report`, the closing line); `--model_args score_cache=false` computes again.
A run through Ray is never kept (its workers' machines are not this one).

    ~/.cache/lmbatch/scores/<key>.pkl    ($LMBATCH_CACHE, else $XDG_CACHE_HOME/lmbatch)
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
from functools import lru_cache
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from lmbatch.cache import cache_dir
from lmbatch.caches.workloads import Store, hash_source, read_entry, write_entry
from lmbatch.model.identity import model_identity
from lmbatch.model.quantization import declared

KEEP = 64       # entries kept (a few kB each); the least recently written go
SCORES = Store(KEEP, "score", "the scores of lm-eval calls")


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "-"


def _read(path: str) -> str:
    try:
        return Path(path).read_text(errors="replace")
    except OSError:
        return ""


@lru_cache(maxsize=1)
def _kernels_source() -> str:
    h = hashlib.sha256()
    hash_source(h, ("lmbatch.kernels",))    # kernels/ maps in: outside code_version's packages
    return h.hexdigest()


def machine(device: str) -> dict[str, Any]:
    """What of this machine decides the numerics on `device` (cpu or cuda), read without starting CUDA."""
    import torch

    if device == "cuda":
        gpus = sorted(_read(str(f)) for f in Path("/proc/driver/nvidia/gpus").glob("*/information"))
        return {"gpus": [ln for g in gpus for ln in g.splitlines() if ln.startswith("Model:")],
                "visible": os.environ.get("CUDA_VISIBLE_DEVICES"), "driver": _read("/proc/driver/nvidia/version"),
                "cuda": torch.version.cuda, "triton": _version("triton"), "flashinfer": _version("flashinfer-python")}
    cpu = next((ln for ln in _read("/proc/cpuinfo").splitlines() if ln.startswith("model name")), platform.processor())
    return {"cpu": cpu, "threads": torch.get_num_threads()}


def key(requests_key: str, model_dir: Path, device: str, dtype: str, engine: dict[str, Any]) -> str:
    """The entry's name: the requests' key (the workload cache's), the model's files and the numerics."""
    import torch

    what = {"requests": requests_key, "weights": model_identity(model_dir), "device": device, "dtype": dtype,
            "engine": engine, "machine": machine(device), "torch": torch.__version__, "kernels": _kernels_source()}
    if (quantization := declared(model_dir)) is not None:
        what["quantization"] = quantization
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:40]


def path_of(name: str) -> Path:
    return cache_dir() / "scores" / f"{name}.pkl"


def store(path: Path, scores: Sequence[tuple[float, bool]]) -> bool:
    """A call's (logprob, is_greedy) pairs, as the workload cache writes an entry."""
    logprobs = np.fromiter((lp for lp, _ in scores), np.float64, len(scores))
    greedy = np.fromiter((g for _, g in scores), np.bool_, len(scores))
    return write_entry(path, {"logprobs": logprobs, "greedy": greedy}, store=SCORES)


def load(path: Path, n: int) -> list[tuple[float, bool]] | None:
    """The `n` scores `store` wrote at `path`, or None (absent, not whole, or not `n` of them)."""
    d = read_entry(path, what="kept scores", again="computing them again")
    if not isinstance(d, dict) or not {"logprobs", "greedy"} <= d.keys() or len(d["logprobs"]) != n:
        return None
    return list(zip(d["logprobs"].tolist(), d["greedy"].tolist()))
