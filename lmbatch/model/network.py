"""Decoder-only transformer over the paged KV pool, read top to bottom: Llama and the families whose
deltas `ModelConfig` names (model/architectures.py): q/k norms, norms after attention and MLP, sliding
windows, routed experts.

The residual stream is passed beside the hidden state (h, residual): the stream is their sum, and on
CUDA the add fuses into the next RMSNorm; the small ops run as fused Triton kernels there
(lmbatch.kernels.fused) and as plain PyTorch elsewhere, rounding at the same points.

Sliding-window layers attend to the last `window` positions only, but the KV pool keeps every
position's K and V and the radix cache shares them as for any layer: a position's K and V depend
only on the tokens up to it, so a reused prefix holds exactly what recomputing it would, and the
window is applied at attention time, by position.
"""
from __future__ import annotations

from typing import cast

import torch
from torch import nn

from lmbatch.attention.base import AttentionBackend, ForwardBatch
from lmbatch.model.config import ModelConfig
from lmbatch.model.layers import (
    Linear,
    RMSNorm,
    act_mul,
    apply_rope,
    clamped_swiglu,
    fixed_linear,
    fused_kernels,
    maybe_fixed_linear,
    rope_part,
    row_parallel,
    tp_reduce,
    use_fused,
)
from lmbatch.model.routing import SigmoidRouter, softmax_top_k
from lmbatch.model.tensor_parallel import TensorParallel


def _split_proj_norms(q_norm: RMSNorm, k_norm: RMSNorm, q: torch.Tensor, k: torch.Tensor,
                      tp: TensorParallel) -> tuple[torch.Tensor, torch.Tensor]:
    """OLMo's RMSNorms over the whole q and k projections when their heads are split over ranks: each
    rank's sums of squares, summed over the ranks (one all-reduce for both), normalize its slice."""
    squares = torch.stack([q.float().pow(2).sum(-1), k.float().pow(2).sum(-1)])
    tp.all_reduce(squares)
    out = []
    for x, norm, ss in ((q, q_norm, squares[0]), (k, k_norm, squares[1])):
        xf = x.float() * torch.rsqrt(ss[:, None] / (x.shape[-1] * tp.size) + norm.eps)
        out.append(norm.weight * xf.to(x.dtype))
    return out[0], out[1]


class Attention(nn.Module):
    """Heads and KV heads: this rank's, under tensor parallelism (cfg is then one rank's shape)."""

    def __init__(self, cfg: ModelConfig, layer: int, tp: TensorParallel | None = None):
        super().__init__()
        self.layer, self.tp = layer, tp
        self.nh, self.nkv, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.window = cfg.layer_windows[layer] if cfg.layer_windows else None
        self.rope = not (cfg.nope_layers and cfg.nope_layers[layer])      # SmolLM3's NoPE layers: none
        self.rotary = cfg.rotary_dim or self.hd                             # GLM-4.5: the first half of a head
        self.qkv_proj = Linear(cfg.hidden_size, (self.nh + 2 * self.nkv) * self.hd, bias=cfg.qkv_bias)
        self.o_proj = Linear(self.nh * self.hd, cfg.hidden_size, bias=cfg.o_bias)
        self.sinks = nn.Parameter(torch.empty(self.nh)) if cfg.attn_sinks else None     # gpt-oss's, this rank's heads
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:      # over each head (qwen3, gemma3) or over the whole projection (olmo2)
            per_head = cfg.qk_norm == "head"
            self.q_norm = RMSNorm(self.hd if per_head else self.nh * self.hd, cfg.rms_norm_eps, cfg.norm_offset)
            self.k_norm = RMSNorm(self.hd if per_head else self.nkv * self.hd, cfg.rms_norm_eps, cfg.norm_offset)

    def forward(self, x: torch.Tensor, rope: dict, attn: AttentionBackend) -> torch.Tensor:
        """rope: (cos, sin) of the batch's positions for "global" and, where they differ, "local"
        (sliding-window) layers."""
        T = x.shape[0]
        cos, sin = rope["local"] if self.window is not None and "local" in rope else rope["global"]
        q, k, v = self.qkv_proj(x).split([self.nh * self.hd, self.nkv * self.hd, self.nkv * self.hd], dim=-1)
        if self.qk_norm == "proj" and self.tp is not None:
            q, k = _split_proj_norms(self.q_norm, self.k_norm, q, k, self.tp)
        elif self.qk_norm == "proj":
            q, k = self.q_norm(q.contiguous()), self.k_norm(k.contiguous())
        elif self.qk_norm == "head":
            q = self.q_norm(q.reshape(T * self.nh, self.hd))
            k = self.k_norm(k.reshape(T * self.nkv, self.hd))
        q, k, v = q.view(T, self.nh, self.hd), k.view(T, self.nkv, self.hd), v.view(T, self.nkv, self.hd)
        sinks = {} if self.sinks is None else {"sinks": self.sinks}
        if self.rope and self.rotary == self.hd and use_fused(x) is not None:
            attn.rope_store(self.layer, q, k, v, (cos, sin))    # one kernel: attention reads k, v from the pool
            o = attn.forward(self.layer, q, None, None, window=self.window, **sinks)
        else:
            if self.rotary < self.hd and self.rope:
                q, k = rope_part(q, cos, sin, self.rotary), rope_part(k, cos, sin, self.rotary)
            elif self.rope:
                q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            o = attn.forward(self.layer, q, k, v, window=self.window, **sinks)
        return row_parallel(self.o_proj, o.reshape(T, self.nh * self.hd), self.tp)


def _per_head(x: torch.Tensor, w: torch.Tensor, fixed: bool) -> torch.Tensor:
    """Each head's own projection: x [T, heads, a] by w [heads, b, a] -> [T, heads, b] (deterministic mode:
    one fixed_linear per head, each row's result independent of the batch)."""
    if not fixed:
        return torch.einsum("tha,hba->thb", x, w)
    return torch.stack([fixed_linear(x[:, h], w[h]) for h in range(w.shape[0])], dim=1)


class LatentAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-V2/V3), absorbed. A token's keys and values are a function of
    its latent: c (kv_lora_rank, normalized) and one rotated key part k_pe (rotary_dim) shared by every
    head. The KV pool holds (c | k_pe) once per token and layer, as one KV head whose keys are its values
    (config._latent_fields); each head attends over it with its query absorbed: q_nope through the key
    half of kv_b_proj (W_UK) into the latent space, beside its rotated q_pe, so q.k = q_nope.(W_UK c) +
    q_pe.k_pe; the output's latent part goes through the value half (W_UV). One MQA over (kv_lora_rank +
    rotary_dim) wide entries, prefill and decode alike: what FlashMLA-style GPU kernels read. Under tensor
    parallelism the heads split (q_b_proj, kv_b_proj, o_proj) and every rank keeps the whole latent."""

    def __init__(self, cfg: ModelConfig, layer: int, tp: TensorParallel | None = None):
        super().__init__()
        self.layer, self.tp = layer, tp
        self.nh, self.rank, self.rope, self.nope, self.v_dim = (cfg.num_heads, cfg.kv_lora_rank, cfg.rotary_dim,
                                                                cfg.qk_nope_head_dim, cfg.v_head_dim)
        self.interleaved = cfg.rope_interleaved
        H, qk = cfg.hidden_size, cfg.qk_nope_head_dim + cfg.rotary_dim
        self.q_a_proj = Linear(H, cfg.q_lora_rank, bias=cfg.qkv_bias) if cfg.q_lora_rank else None
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, 1e-6) if cfg.q_lora_rank else None   # transformers' eps
        self.q_b_proj = Linear(cfg.q_lora_rank, self.nh * qk, bias=False) if cfg.q_lora_rank else None
        self.q_proj = None if cfg.q_lora_rank else Linear(H, self.nh * qk, bias=False)
        self.kv_a_proj_with_mqa = Linear(H, self.rank + self.rope, bias=cfg.qkv_bias)
        self.kv_a_layernorm = RMSNorm(self.rank, 1e-6)
        self.kv_b_proj = Linear(self.rank, self.nh * (self.nope + self.v_dim), bias=False)
        self.o_proj = Linear(self.nh * self.v_dim, H, bias=cfg.o_bias)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE of [T, heads, rotary_dim]; DeepSeek's pairs (x0, x1), (x2, x3), ... first laid out as halves
        (evens | odds), as transformers' interleaved RoPE leaves them."""
        if self.interleaved:
            x = torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
        return apply_rope(x, cos, sin)

    def forward(self, x: torch.Tensor, rope: dict, attn: AttentionBackend) -> torch.Tensor:
        T = x.shape[0]
        cos, sin = rope["global"]
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            q = cast(Linear, self.q_b_proj)(cast(RMSNorm, self.q_a_layernorm)(cast(Linear, self.q_a_proj)(x)))
        q_nope, q_pe = q.view(T, self.nh, self.nope + self.rope).split([self.nope, self.rope], dim=-1)
        c, k_pe = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope], dim=-1)
        c = self.kv_a_layernorm(c.contiguous())
        entry = torch.cat([c.view(T, 1, self.rank), self._rotate(k_pe.reshape(T, 1, self.rope), cos, sin)], dim=-1)
        w = self.kv_b_proj.weight.view(self.nh, self.nope + self.v_dim, self.rank)
        fixed = self.kv_b_proj.fixed
        q = torch.cat([_per_head(q_nope, w[:, :self.nope].transpose(1, 2), fixed), self._rotate(q_pe, cos, sin)],
                      dim=-1)
        o = attn.forward(self.layer, q, entry, entry)       # [T, heads, kv_lora_rank + rotary_dim]
        o = _per_head(o[..., :self.rank], w[:, self.nope:], fixed)
        return row_parallel(self.o_proj, o.reshape(T, self.nh * self.v_dim), self.tp)


class MLP(nn.Module):
    """SwiGLU (or GeGLU) of `width` (default: the config's intermediate size); with `tp`, this rank's slice,
    summed over the ranks."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel | None = None, width: int = 0):
        super().__init__()
        self.activation, self.tp = cfg.activation, tp
        width = width or cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * width, bias=False)
        self.down_proj = Linear(width, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tp_reduce(self.down_proj(act_mul(self.gate_up_proj(x), self.activation)), self.tp)


class MoE(nn.Module):
    """Routed experts: the router picks each token's top-k experts (a softmax's top k, renormalized where
    the config says so; or DeepSeek's grouped sigmoid, `SigmoidRouter`), whose SwiGLU MLPs' outputs are
    summed with the routing weights; shared experts (DeepSeek, GLM) are a dense MLP added to them. On
    CUDA the experts run as two grouped GEMMs over the tokens sorted by expert (lmbatch.kernels.moe: no
    host synchronization, so decode steps can be CUDA graphs); elsewhere each expert runs once, on the
    tokens routed to it. Under tensor parallelism every part is this rank's slice, summed once."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel | None = None):
        super().__init__()
        self.tp = tp
        self.top_k, self.renorm = cfg.experts_per_token, cfg.norm_topk_prob
        self.weights_in_model_dtype = cfg.router_weights_in_model_dtype
        E, H, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate: nn.Module = SigmoidRouter(cfg) if cfg.router == "sigmoid" else Linear(H, E, bias=cfg.expert_bias)
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * i, H))
        self.down_proj = nn.Parameter(torch.empty(E, H, i))
        # gpt-oss: each expert's biases and its clamped SwiGLU
        self.gate_up_proj_bias = nn.Parameter(torch.empty(E, 2 * i)) if cfg.expert_bias else None
        self.down_proj_bias = nn.Parameter(torch.empty(E, H)) if cfg.expert_bias else None
        self.swiglu = (cfg.swiglu_alpha, cfg.swiglu_limit) if cfg.swiglu_limit else None
        # summed with the routed experts' partial outputs before the one reduction (hence no tp of its own)
        self.shared_experts = MLP(cfg, None, cfg.shared_experts_size) if cfg.shared_experts_size else None
        self.fixed = False          # deterministic mode: each expert's GEMMs as fixed_linear (CPU path)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(self.gate, SigmoidRouter):
            weights, experts = self.gate(x)
        else:
            weights, experts = softmax_top_k(self.gate(x), self.top_k, self.renorm)
        return (weights.to(x.dtype) if self.weights_in_model_dtype else weights), experts

    def _act(self, gate_up: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """The activation of rows of the experts' first GEMM ([S, 2I]), each row of the expert in `experts`
        ([S]): SwiGLU, or gpt-oss's clamped SwiGLU after the expert's gate/up bias."""
        if self.swiglu is None:
            return act_mul(gate_up)
        if self.gate_up_proj_bias is not None:
            gate_up = gate_up + self.gate_up_proj_bias[experts]
        return clamped_swiglu(gate_up, *self.swiglu)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(x)
        if x.is_cuda and (kern := fused_kernels("moe")) is not None:
            slot_experts = experts.reshape(-1)        # the kernel's rows: token * k + j
            out = kern.fused_moe(x, self.gate_up_proj, self.down_proj, weights, experts,
                                 lambda h: self._act(h, slot_experts))
        else:
            out = torch.zeros_like(x)
            for e in experts.unique().tolist():
                token, slot = torch.where(experts == e)
                h = self._act(maybe_fixed_linear(x[token], self.gate_up_proj[e], self.fixed), experts[token, slot])
                h = maybe_fixed_linear(h, self.down_proj[e], self.fixed)
                out.index_add_(0, token, (h * weights[token, slot, None]).to(x.dtype))
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        out = tp_reduce(out, self.tp)
        if self.down_proj_bias is not None:     # sum_j w_j * bias of expert j, once, after the ranks' sum
            out = out + (weights[..., None] * self.down_proj_bias[experts]).sum(dim=1).to(x.dtype)
        return out


def _first_norm(norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A block's input norm and the stream after it: the first block's input is the stream itself; a
    later one adds the last block's output to the residual in the norm's kernel."""
    if residual is None:
        return norm(x), x
    return norm(x, residual)


class Block(nn.Module):
    """Norm, attention, add; norm, MLP, add (pre-norm, as Llama). The stream is residual + x."""

    def __init__(self, cfg: ModelConfig, layer: int, tp: TensorParallel | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn: nn.Module = LatentAttention(cfg, layer, tp) if cfg.kv_lora_rank else Attention(cfg, layer, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MoE(cfg, tp) if cfg.sparse_layers and cfg.sparse_layers[layer] else MLP(cfg, tp)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None,
                rope: dict[str, tuple[torch.Tensor, torch.Tensor]],
                attn: AttentionBackend) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = _first_norm(self.input_layernorm, x, residual)
        h = self.self_attn(h, rope, attn)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class SandwichBlock(nn.Module):
    """Gemma: norm, attention, norm, add; norm, MLP, norm, add. The stream is residual + x."""

    def __init__(self, cfg: ModelConfig, layer: int, tp: TensorParallel | None = None):
        super().__init__()
        dim, eps, offset = cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset
        self.input_layernorm = RMSNorm(dim, eps, offset)
        self.self_attn = Attention(cfg, layer, tp)
        self.post_attention_layernorm = RMSNorm(dim, eps, offset)
        self.pre_feedforward_layernorm = RMSNorm(dim, eps, offset)
        self.mlp = MLP(cfg, tp)
        self.post_feedforward_layernorm = RMSNorm(dim, eps, offset)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None,
                rope: dict[str, tuple[torch.Tensor, torch.Tensor]],
                attn: AttentionBackend) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = _first_norm(self.input_layernorm, x, residual)
        h = self.post_attention_layernorm(self.self_attn(h, rope, attn))
        h, residual = self.pre_feedforward_layernorm(h, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class PostNormBlock(nn.Module):
    """Attention, norm, add; MLP, norm, add (OLMo 2: the norms act on each branch's output)."""

    def __init__(self, cfg: ModelConfig, layer: int, tp: TensorParallel | None = None):
        super().__init__()
        self.self_attn = Attention(cfg, layer, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, tp)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None,
                rope: dict[str, tuple[torch.Tensor, torch.Tensor]],
                attn: AttentionBackend) -> tuple[torch.Tensor, torch.Tensor]:
        stream = x if residual is None else residual + x
        stream = stream + self.post_attention_layernorm(self.self_attn(stream, rope, attn))
        return self.post_feedforward_layernorm(self.mlp(stream)), stream


class Transformer(nn.Module):
    """The decoder. Under tensor parallelism (`tp`) `cfg` is one rank's shape (tensor_parallel.shard_config)
    and the embedding and LM head hold this rank's slice of the vocabulary."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel | None = None):
        super().__init__()
        self.cfg, self.tp = cfg, tp
        vocab = tp.vocab_rows(cfg.vocab_size)[1] if tp is not None else cfg.vocab_size
        self.embed_tokens = nn.Embedding(vocab, cfg.hidden_size)
        block = {"post": PostNormBlock, "sandwich": SandwichBlock}.get(cfg.norm_layout, Block)
        self.layers = nn.ModuleList(block(cfg, i, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, vocab, bias=False)
        # RoPE frequencies of global layers and, where they differ, of sliding ones ("local"); not
        # buffers: .to(bf16) must not round them
        self._inv_freq: dict[tuple[torch.device, str], torch.Tensor] = {}
        self.deterministic = False

    def set_deterministic(self, on: bool) -> None:
        """Every GEMM in fixed row blocks (`fixed_linear`): each token's output depends on its own row
        alone, not on what else its batch holds. The attention backend has its own switch."""
        self.deterministic = on
        for m in self.modules():
            if isinstance(m, (Linear, MoE, SigmoidRouter)):
                m.fixed = on

    @classmethod
    def empty(cls, cfg: ModelConfig, device: torch.device | str, dtype: torch.dtype,
              tp: TensorParallel | None = None) -> "Transformer":
        """Uninitialized parameters made on `device` in `dtype` at once (never a float32 copy first:
        a 30B model's float32 weights would not fit beside nothing on one GPU)."""
        prev = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                return cls(cfg, tp)
        finally:
            torch.set_default_dtype(prev)

    def _rope(self, pos: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """(cos, sin) per kind of layer: float32 frequencies as HF has them, products in float64."""
        out = {}
        for kind in ("global", "local") if self.cfg.local_rope_theta else ("global",):
            if (pos.device, kind) not in self._inv_freq:
                inv = self.cfg.inv_freq(local=kind == "local").float().double()
                self._inv_freq[pos.device, kind] = inv.to(pos.device)
            freqs = pos[:, None].double() * self._inv_freq[pos.device, kind][None, :]
            scale = self.cfg.rope_attention_factor(local=kind == "local")     # YaRN's; else 1
            out[kind] = ((freqs.cos() * scale).float(), (freqs.sin() * scale).float())
        return out

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings; under tensor parallelism each rank looks up the ids of its vocabulary slice
        (zeros for the rest) and the ranks' rows are summed."""
        if self.tp is None:
            return self.embed_tokens(ids)
        start, rows = self.tp.vocab_rows(self.cfg.vocab_size)
        local = ids - start
        outside = (local < 0) | (local >= rows)
        x = self.embed_tokens(local.masked_fill(outside, 0)).masked_fill(outside[:, None], 0)
        return self.tp.all_reduce(x)

    def forward(self, batch: ForwardBatch, attn: AttentionBackend, float_logits: bool = True) -> torch.Tensor:
        """Runs the batch's new tokens through the model; returns float32 logits at batch.logit_rows (with
        `float_logits` False: in the model's dtype where it soft-caps none, as they come from the LM head;
        float32 holds each of them exactly)."""
        attn.plan(batch)
        rope = self._rope(batch.positions)
        x, residual = self._embed(batch.input_ids), None
        if self.cfg.embed_scale != 1.0:            # Gemma: sqrt(hidden), rounded to the model dtype as HF does
            x = x * torch.tensor(self.cfg.embed_scale).to(x.dtype)
        for block in self.layers:
            x, residual = block(x, residual, rope, attn)
        rows = batch.logit_rows                    # the LM head runs only where logits are wanted
        h, _ = self.norm(x[rows], cast(torch.Tensor, residual)[rows])     # set by the first layer
        w = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = maybe_fixed_linear(h, w, self.deterministic)
        if self.tp is not None:                    # each rank's slice of the vocabulary, side by side
            logits = self.tp.gather(logits, self.cfg.vocab_size)
        if float_logits or self.cfg.final_softcap:
            logits = logits.float()
        if cap := self.cfg.final_softcap:
            logits = torch.tanh(logits / cap) * cap
        return logits
