"""The attention backends by name: one entry each (a new backend is its module plus its entry here), with
what it can do as fields, which the choice of a run's backend (engine/build.py), the engine's checks and its
decode graphs (engine/model_runner.py) read instead of naming backends. Imports nothing heavy: the CLI checks
`--attention` against it before loading torch."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Entry:
    """A backend: its class (imported when first made: FlashInfer's import alone takes seconds) and what it
    computes: on CUDA only (`cuda`); float32 at float32's precision (`float32`: Triton's dots round float32
    inputs to tf32, FlashInfer has no float32 kernels); gpt-oss's attention sinks (`sinks`); DeepSeek's latent
    attention (`latent`); a batch-invariant path for --deterministic (`deterministic`); decode steps replayed
    as CUDA graphs (`graphs`: the graphs attend with the Triton decode kernels whatever the backend); and
    where the graphs read rows' shared radix-tree levels once a step (`levels`, kernels/cascade_attention.py:
    "large" in steps whose rows fill the GPU, "every" in every step)."""
    module: str
    cls: str
    cuda: bool
    float32: bool = False
    sinks: bool = False
    latent: bool = False
    deterministic: bool = False
    graphs: bool = True
    levels: Literal["never", "large", "every"] = "never"


REGISTRY: dict[str, Entry] = {
    "flashinfer": Entry("lmbatch.attention.gpu", "FlashInferBackend", cuda=True),
    "triton": Entry("lmbatch.attention.gpu", "TritonBackend", cuda=True, sinks=True, deterministic=True,
                    levels="large"),
    "cascade": Entry("lmbatch.attention.gpu", "TritonBackend", cuda=True, levels="every"),
    "torch": Entry("lmbatch.attention.torch_ref", "TorchBackend", cuda=False, float32=True, sinks=True, latent=True,
                   deterministic=True, graphs=False),
}
BACKENDS = tuple(REGISTRY)
REFERENCE = "torch"         # the reference: every device, dtype and model
DEFAULT_CUDA = "triton"     # what auto runs on CUDA unless FlashInfer's kernels for the model are built


def able(what: str) -> str:
    """The backends that have capability `what` (an Entry field), for an error line: "triton and torch"."""
    names = [n for n, e in REGISTRY.items() if getattr(e, what)]
    return " and ".join(names) if len(names) < 3 else ", ".join(names[:-1]) + " and " + names[-1]
