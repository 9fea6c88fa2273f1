"""Tiny random checkpoints quantized as the releases are, for the quantized-checkpoint tests
(tests/unit/test_quantized.py, tests/e2e/test_quantized_runs.py): FP8 e4m3 with DeepSeek's 128x128
`weight_scale_inv` blocks, compressed-tensors FP8 with per-tensor and per-channel `weight_scale`s, MXFP4
e2m1 nibbles with e8m0 scales. Written here, independently of lmbatch's readers."""
from __future__ import annotations

import json
import math

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig

FP8_MAX = 448.0
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
SMALL = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
             vocab_size=128, max_position_embeddings=512, tie_word_embeddings=False)


def _save_random(cfg, path, seed=0) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.08 * torch.randn_like(p))
    model.save_pretrained(path)
    return load_file(path / "model.safetensors")


def _write(path, tensors, config, quantization):
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps({**config, "quantization_config": quantization}))


def _projection(name: str, t: torch.Tensor) -> bool:
    """What the releases quantize: the attention and MLP projections (not embeddings, norms, routers, LM head)."""
    return t.dim() == 2 and "proj" in name and "embed" not in name


# ---- quantizers, written here as the releases' tools do it ------------------------------------------------
def fp8_blocks(w: torch.Tensor, block=(128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's layout: e4m3 values and a float32 `weight_scale_inv` per block (grid ceil(out/b), ceil(in/b))."""
    rows, cols = w.shape
    gr, gc = math.ceil(rows / block[0]), math.ceil(cols / block[1])
    padded = torch.zeros(gr * block[0], gc * block[1])
    padded[:rows, :cols] = w
    tiles = padded.view(gr, block[0], gc, block[1])
    scale = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    q = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(gr * block[0], gc * block[1])[:rows, :cols].contiguous(), scale


def fp8_scaled(w: torch.Tensor, per_channel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """compressed-tensors' FP8: a `weight_scale` per output channel ([out, 1]) or per tensor ([1])."""
    amax = w.abs().amax(dim=1, keepdim=True) if per_channel else w.abs().amax().reshape(1)
    scale = amax.clamp(min=1e-12) / FP8_MAX
    return (w / (scale if per_channel else scale[0])).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def mxfp4_pack(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., rows, cols] as MXFP4: per 32 values an e8m0 exponent (the smallest power of two taking the group's
    largest magnitude to at most 6) and e2m1 values rounded to the nearest, two per byte, the first in the low
    nibble: ([..., rows, cols/32, 16] uint8, [..., rows, cols/32] uint8)."""
    *lead, rows, cols = w.shape
    g = w.reshape(*lead, rows, cols // 32, 32)
    exp = torch.ceil(torch.log2(g.abs().amax(-1).clamp(min=2.0 ** -120) / 6.0)).clamp(-127, 127)
    x = g / torch.exp2(exp)[..., None]
    code = (x.abs()[..., None] - E2M1).abs().argmin(-1) + 8 * (x < 0)
    packed = (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8)
    return packed, (exp + 127).to(torch.uint8)


def dequantized_ct(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """This file's own dequantizer for compressed-tensors' FP8 (the reference checkpoint's weights)."""
    return q.float() * (scale if scale.dim() == 2 else scale[0])


def _qwen3_moe():
    return Qwen3MoeConfig(**SMALL, intermediate_size=384, num_experts=4, num_experts_per_tok=2,
                          moe_intermediate_size=256, norm_topk_prob=False, mlp_only_layers=[1])


def fp8_block_checkpoint(tmp_path, kind: str, block=(128, 128), **overrides):
    """A model quantized as Qwen3's `-FP8` releases are (every projection: experts one by one; the router
    and LM head left in float)."""
    cfg = Qwen3Config(**{**SMALL, **overrides}, intermediate_size=384) if kind == "qwen3" else _qwen3_moe()
    tensors = _save_random(cfg, tmp_path / "float")
    out = {}
    for name, t in tensors.items():
        if _projection(name, t):
            out[name], out[name.replace(".weight", ".weight_scale_inv")] = fp8_blocks(t, block)
        else:
            out[name] = t
    config = json.loads((tmp_path / "float" / "config.json").read_text())
    _write(tmp_path / "fp8", out, config, {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                           "weight_block_size": list(block), "modules_to_not_convert": ["lm_head"]})
    return tmp_path / "fp8"


def ct_checkpoint(tmp_path, activations: str = "static"):
    """llm-compressor's FP8 layout: attention per tensor (q, k, v each its own scale), MLP per channel; a static
    `input_scale` beside each (ignored: activations run in the model's dtype); LM head ignored. Returns the
    folder and the reference folder (the same weights dequantized here, float32)."""
    cfg = Qwen3Config(**SMALL, intermediate_size=384)
    tensors = _save_random(cfg, tmp_path / "float", seed=1)
    out, ref = {}, {}
    for name, t in tensors.items():
        ref[name] = out[name] = t
        if _projection(name, t):
            q, s = fp8_scaled(t, per_channel="mlp" in name)
            out[name], out[name.replace(".weight", ".weight_scale")] = q, s
            if activations == "static":
                out[name.replace(".weight", ".input_scale")] = torch.tensor([0.02])
            ref[name] = dequantized_ct(q, s)
    config = json.loads((tmp_path / "float" / "config.json").read_text())
    act = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor" if activations == "static"
           else "token", "dynamic": activations == "dynamic"}
    groups = {f"group_{i}": {"targets": [target], "input_activations": act,
                             "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy,
                                         "dynamic": False, "group_size": None, "block_structure": None}}
              for i, (target, strategy) in enumerate([("re:.*self_attn.*", "tensor"), ("re:.*mlp.*", "channel")])}
    _write(tmp_path / "ct", out, config, {"quant_method": "compressed-tensors", "format": "float-quantized",
                                          "config_groups": groups, "ignore": ["lm_head"],
                                          "quantization_status": "compressed", "kv_cache_scheme": None})
    _write(tmp_path / "ref", ref, config, None)
    (tmp_path / "ref" / "config.json").write_text(json.dumps(config))
    return tmp_path / "ct", tmp_path / "ref"
