"""The model_types lmbatch's own network runs, one entry each: everything that differs between them.

An entry holds the defaults transformers' config class fills in for fields config.json leaves out, what
the class derives from them (layer types), the network's deltas from Llama (q/k norms, norm layout,
Gemma's scaling), the routed experts' names and sizes, and the tokenizer class AutoTokenizer maps the
model_type to. config.py, names.py, shapes.py and tokenizer.py read these entries and name no model_type
themselves. To add an architecture: one entry here, and its tiny model in tests/conftest.py's
TINY_CONFIGS, which the parity tests (tests/unit/test_config_parse.py, tests/e2e/test_architectures.py)
then run against transformers. Pure data: imported without torch or transformers.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Experts:
    """A sparse MLP's routed experts as the checkpoint names and sizes them."""
    block: str = "mlp"              # the module holding the router (`gate`) and the experts
    names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")    # one expert's gate, up and down
    size_field: str = "moe_intermediate_size"   # config.json's field of one expert's MLP width
    by_config: bool = True          # its config has mlp_only_layers and decoder_sparse_step (else every layer routes)
    norm_topk_prob: bool | None = None          # forced (None: config.json's)
    router_weights_in_model_dtype: bool = True  # the routing weights rounded to the model dtype
    # "softmax": the top k of the router's softmax; "sigmoid" (DeepSeek-V3's, GLM-4.5's): sigmoid scores plus
    # a correction bias choose the experts within the best `topk_group` of `n_group` groups, the scores
    # weight them (renormalized where norm_topk_prob) times routed_scaling_factor; router in float32
    routing: str = "softmax"
    shared: bool = False            # a dense MLP of n_shared_experts x the expert width beside the routed experts
    # gpt-oss: biased router and experts, a clamped SwiGLU (swiglu_alpha, swiglu_limit), experts stacked as
    # transformers stores gpt-oss's ([E, H, 2I] with gate and up columns interleaved, down [E, I, H])
    gpt_oss: bool = False
    dense_first: bool = False       # the first first_k_dense_replace layers are dense (else every layer routes)


@dataclass(frozen=True)
class Architecture:
    what: str                       # the family, and its deltas from Llama, in words
    defaults: dict = field(default_factory=dict)    # transformers 5's config class defaults
    tokenizer: str = ""             # TOKENIZER_MAPPING_NAMES' class ("": none; AutoTokenizer's default)
    hub_tokenizer_wrong: bool = False   # in MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS
    # what the config class derives: "" nothing; "qwen": sliding layers from max_window_layers, and
    # `sliding_window` only when `use_sliding_window`; "pattern": every `sliding_every`-th layer full;
    # "nope": the NoPE layers slide where `use_sliding_window` (SmolLM3)
    layer_types: str = ""
    sliding_switch: bool = False    # `use_sliding_window` off means no window (Qwen)
    sliding_every: int = 0          # "pattern": the period, unless config.json's `sliding_every_field` gives it
    sliding_every_field: str = ""
    null_is_default: tuple[str, ...] = ()   # fields whose null in config.json is the default
    nope_every: int = 0             # `no_rope_layers` (1: RoPE, 0: none) default to NoPE every this many layers,
    #                                 or every `no_rope_layer_interval` (SmolLM3); 0: every layer rotates
    # RoPE parameters per layer type (Gemma 3, OLMo 3): scaling (v4 rope_scaling too) on full layers only, sliding
    # layers unscaled at their own base (v4: `rope_local_base_freq`, else the class's default base)
    rope_per_layer_type: bool = False
    # the network's deltas from Llama (ModelConfig's fields of the same names)
    qkv_bias: bool = False          # q/k/v biases whatever `attention_bias` says
    qk_norm: str = ""               # "head": RMSNorm of each head's q and k; "proj": of the projections
    qk_norm_field: str = ""         # config.json's switch of the q/k norm (GLM-4.5's use_qk_norm; "": always)
    partial_rotary: bool = False    # RoPE may rotate a fraction of each head (partial_rotary_factor)
    o_bias: bool = False            # the output projection has a bias where attention_bias (as q/k/v have)
    latent: bool = False            # multi-head latent attention (DeepSeek-V2/V3: q_lora_rank, kv_lora_rank, ...)
    sinks: bool = False             # a learned logit per head in each softmax's denominator (gpt-oss)
    mtp_field: str = ""             # config.json's count of multi-token-prediction layers stored after the
    #                                 decoder's (not run for scoring: their tensors are skipped)
    norm_layout: str = "pre"        # "pre", "post" (after attention and MLP) or "sandwich" (both)
    gemma_scaling: bool = False     # RMSNorm times (1 + w), embeddings times sqrt(hidden), query_pre_attn_scalar
    experts: Experts | None = None
    renames: dict[str, str] = field(default_factory=dict)   # checkpoint name fragment -> ours
    # an MXFP4 tensor's [..., rows, groups x 32] transposed, as the unquantized checkpoint stores it (gpt-oss's
    # experts: [E, in, out]): model/quantization.py
    mxfp4_transposed: bool = False


_LLAMA_LIKE = {"num_key_value_heads": None, "head_dim": None, "rms_norm_eps": 1e-6, "max_position_embeddings": 2048,
               "tie_word_embeddings": False, "attention_bias": False, "eos_token_id": 2, "hidden_act": "silu",
               "rope_theta": 10000.0}
_QWEN = {"num_key_value_heads": 32, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768,
         "tie_word_embeddings": False, "eos_token_id": None, "hidden_act": "silu", "rope_theta": 10000.0,
         "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28}
_GEMMA = {"num_key_value_heads": 4, "head_dim": 256, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
          "attention_bias": False, "eos_token_id": 1, "hidden_activation": "gelu_pytorch_tanh",
          "query_pre_attn_scalar": 256, "sliding_window": 4096}
_MIXTRAL_EXPERTS = Experts(block="block_sparse_moe", names=("w1", "w3", "w2"), size_field="intermediate_size",
                           by_config=False, norm_topk_prob=True, router_weights_in_model_dtype=False)

# model_type -> its entry (transformers 5.24's defaults and tokenizer classes)
ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture("Llama", _LLAMA_LIKE, o_bias=True),
    "qwen2": Architecture("Qwen2 (q/k/v biases)", _QWEN, "Qwen2Tokenizer", hub_tokenizer_wrong=True,
                          layer_types="qwen", sliding_switch=True, qkv_bias=True),
    "qwen3": Architecture("Qwen3 (per-head q/k RMSNorm)", {**_QWEN, "head_dim": 128, "attention_bias": False},
                          "Qwen2Tokenizer", layer_types="qwen", sliding_switch=True, qk_norm="head", o_bias=True),
    "qwen3_moe": Architecture(
        "Qwen3-MoE (q/k norm, routed experts)",
        {**_QWEN, "num_key_value_heads": 4, "attention_bias": False, "decoder_sparse_step": 1,
         "moe_intermediate_size": 768, "num_experts_per_tok": 8, "num_local_experts": 128, "norm_topk_prob": False,
         "mlp_only_layers": []},
        "Qwen2Tokenizer", sliding_switch=True, null_is_default=("mlp_only_layers",), qk_norm="head", o_bias=True,
        experts=Experts()),
    "smollm3": Architecture("SmolLM3 (Llama with no RoPE on every fourth layer: NoPE)",
                            {**_LLAMA_LIKE, "num_key_value_heads": 4, "max_position_embeddings": 32768,
                             "eos_token_id": 128001, "rope_theta": 2000000.0, "tie_word_embeddings": True,
                             "use_sliding_window": False, "sliding_window": None, "no_rope_layer_interval": 4},
                            layer_types="nope", nope_every=4, o_bias=True),
    "glm4_moe": Architecture(
        "GLM-4.5 (routed experts by biased, group-limited sigmoid scores beside a shared expert; dense first "
        "layers; RoPE on half of each head; optional q/k norm)",
        {**_LLAMA_LIKE, "num_key_value_heads": 8, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
         "eos_token_id": None, "partial_rotary_factor": 0.5, "moe_intermediate_size": 1408, "num_experts_per_tok": 8,
         "n_shared_experts": 1, "num_local_experts": 128, "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1,
         "first_k_dense_replace": 1, "norm_topk_prob": True, "use_qk_norm": False, "num_nextn_predict_layers": 1},
        "TokenizersBackend", qk_norm="head", qk_norm_field="use_qk_norm", partial_rotary=True,
        mtp_field="num_nextn_predict_layers",
        experts=Experts(by_config=False, router_weights_in_model_dtype=False, routing="sigmoid", shared=True,
                        dense_first=True)),
    "gpt_oss": Architecture(
        "gpt-oss (attention sinks and biases, sliding-window and full layers alternating, YaRN; routed experts "
        "with biases and a clamped SwiGLU)",
        {**_LLAMA_LIKE, "num_key_value_heads": 8, "head_dim": 64, "max_position_embeddings": 131072,
         "rms_norm_eps": 1e-5, "eos_token_id": None, "rope_theta": 150000.0, "attention_bias": True,
         "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                          "original_max_position_embeddings": 4096},
         "sliding_window": 128, "num_local_experts": 128, "num_experts_per_tok": 4, "swiglu_alpha": 1.702,
         "swiglu_limit": 7.0},
        layer_types="pattern", sliding_every=2, o_bias=True, sinks=True, renames={"mlp.router.": "mlp.gate."},
        experts=Experts(size_field="intermediate_size", by_config=False, norm_topk_prob=True, gpt_oss=True),
        mxfp4_transposed=True),
    "deepseek_v3": Architecture(
        "DeepSeek-V3 (multi-head latent attention; routed experts as GLM-4.5's; dense first layers; YaRN with mscale)",
        {**_LLAMA_LIKE, "num_key_value_heads": 128, "max_position_embeddings": 4096, "eos_token_id": 1,
         "moe_intermediate_size": 2048, "n_shared_experts": 1, "num_local_experts": 256, "routed_scaling_factor": 2.5,
         "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
         "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8, "first_k_dense_replace": 3, "norm_topk_prob": True,
         "rope_interleave": True, "num_nextn_predict_layers": 1},
        latent=True, mtp_field="num_nextn_predict_layers",
        experts=Experts(by_config=False, router_weights_in_model_dtype=False, routing="sigmoid", shared=True,
                        dense_first=True)),
    "mistral": Architecture("Mistral (sliding-window attention)",
                            {**_LLAMA_LIKE, "num_key_value_heads": 8, "max_position_embeddings": 131072,
                             "sliding_window": 4096}, "MistralCommonBackend"),
    "mixtral": Architecture("Mixtral (routed experts, sliding window)",
                            {**_LLAMA_LIKE, "num_key_value_heads": 8, "max_position_embeddings": 131072,
                             "rms_norm_eps": 1e-5, "sliding_window": None, "num_experts_per_tok": 2,
                             "num_local_experts": 8, "rope_theta": 1000000.0},
                            "MistralCommonBackend", experts=_MIXTRAL_EXPERTS,
                            renames={"block_sparse_moe.gate.": "mlp.gate."}),      # the router
    "phi3": Architecture("Phi-3 (fused qkv and gate/up weights)",
                         {**_LLAMA_LIKE, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "eos_token_id": 32000,
                          "sliding_window": None}, "TokenizersBackend", hub_tokenizer_wrong=True),
    "olmo2": Architecture("OLMo 2 (norms after attention and MLP, q/k norm over the projections)",
                          {**_LLAMA_LIKE, "rms_norm_eps": 1e-5, "eos_token_id": 50279}, "TokenizersBackend",
                          qk_norm="proj", norm_layout="post", o_bias=True),
    "gemma2": Architecture("Gemma 2 (norms around attention and MLP, soft-capped logits, alternating sliding windows)",
                           {**_GEMMA, "max_position_embeddings": 8192, "attn_logit_softcapping": 50.0,
                            "final_logit_softcapping": 30.0, "rope_theta": 10000.0},
                           "GemmaTokenizer", layer_types="pattern", sliding_every=2, norm_layout="sandwich",
                           gemma_scaling=True, o_bias=True),
    "gemma3_text": Architecture("Gemma 3 (Gemma 2 with q/k norms and a RoPE base of its own for sliding layers)",
                                {**_GEMMA, "max_position_embeddings": 131072, "attn_logit_softcapping": None,
                                 "final_logit_softcapping": None, "rope_theta": 1000000.0,
                                 "rope_local_base_freq": 10000.0},
                                "GemmaTokenizer", layer_types="pattern", sliding_every=6,
                                sliding_every_field="sliding_window_pattern", qk_norm="head", norm_layout="sandwich",
                                gemma_scaling=True, rope_per_layer_type=True, o_bias=True),
    "olmo3": Architecture("OLMo 3 (OLMo 2 with sliding-window layers, three in four; scaled RoPE on full layers only)",
                          {**_LLAMA_LIKE, "rms_norm_eps": 1e-5, "eos_token_id": 50279, "rope_theta": 500000.0,
                           "sliding_window": 4096}, "TokenizersBackend", layer_types="pattern", sliding_every=4,
                          qk_norm="proj", norm_layout="post", rope_per_layer_type=True, o_bias=True),
}
# experts already stacked in the checkpoint ([E, ...], as transformers 5 saves Qwen3-MoE and Mixtral)
STACKED_EXPERTS = {"mlp.experts.gate_up_proj": "mlp.gate_up_proj", "mlp.experts.down_proj": "mlp.down_proj"}
# the experts of a model_type whose entry has none (a config.json that gives experts anyway gets them: the
# layers its mlp_only_layers and decoder_sparse_step leave sparse route)
NO_EXPERTS = Experts(size_field="intermediate_size", by_config=False)
# every checkpoint naming of one expert's weights: its block -> (gate, up, down)
EXPERT_NAMINGS = {e.block: e.names for e in [Experts()] + [a.experts for a in ARCHITECTURES.values() if a.experts]}


def experts_of(model_type: str) -> Experts:
    arch = ARCHITECTURES.get(model_type)
    return arch.experts if arch is not None and arch.experts is not None else NO_EXPERTS
