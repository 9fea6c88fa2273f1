"""The engine: executes a batch of score and generate requests over one model with a radix KV cache.

`Engine` is imported on first use: its module imports torch (seconds), and the run layer imports
this package's light parts (`options`, `build`) before it loads anything.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lmbatch.engine.options import EngineOptions

if TYPE_CHECKING:
    from lmbatch.engine.engine import Engine

__all__ = ["Engine", "EngineOptions"]


def __getattr__(name: str) -> Any:
    if name == "Engine":
        from lmbatch.engine.engine import Engine
        return Engine
    raise AttributeError(f"module 'lmbatch.engine' has no attribute {name!r}")
