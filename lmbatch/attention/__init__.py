"""Attention backends behind one interface (`base.AttentionBackend`), made by name from a registry."""
from lmbatch.attention.base import BACKENDS, AttentionBackend, ForwardBatch, default_backend, make_backend, to_device

__all__ = ["BACKENDS", "AttentionBackend", "ForwardBatch", "default_backend", "make_backend", "to_device"]
