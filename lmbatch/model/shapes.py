"""A native checkpoint's tensor shapes against its config.json, read from the safetensors headers alone
(never the tensors): vocabulary, hidden size, layers, attention and KV heads, MLP and expert sizes, for
the tensor names and layouts lmbatch/model/weights.py loads (q/k/v and gate/up one by one, or fused as
Phi-3 stores them; experts one by one under Qwen3-MoE's or Mixtral's names, or stacked), so that a config
that disagrees with its weights is one line before any other work, not a tensor-size RuntimeError once the
weights are copied into the model, after the data was loaded and tokenized."""
from __future__ import annotations

import re
from typing import NamedTuple

from lmbatch.model.architectures import ARCHITECTURES, EXPERT_NAMINGS, experts_of
from lmbatch.model.config import ModelConfig
from lmbatch.model.names import beyond_the_decoder

_LAYER = re.compile(r"layers\.(\d+)\.")


class TensorHeader(NamedTuple):
    shape: tuple[int, ...]
    file: str           # the name of the safetensors file that holds it


class _Mismatch(Exception):
    """The first disagreement found; its message is the phrase reported."""


def shape_problem(cfg: ModelConfig, raw: dict, tensors: dict[str, TensorHeader], where: str) -> str | None:
    """The first way the checkpoint's tensors (named as stored) disagree with the config (`raw`: config.json
    as written, `cfg`: what lmbatch makes of it), in one phrase naming config.json's field, the file and
    both values; None where they agree. `where` names the weights: the file, or the shards of an index."""
    try:
        _Shapes(cfg, raw, tensors, where).check()
    except _Mismatch as m:
        return str(m)
    return None


class _Shapes:
    def __init__(self, cfg: ModelConfig, raw: dict, tensors: dict[str, TensorHeader], where: str):
        self.cfg, self.raw, self.where = cfg, raw, where
        # keyed as weights.py reads them: without the "model." prefix
        self.tensors = {name.removeprefix("model."): (name, h) for name, h in tensors.items()}
        self.prefix = "model." if any(name.startswith("model.") for name in tensors) else ""
        self.holds = "hold" if len({h.file for h in tensors.values()}) > 1 else "holds"   # `where`'s verb

    # ---- what config.json says, in words --------------------------------------------------------
    def _given(self, field: str) -> str:
        return "" if self.raw.get(field) is not None else " (not given)"

    def size(self, field: str, value: int) -> tuple[str, int]:
        return f"{field} is {value}{self._given(field)}", value

    def _head_dim(self) -> str:
        if self.raw.get("head_dim") is not None:
            return "head_dim"
        if ARCHITECTURES[self.cfg.model_type].defaults.get("head_dim"):
            return "head_dim (not given: its default)"
        return "head_dim (hidden_size / num_attention_heads)"

    def head_dim(self) -> tuple[str, int]:
        return f"{self._head_dim()} is {self.cfg.head_dim}", self.cfg.head_dim

    def heads(self, field: str, n: int) -> tuple[str, int]:
        hd = self.cfg.head_dim
        return f"{field}{self._given(field)} x {self._head_dim()} is {n} x {hd} = {n * hd}", n * hd

    def fused_heads(self) -> tuple[str, int]:
        c = self.cfg
        n = c.num_heads + 2 * c.num_kv_heads
        return (f"(num_attention_heads + 2 x num_key_value_heads{self._given('num_key_value_heads')}) x "
                f"{self._head_dim()} is ({c.num_heads} + 2 x {c.num_kv_heads}) x {c.head_dim} = {n * c.head_dim}",
                n * c.head_dim)

    # ---- what the headers say ---------------------------------------------------------------------
    def need(self, key: str, rank: int) -> TensorHeader:
        if key not in self.tensors:
            raise _Mismatch(f"there is no {self.prefix}{key} in {self.where}")
        name, h = self.tensors[key]
        if len(h.shape) != rank:
            raise _Mismatch(f"{h.file} has {name} of shape {list(h.shape)}, where a {rank}-D tensor belongs")
        return h

    def dims(self, key: str, *wants: tuple[tuple[str, int], str] | None) -> None:
        """The tensor is there, of len(wants) dimensions, each the size config.json gives (None: not checked);
        a want is ((config.json's words, size), what the dimension counts)."""
        h = self.need(key, len(wants))
        for got, want in zip(h.shape, wants):
            if want is not None and got != want[0][1]:
                raise _Mismatch(f"config.json {want[0][0]} but {h.file} has {got} {want[1]} in {self.tensors[key][0]}")

    # ---- the checks -----------------------------------------------------------------------------------
    def check(self) -> None:
        c = self.cfg
        vocab, hidden = (self.size("vocab_size", c.vocab_size), "rows"), (self.size("hidden_size", c.hidden_size),
                                                                         "columns")
        self.dims("embed_tokens.weight", vocab, hidden)
        if "lm_head.weight" in self.tensors:
            self.dims("lm_head.weight", vocab, hidden)
        elif not c.tie_word_embeddings:
            raise _Mismatch(f"config.json tie_word_embeddings is false{self._given('tie_word_embeddings')} but there "
                            f"is no lm_head.weight in {self.where}")
        self.layers()
        for i in range(c.num_layers):
            self.attention(i)
            if c.sparse_layers and c.sparse_layers[i]:
                self.experts(i)
            else:
                self.dense_mlp(i)

    def layers(self) -> None:
        n = self.cfg.num_layers
        found = {int(m.group(1)) for key in self.tensors
                 if (m := _LAYER.match(key)) and not beyond_the_decoder(key, self.cfg)}
        words = f"config.json num_hidden_layers is {n}"
        if not found:
            raise _Mismatch(f"{words} but there are no {self.prefix}layers.* tensors in {self.where}")
        if max(found) + 1 != n:
            raise _Mismatch(f"{words} but {self.where} {self.holds} {max(found) + 1} layers "
                            f"({self.prefix}layers.0 to {self.prefix}layers.{max(found)})")
        missing = sorted(set(range(n)) - found)
        if missing:
            raise _Mismatch(f"{words} but {self.where} {self.holds} no tensors of layer {missing[0]} "
                            f"({self.prefix}layers.{missing[0]}.*)")

    def attention(self, i: int) -> None:
        c, p = self.cfg, f"layers.{i}.self_attn."
        if c.kv_lora_rank:
            self.latent_attention(p)
            return
        hidden = (self.size("hidden_size", c.hidden_size), "columns")
        q = self.heads("num_attention_heads", c.num_heads)
        kv = self.heads("num_key_value_heads", c.num_kv_heads)
        if c.qk_norm == "head":                 # per head: pins head_dim itself
            self.dims(p + "q_norm.weight", (self.head_dim(), "entries"))
            self.dims(p + "k_norm.weight", (self.head_dim(), "entries"))
        if p + "qkv_proj.weight" in self.tensors:
            self.dims(p + "qkv_proj.weight", (self.fused_heads(), "rows"), hidden)
        else:
            self.dims(p + "q_proj.weight", (q, "rows"), hidden)
            self.dims(p + "k_proj.weight", (kv, "rows"), hidden)
            self.dims(p + "v_proj.weight", (kv, "rows"), hidden)
        if c.qk_norm == "proj":                 # over the whole projections (olmo2)
            self.dims(p + "q_norm.weight", (q, "entries"))
            self.dims(p + "k_norm.weight", (kv, "entries"))
        self.dims(p + "o_proj.weight", (self.size("hidden_size", c.hidden_size), "rows"), (q, "columns"))
        if c.attn_sinks:
            self.dims(p + "sinks", (self.size("num_attention_heads", c.num_heads), "entries"))

    def dense_mlp(self, i: int) -> None:
        c, p = self.cfg, f"layers.{i}.mlp."
        inter = self.size("intermediate_size", c.intermediate_size)
        hidden = self.size("hidden_size", c.hidden_size)
        if p + "gate_up_proj.weight" in self.tensors:     # fused (phi3)
            both = (f"2 x intermediate_size is 2 x {c.intermediate_size} = {2 * c.intermediate_size}",
                    2 * c.intermediate_size)
            self.dims(p + "gate_up_proj.weight", (both, "rows"), (hidden, "columns"))
        else:
            self.dims(p + "gate_proj.weight", (inter, "rows"), (hidden, "columns"))
            self.dims(p + "up_proj.weight", (inter, "rows"), (hidden, "columns"))
        self.dims(p + "down_proj.weight", (hidden, "rows"), (inter, "columns"))

    def experts(self, i: int) -> None:
        c, own = self.cfg, experts_of(self.cfg.model_type)
        # the naming whose router the checkpoint holds (another than the plain "mlp" first), else its own
        named = next((b for b in sorted(EXPERT_NAMINGS, key=lambda b: b == "mlp")
                      if f"layers.{i}.{b}.gate.weight" in self.tensors), own.block)
        block = f"layers.{i}.{named}."
        n = self.size(next((f for f in ("num_experts", "n_routed_experts") if f in self.raw), "num_local_experts"),
                      c.num_experts)
        field = own.size_field
        inter = self.size(field, c.moe_intermediate_size)
        hidden = self.size("hidden_size", c.hidden_size)
        router = block + ("router." if own.gpt_oss else "gate.")
        if router + "weight" not in self.tensors:
            why = (f"yet config.json's mlp_only_layers and decoder_sparse_step make layer {i} one of routed experts"
                   if own.by_config else f"yet config.json's first_k_dense_replace makes layer {i} one of routed "
                   "experts" if own.dense_first else f"and every layer of a {c.model_type} model routes to experts")
            raise _Mismatch(f"there is no {self.prefix}{router}weight (the experts' router) in {self.where}, {why}")
        self.dims(router + "weight", (n, "rows (experts)"), (hidden, "columns"))
        if c.router == "sigmoid":
            self.dims(router + "e_score_correction_bias", (n, "entries"))
        if c.shared_experts_size:
            self.shared_experts(i)
        if own.gpt_oss:
            self.gpt_oss_experts(i, n, inter, hidden)
            return
        stacked = f"layers.{i}.mlp.experts."
        if stacked + "gate_up_proj" in self.tensors:
            both = (f"2 x {field} is 2 x {c.moe_intermediate_size} = {2 * c.moe_intermediate_size}",
                    2 * c.moe_intermediate_size)
            self.dims(stacked + "gate_up_proj", (n, "experts"), (both, "rows per expert"), (hidden, "columns"))
            self.dims(stacked + "down_proj", (n, "experts"), (hidden, "rows per expert"), (inter, "columns"))
            return
        gate, up, down = EXPERT_NAMINGS[named]
        for e in range(c.num_experts):
            x = f"{block}experts.{e}."
            self.dims(f"{x}{gate}.weight", (inter, "rows"), (hidden, "columns"))
            self.dims(f"{x}{up}.weight", (inter, "rows"), (hidden, "columns"))
            self.dims(f"{x}{down}.weight", (hidden, "rows"), (inter, "columns"))

    def shared_experts(self, i: int) -> None:
        c, p = self.cfg, f"layers.{i}.mlp.shared_experts."
        width = (f"n_shared_experts x moe_intermediate_size is {c.shared_experts_size}", c.shared_experts_size)
        hidden = self.size("hidden_size", c.hidden_size)
        self.dims(p + "gate_proj.weight", (width, "rows"), (hidden, "columns"))
        self.dims(p + "up_proj.weight", (width, "rows"), (hidden, "columns"))
        self.dims(p + "down_proj.weight", (hidden, "rows"), (width, "columns"))

    def gpt_oss_experts(self, i: int, n: tuple[str, int], inter: tuple[str, int], hidden: tuple[str, int]) -> None:
        """gpt-oss's router bias and stacked, transposed experts with their biases."""
        p, c = f"layers.{i}.mlp.", self.cfg
        both = (f"2 x intermediate_size is 2 x {c.moe_intermediate_size} = {2 * c.moe_intermediate_size}",
                2 * c.moe_intermediate_size)
        self.dims(p + "router.bias", (n, "entries"))
        self.dims(p + "experts.gate_up_proj", (n, "experts"), (hidden, "rows per expert"), (both, "columns"))
        self.dims(p + "experts.gate_up_proj_bias", (n, "experts"), (both, "columns"))
        self.dims(p + "experts.down_proj", (n, "experts"), (inter, "rows per expert"), (hidden, "columns"))
        self.dims(p + "experts.down_proj_bias", (n, "experts"), (hidden, "columns"))

    def latent_attention(self, p: str) -> None:
        """DeepSeek's multi-head latent attention: its q (LoRA or plain), the latent's down-projection and
        norm, the per-head up-projection of keys and values, and the output projection."""
        c = self.cfg
        hidden = self.size("hidden_size", c.hidden_size)
        nh, nope, rope, v = c.num_heads, c.qk_nope_head_dim, c.rotary_dim, c.v_head_dim
        q = (f"num_attention_heads x (qk_nope_head_dim + qk_rope_head_dim) is {nh} x ({nope} + {rope}) = "
             f"{nh * (nope + rope)}", nh * (nope + rope))
        rank = self.size("kv_lora_rank", c.kv_lora_rank)
        if c.q_lora_rank:
            q_rank = self.size("q_lora_rank", c.q_lora_rank)
            self.dims(p + "q_a_proj.weight", (q_rank, "rows"), (hidden, "columns"))
            self.dims(p + "q_a_layernorm.weight", (q_rank, "entries"))
            self.dims(p + "q_b_proj.weight", (q, "rows"), (q_rank, "columns"))
        else:
            self.dims(p + "q_proj.weight", (q, "rows"), (hidden, "columns"))
        latent = (f"kv_lora_rank + qk_rope_head_dim is {c.kv_lora_rank} + {rope} = {c.head_dim}", c.head_dim)
        self.dims(p + "kv_a_proj_with_mqa.weight", (latent, "rows"), (hidden, "columns"))
        self.dims(p + "kv_a_layernorm.weight", (rank, "entries"))
        kv = (f"num_attention_heads x (qk_nope_head_dim + v_head_dim) is {nh} x ({nope} + {v}) = {nh * (nope + v)}",
              nh * (nope + v))
        self.dims(p + "kv_b_proj.weight", (kv, "rows"), (rank, "columns"))
        out = (f"num_attention_heads x v_head_dim is {nh} x {v} = {nh * v}", nh * v)
        self.dims(p + "o_proj.weight", (hidden, "rows"), (out, "columns"))
