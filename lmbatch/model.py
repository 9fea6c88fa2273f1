"""Decoder-only transformer (Llama / Qwen2 families) over the paged KV pool, read top to bottom."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lmbatch.attention import AttentionBackend, ForwardBatch
from lmbatch.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (the HF Llama convention). x: [T, H, D]; cos/sin: [T, D/2]."""
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.nh, self.nkv, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, (self.nh + 2 * self.nkv) * self.hd, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.nh * self.hd, cfg.hidden_size, bias=False)

    def forward(self, x, cos, sin, attn: AttentionBackend):
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.nh * self.hd, self.nkv * self.hd, self.nkv * self.hd], dim=-1)
        q = apply_rope(q.view(T, self.nh, self.hd), cos, sin)
        k = apply_rope(k.view(T, self.nkv, self.hd), cos, sin)
        o = attn.forward(self.layer, q, k, v.view(T, self.nkv, self.hd))
        return self.o_proj(o.reshape(T, self.nh * self.hd))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, attn):
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, attn)
        return h + self.mlp(self.post_attention_layernorm(h))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self._inv_freq: dict[torch.device, torch.Tensor] = {}  # not a buffer: .to(bf16) must not round it

    def forward(self, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        """Runs the batch's new tokens through the model; returns float32 logits at batch.logit_rows."""
        attn.plan(batch)
        pos = batch.positions
        if pos.device not in self._inv_freq:  # float32 frequencies as HF has them, products in float64
            self._inv_freq[pos.device] = self.cfg.inv_freq().float().double().to(pos.device)
        freqs = pos[:, None].double() * self._inv_freq[pos.device][None, :]
        cos, sin = freqs.cos().float(), freqs.sin().float()
        x = self.embed_tokens(batch.input_ids)
        for block in self.layers:
            x = block(x, cos, sin, attn)
        return self.logits(x[batch.logit_rows])

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        h = self.norm(hidden)
        w = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(h, w).float()
