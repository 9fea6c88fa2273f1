"""The decode graphs' kernels compiled ahead, side by side, in processes of their own.

Where Triton's cache is new (a fresh machine, a new lmbatch or Triton), capturing the decode graphs compiles
each kernel variant the buckets use (split counts, one program a row, the cascade's ranges, the sampler) one
after another on the loader's thread: 4.4 s of a fresh H200's 6.2 s of capture (1.5B shape, tree of
thought), and more of them mid-run (a cascade bucket's plain graph, the sampler). `Precompile` starts a few
helpers with the load (of one engine, or of each data-parallel worker); each imports torch beside the
engine's own import, then, told the fitted spec, builds the model with one layer of each kind and a small
vocabulary (random weights) and runs the forward of its share of the graphs and the sampler once,
uncaptured, so that Triton compiles them into its cache on disk; the engine's capture then loads them.
Measured on a fresh H200 (tree of thought, 1.5B shape): graphs 8.3 -> 3.8 s, the model side 15.7 -> 9.5 s
with 8 helpers (BENCHMARKS.md). A helper starts its CUDA work only once the engine's sizes are fitted (the
KV pool is sized to the memory free then), takes about a GB of the GPU for a few seconds, and changes no
result: a kernel found in the cache is the one the engine would have compiled. Anything a helper fails at,
the engine compiles itself as before; helpers still at work when the engine's graphs are captured are
stopped. Once an engine has captured its graphs, a file in Triton's cache says so (`marker`), and a later
load of the same spec starts no helper: their starts cost a warm load more than they save.
"""
from __future__ import annotations

import os
import pickle
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from lmbatch.engine.options import EngineSpec
    from lmbatch.model.config import ModelConfig

HELPERS = 8             # at most: a helper for two of the machine's cores ($LMBATCH_PRECOMPILE: how many, 0 none)
SLOTS = 4096            # a helper's KV pool
CONTEXT_BYTES = 1 << 30     # a helper's CUDA context, libraries' workspaces and activations, about


def gpu_present() -> bool:
    """Whether an NVIDIA GPU may be visible, without importing torch (its driver's device node)."""
    return os.path.exists("/dev/nvidiactl") and os.environ.get("CUDA_VISIBLE_DEVICES", "x").strip() not in ("", "-1")


def wanted(spec: EngineSpec, graphs: bool) -> bool:
    """Whether a spec's engine, built in this process, may capture decode graphs on a GPU as it is built
    (`graphs`: the run asked for them then; a run that only scores never captures any, and starts no helper)."""
    return graphs and spec.device in ("auto", "cuda") and spec.options.cuda_graphs and gpu_present() and helpers() > 0


def helpers(engines: int = 1) -> int:
    """How many helpers an engine starts, one of `engines` on this machine: $LMBATCH_PRECOMPILE, else one
    for two of the engines' share of the cores, HELPERS at most."""
    n = os.environ.get("LMBATCH_PRECOMPILE", "")
    return int(n) if n.isdigit() else min(HELPERS, (os.cpu_count() or 1) // 2 // max(1, engines))


def marker(spec: EngineSpec) -> Path | None:
    """A file in Triton's cache (`TRITON_CACHE_DIR`, else `$TRITON_HOME` or home's `.triton/cache`, as Triton
    picks it) whose presence says that an engine of `spec` (as the run gave it, before fitting), of this
    model's config and of these torch, Triton and lmbatch versions captured its decode graphs with that
    cache: their kernels are there, and no helper is worth its start. None where that cannot be told."""
    import hashlib
    from importlib import metadata

    import lmbatch

    try:
        config = (Path(spec.model_dir) / "config.json").read_bytes()
        versions = [metadata.version(name) for name in ("torch", "triton")]
    except (OSError, metadata.PackageNotFoundError):
        return None
    base = os.environ.get("TRITON_CACHE_DIR") or os.path.join(
        os.environ.get("TRITON_HOME") or os.path.expanduser("~"), ".triton", "cache")
    key = hashlib.sha256(repr((replace(spec, model_dir=""), versions, lmbatch.__version__)).encode() + config)
    return Path(base) / "lmbatch-graphs" / key.hexdigest()[:32]


class Precompile:
    """Helpers started now (importing torch, then waiting for `go`), none where Triton's cache holds the
    graphs' kernels of an engine of `spec` already (`marker`); `close` stops those still at work, `captured`
    marks the cache once the engine's graphs are captured."""

    def __init__(self, spec: EngineSpec, count: int | None = None):
        self.marker = marker(spec)
        n = 0 if self.marker is not None and self.marker.exists() else count if count is not None else helpers()
        self.procs: list[subprocess.Popen[bytes]] = []
        self.sent = False
        try:
            for _ in range(n):
                self.procs.append(subprocess.Popen([sys.executable, "-m", "lmbatch.engine.precompile"],
                                                   stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                                   stderr=subprocess.DEVNULL))
        except OSError:     # no process to be had (limits): the engine compiles alone
            pass

    def go(self, spec: EngineSpec, cfg: ModelConfig) -> None:
        """The fitted spec to every helper the GPU has room for, each its share of the graphs (once; none
        without graphs on a GPU). The engine's CUDA context is started; its weights and pool are not.
        Nothing here fails the engine's load: on any error the helpers end and the engine compiles alone."""
        if self.sent:
            return
        self.sent = True
        try:
            room = _room(spec, cfg)
        except Exception:  # noqa: BLE001  helpers are never worth a failed load
            room = 0
        for p in self.procs[room:]:
            p.kill()        # reaped by `close` (one still reading its imports from disk ends only after that read)
        for k, p in enumerate(self.procs[:room]):
            try:
                assert p.stdin is not None
                p.stdin.write(pickle.dumps((spec, cfg, k, room)))
                p.stdin.close()
            except OSError:     # a helper that died: the engine compiles its share
                pass
        if not room:
            self.close()

    def captured(self) -> None:
        """The engine captured its graphs: their kernels are in Triton's cache for the next load of the spec."""
        if self.marker is not None:
            try:
                self.marker.parent.mkdir(parents=True, exist_ok=True)
                self.marker.touch()
            except OSError:     # a cache we cannot write: helpers again next time
                pass

    def close(self) -> None:
        """Stop the helpers still running (their work is done or no longer wanted)."""
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            if p.stdin is not None and not p.stdin.closed:
                try:
                    p.stdin.close()
                except OSError:
                    pass
            p.wait()
        self.procs = []


def _room(spec: EngineSpec, cfg: ModelConfig) -> int:
    """Helpers worth telling of a fitted spec: none without decode graphs on a GPU (the CPU, the torch
    backend, FP8 GEMMs, a split model, the transformers fallback), else as many as the GPU's free memory
    affords."""
    from lmbatch.attention.registry import REGISTRY

    o = spec.options
    graphs = o.cuda_graphs and o.attention in REGISTRY and REGISTRY[o.attention].graphs
    if spec.device != "cuda" or not graphs or o.fp8_gemm or spec.ranks > 1 or cfg.runtime != "native":
        return 0
    import torch

    assert spec.dtype is not None, "a fitted spec"
    return affordable(cfg, getattr(torch, spec.dtype), torch.cuda.mem_get_info()[0])


def affordable(cfg: ModelConfig, dtype: torch.dtype, free: int) -> int:
    """Helpers the GPU's `free` bytes leave room for beside the engine: together a twentieth of them at
    most, and a quarter of what the engine's weights and KV pool (half of `free`, engine/build.py) leave."""
    size = dtype.itemsize
    left = free // 2 - weight_count(cfg) * size
    return max(0, min(free // 20, left // 4) // (weight_count(helper_config(cfg)) * size + CONTEXT_BYTES))


def weight_count(cfg: ModelConfig) -> int:
    """About how many weights the model has (its projections and embeddings; norms and biases left out),
    from the config alone: an estimate for `affordable`, not imported modules built on the meta device
    (3 s on the loader's thread beside a tokenizing main thread, H200 host)."""
    h = cfg.hidden_size
    attention = h * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim + cfg.num_heads * cfg.head_dim * h
    dense = 3 * h * cfg.intermediate_size
    routed = 3 * h * (cfg.moe_intermediate_size * cfg.num_experts + cfg.shared_experts_size) + h * cfg.num_experts
    layers = sum(attention + (routed if sparse else dense)
                 for sparse in (cfg.sparse_layers or (cfg.num_experts > 0,) * cfg.num_layers))
    return layers + cfg.vocab_size * h * (1 if cfg.tie_word_embeddings else 2)


def helper_config(cfg: ModelConfig) -> ModelConfig:
    """The model a helper builds: `few_layers`, and a small vocabulary (no Triton kernel of a decode graph
    reads the vocabulary; the sampler's is warmed on logits of the real width)."""
    return replace(few_layers(cfg), vocab_size=min(cfg.vocab_size, 256 + cfg.vocab_size % 16))


def few_layers(cfg: ModelConfig) -> ModelConfig:
    """`cfg` with only its first layer of each kind (window, RoPE or not, routed experts or dense)."""
    n = cfg.num_layers

    def kind(i: int) -> tuple[object, ...]:
        return tuple(t[i] if t else None for t in (cfg.layer_windows, cfg.nope_layers, cfg.sparse_layers))

    keep = [i for i in range(n) if kind(i) not in {kind(j) for j in range(i)}]

    def pick(t: tuple) -> tuple:
        return tuple(t[i] for i in keep) if t else t

    return replace(cfg, num_layers=len(keep), layer_windows=pick(cfg.layer_windows),
                   nope_layers=pick(cfg.nope_layers), sparse_layers=pick(cfg.sparse_layers), mtp_layers=0)


def warm(spec: EngineSpec, cfg: ModelConfig, share: int, of: int) -> None:
    """Helper `share` of `of` for a fitted spec and its model's config (a model lmbatch's network runs): its
    share of the graphs' forwards and, the first helper, the sampler."""
    import torch

    from lmbatch.engine.model_runner import ModelRunner
    from lmbatch.engine.sampling import sample_on_device
    from lmbatch.model.network import Transformer
    from lmbatch.model.weights import init_dummy
    from lmbatch.requests import SamplingParams

    assert spec.dtype is not None, "a fitted spec"
    model = Transformer.empty(helper_config(cfg), "cuda", getattr(torch, spec.dtype))
    init_dummy(model)
    options = replace(spec.options, kv_cache_tokens=SLOTS, max_tokens_per_batch=SLOTS)
    with torch.inference_mode():
        graphs = ModelRunner(model.eval(), options).graphs
        if graphs is None:
            return
        for b, cascade in graphs.variants()[share::of]:
            graphs.warm(b, cascade)
        if share == 0:      # the sampler's per-row arrays are 16-byte aligned or not by the rows' parity
            for n in (2, 3):
                logits = torch.zeros(n, cfg.vocab_size, dtype=torch.float32, device="cuda")
                sample_on_device(logits, [SamplingParams(temperature=1.0)] * n, [0] * n)
        torch.cuda.synchronize()


def main() -> None:
    """A helper: import torch, wait for the spec (end of input: the engine needs none), warm up."""
    import torch  # noqa: F401  the slow part, done while the engine fits its spec

    import lmbatch.engine.model_runner  # noqa: F401
    data = sys.stdin.buffer.read()
    if data:
        warm(*pickle.loads(data))


if __name__ == "__main__":
    main()
