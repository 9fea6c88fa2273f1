"""Causal LMs that network.py does not implement, run by transformers behind our forward contract.

`HFCausalLM.forward` takes the same ragged `ForwardBatch` as `Transformer.forward` and returns the
same float32 logits at `batch.logit_rows`, so the whole engine (plan order, radix cache, prefill,
decode, sampler, grammars, jump-forward) runs on it unchanged. It is slower than the native path
(one transformers call per sequence of the batch, no CUDA graphs) but computes what transformers
computes, with prefixes reused exactly:

- each sequence's cached prefix is gathered from the paged KV pool into a transformers
  `DynamicCache` (the keys as transformers caches them: after RoPE, partial or not);
- the model runs the sequence's new tokens over that cache, and each layer's `update` call also
  writes the new keys and values into the pool at the sequence's slots, for later sequences (of
  this batch too: sequences run in batch order) and decode steps to read.

A model whose cached keys do not have the pool's (kv_heads, head_dim) per token (e.g. MLA), or whose
layers do not all pass through the cache (recurrent or state-space layers, shared KV), is refused
with a `UserError` rather than run wrong.
"""
from __future__ import annotations

import functools
import inspect
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lmbatch.attention.base import AttentionBackend, ForwardBatch
from lmbatch.attention.kv_pool import KVPool
from lmbatch.errors import UserError, first_line
from lmbatch.model.config import ModelConfig


class _PoolWriter:
    """Where a sequence's new keys and values go during the model's forward: the pool's slots of
    its new tokens, one `update` per layer, each checked against the pool's shape."""

    def __init__(self, pool: KVPool, slots: torch.Tensor, cfg: ModelConfig):
        self.pool, self.slots, self.cfg = pool, slots, cfg
        self.layers: set[int] = set()

    def __call__(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        cfg, n = self.cfg, len(self.slots)
        want = (1, cfg.num_kv_heads, n, cfg.head_dim)
        if tuple(k.shape) != want or tuple(v.shape) != want:
            raise UserError(f"{cfg.model_type}: transformers caches keys {tuple(k.shape)} and values {tuple(v.shape)} "
                            f"at layer {layer} where lmbatch's KV pool holds {want} (batch, kv heads, tokens, "
                            "head dim): this attention layout cannot run through the transformers fallback")
        if layer in self.layers or not 0 <= layer < cfg.num_layers:
            raise UserError(f"{cfg.model_type}: layer {layer} writes to the KV cache out of turn (of "
                            f"{cfg.num_layers} layers): the transformers fallback cannot reuse its prefixes")
        self.layers.add(layer)
        self.pool.k[layer, self.slots] = k[0].transpose(0, 1)
        self.pool.v[layer, self.slots] = v[0].transpose(0, 1)

    def check_complete(self) -> None:
        if len(self.layers) != self.cfg.num_layers:
            raise UserError(f"{self.cfg.model_type}: only {len(self.layers)} of its {self.cfg.num_layers} layers keep "
                            "keys and values in transformers' KV cache (recurrent or shared-KV layers?): "
                            "the transformers fallback cannot reuse its prefixes exactly, so it does not run it")


@functools.cache
def _pool_cache_class() -> type:
    """transformers' `DynamicCache`, whose `update` calls also hand the new keys and values to a
    `_PoolWriter` (defined on first use: importing transformers takes seconds)."""
    from transformers import DynamicCache

    class PoolCache(DynamicCache):
        writer: _PoolWriter | None = None

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
                   **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            if self.writer is not None:
                self.writer(layer_idx, key_states, value_states)
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    return PoolCache


def _dtype_argument() -> str:
    """transformers 4.56 renamed from_pretrained's `torch_dtype` to `dtype`."""
    import transformers

    major, minor = (int(x) for x in re.findall(r"\d+", transformers.__version__)[:2])
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"


def _instantiate(path: Path, dtype: torch.dtype, random_weights: bool) -> Any:
    """The transformers model, loaded without transformers' progress bar (the run has its own)."""
    from transformers.utils import logging as hf_logging

    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        return _auto_model(path, dtype, random_weights)
    finally:
        if bar:
            hf_logging.enable_progress_bar()


def _auto_model(path: Path, dtype: torch.dtype, random_weights: bool) -> Any:
    """With SDPA attention where the model class has it, else its default."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kw: dict[str, Any] = {_dtype_argument(): dtype}
    if random_weights:
        torch.manual_seed(0)
        hf_cfg = AutoConfig.from_pretrained(str(path))
    try:
        if random_weights:
            return AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="sdpa", **kw)
        return AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="sdpa", **kw)
    except ValueError as e:
        if "scaled_dot_product_attention" not in str(e) and "sdpa" not in str(e).lower():
            raise
    if random_weights:
        return AutoModelForCausalLM.from_config(hf_cfg, **kw)
    return AutoModelForCausalLM.from_pretrained(str(path), **kw)


@torch.inference_mode()
def _check_causal(hf: Any, path: Path) -> None:
    """Refuse a model whose first position's logits change with the tokens after it: an encoder
    under a causal LM head (e.g. BERT's without is_decoder) attends both ways."""
    param = next(hf.parameters())
    ids = torch.tensor([[1, 2, 2, 2], [1, 0, 0, 0]], device=param.device) % hf.config.vocab_size
    first = hf(input_ids=ids, use_cache=False).logits[:, 0].float()
    # a causal model computes both rows' first position alike: equal up to rounding of its dtype
    if (first[0] - first[1]).abs().max() > 4 * torch.finfo(param.dtype).eps * first.abs().max():
        raise UserError(f"model at {path} ({hf.config.model_type}) is not causal: its first position's logits depend "
                        "on the tokens after it (an encoder?); lmbatch runs decoder-only LMs")


class HFCausalLM(nn.Module):
    """A transformers causal LM with `Transformer.forward`'s contract (see the module's docstring)."""

    def __init__(self, hf: nn.Module, cfg: ModelConfig):
        super().__init__()
        self.hf, self.cfg = hf, cfg
        # logits only at the wanted rows where the model takes `logits_to_keep` (transformers >= 4.50)
        self.keeps_logits = "logits_to_keep" in inspect.signature(hf.forward).parameters

    @classmethod
    def load(cls, path: str | Path, device: torch.device | str, dtype: torch.dtype,
             random_weights: bool = False) -> HFCausalLM:
        """`AutoModelForCausalLM` of the folder, in `dtype` on `device`; `random_weights`: its
        architecture with transformers' initialization instead (load_format="dummy")."""
        path = Path(path)
        try:
            hf = _instantiate(path, dtype, random_weights)
        except Exception as e:  # noqa: BLE001  any failure to load is the user's model's
            raise UserError(f"transformers cannot load the model at {path} as a causal LM: {first_line(e)}") from None
        hf_cfg = hf.config
        if getattr(hf_cfg, "is_encoder_decoder", False):
            raise UserError(f"model at {path} is an encoder-decoder ({hf_cfg.model_type}): "
                            "lmbatch runs decoder-only LMs")
        try:
            cfg = ModelConfig.for_fallback(hf_cfg)
        except AttributeError as e:
            raise UserError(f"model at {path} ({hf_cfg.model_type}) has no attention shape lmbatch's KV cache can "
                            f"hold ({e})") from None
        hf = hf.to(device).eval()
        _check_causal(hf, path)
        return cls(hf, cfg)

    def forward(self, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        """Runs the batch's new tokens, sequence by sequence in batch order, storing their KV in the
        pool; returns float32 logits at batch.logit_rows."""
        attn.plan(batch)
        rows = batch.logit_rows.tolist()
        wanted: dict[int, list[tuple[int, int]]] = {}     # sequence -> (output row, row in the sequence)
        seq = 0
        for k, row in sorted(enumerate(rows), key=lambda kr: kr[1]):
            while batch.qo_indptr[seq + 1] <= row:
                seq += 1
            wanted.setdefault(seq, []).append((k, row - batch.qo_indptr[seq]))
        out: torch.Tensor | None = None
        for i in range(len(batch.qo_indptr) - 1):
            keep = wanted.get(i, [])
            logits = self._run_sequence(batch, attn.pool, i, [r for _, r in keep])
            if keep:
                if out is None:
                    out = logits.new_empty(len(rows), logits.shape[-1])
                out[[k for k, _ in keep]] = logits
        return out if out is not None else torch.empty(0, self.cfg.vocab_size, device=batch.input_ids.device)

    def _run_sequence(self, batch: ForwardBatch, pool: KVPool, i: int, keep: list[int]) -> torch.Tensor:
        """Sequence i's new tokens over its cached prefix; float32 logits at its rows `keep`."""
        q0, q1 = batch.qo_indptr[i], batch.qo_indptr[i + 1]
        slots = batch.kv_indices[batch.kv_indptr[i]:batch.kv_indptr[i + 1]]
        past = slots[:len(slots) - (q1 - q0)]
        cache = _pool_cache_class()()
        if len(past):           # [layers, kv heads, past, head dim], as transformers caches it
            keys, values = pool.k[:, past].transpose(1, 2), pool.v[:, past].transpose(1, 2)
            for layer in range(self.cfg.num_layers):
                cache.update(keys[layer][None], values[layer][None], layer)
        cache.writer = writer = _PoolWriter(pool, batch.out_slots[q0:q1], self.cfg)
        ids = batch.input_ids[q0:q1][None]
        index = torch.tensor(keep, dtype=torch.int64, device=ids.device)
        kw = {"logits_to_keep": index} if self.keeps_logits else {}
        logits = self.hf(input_ids=ids, position_ids=batch.positions[q0:q1][None], past_key_values=cache,
                         use_cache=True, **kw).logits[0]
        writer.check_complete()
        return (logits if self.keeps_logits else logits[index]).float()
