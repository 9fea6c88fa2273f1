"""Attention backends behind one interface (`base.AttentionBackend`), made by name from a registry
(`registry.REGISTRY`); the KV pool they read and write (`kv_pool`)."""
