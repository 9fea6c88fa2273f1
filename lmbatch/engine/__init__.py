"""The engine: executes a batch of score and generate requests over one model with a radix KV cache."""
from lmbatch.engine.engine import Engine, EngineOptions

__all__ = ["Engine", "EngineOptions"]
