"""The attention backends by name: one entry each (a new backend is its module plus its entry here).
Imports nothing heavy: the CLI checks `--attention` against it before loading torch."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Entry:
    """A backend: its class (imported when first made: FlashInfer's import alone takes seconds), whether it
    runs on CUDA only, and whether the decode graphs read rows' shared radix-tree levels once a step
    (`cascade`, kernels/cascade_attention.py) instead of each row's keys on their own."""
    module: str
    cls: str
    cuda: bool
    cascade: bool = False


REGISTRY: dict[str, Entry] = {
    "flashinfer": Entry("lmbatch.attention.gpu", "FlashInferBackend", cuda=True),
    "triton": Entry("lmbatch.attention.gpu", "TritonBackend", cuda=True),
    "cascade": Entry("lmbatch.attention.gpu", "TritonBackend", cuda=True, cascade=True),
    "torch": Entry("lmbatch.attention.torch_ref", "TorchBackend", cuda=False),
}
BACKENDS = tuple(REGISTRY)
