"""Quantized checkpoints (model/quantization.py, model/dequantize.py, model/fp8.py) on the CPU in float32: tiny
random models quantized here the way the releases are (FP8 e4m3 with DeepSeek's 128x128 `weight_scale_inv`
blocks; compressed-tensors FP8 with per-tensor and per-channel `weight_scale`, static `input_scale`s beside them;
MXFP4 e2m1 nibbles with e8m0 scales), loaded by lmbatch and scored against a reference:

- block FP8: transformers' own loader, `FineGrainedFP8Config(dequantize=True)`;
- compressed-tensors: transformers needs the `compressed-tensors` package for it (not a dependency here), so
  the reference is the same model saved dequantized in float32 by this file's own dequantizer;
- MXFP4: transformers' loader reads MXFP4 for gpt-oss only (not a native model_type yet), so the reference is
  qwen3_moe's experts dequantized by transformers' own MXFP4 decoder (`convert_moe_packed_tensors`).

Then the FP8 GEMM path's loading on the CPU (its layers' stored weights and scales give exactly the dequantized
weights), its dispatch decisions, and the one-line errors."""
from __future__ import annotations

import json

import pytest
import torch
from quantized_checkpoints import (
    SMALL,
    _qwen3_moe,
    _save_random,
    _write,
    ct_checkpoint,
    fp8_block_checkpoint,
    fp8_blocks,
    mxfp4_pack,
)
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, FineGrainedFP8Config

from lmbatch.attention.base import ForwardBatch
from lmbatch.attention.kv_pool import KVPool
from lmbatch.attention.torch_ref import TorchBackend
from lmbatch.errors import UserError
from lmbatch.model.checkpoint import resolve_model
from lmbatch.model.config import ModelConfig
from lmbatch.model.dequantize import mxfp4, scaled_fp8
from lmbatch.model.fp8 import Where, fits
from lmbatch.model.network import Transformer
from lmbatch.model.quantization import read_quantization
from lmbatch.model.weights import load_weights

TOL = 1e-4
# ---- running ----------------------------------------------------------------------------------------------
def _logprobs(model: Transformer, cfg: ModelConfig, ids: list[int]) -> torch.Tensor:
    n = len(ids)
    pool = KVPool(64, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
    attn = TorchBackend(pool, cfg.num_heads, cfg.head_dim, cfg.attn_scale, cfg.attn_softcap)
    slots = torch.randperm(64, generator=torch.Generator().manual_seed(3))[:n]
    batch = ForwardBatch(torch.tensor(ids), torch.arange(n), slots, [0, n], [0, n], slots, torch.arange(n))
    with torch.no_grad():
        return model(batch, attn).log_softmax(-1)


def ours(path, fp8_gemm: bool = False) -> tuple[Transformer, torch.Tensor]:
    """lmbatch's model of the folder (checked as a run checks it first) and its logprobs at 24 positions."""
    resolve_model(str(path))
    cfg = ModelConfig.from_dir(path)
    model = Transformer(cfg)
    load_weights(model, path, fp8_gemm=fp8_gemm)
    return model.eval(), _logprobs(model, cfg, IDS)


def theirs(hf) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([IDS])).logits[0].log_softmax(-1)


IDS = torch.randint(0, 128, (24,), generator=torch.Generator().manual_seed(1)).tolist()


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe"])
def test_fp8_blocks_score_as_transformers_dequantized(tmp_path, kind):
    path = fp8_block_checkpoint(tmp_path, kind)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                              quantization_config=FineGrainedFP8Config(dequantize=True))
    _, lp = ours(path)
    assert (lp - theirs(hf)).abs().max() < TOL
    # the quantization bites: the float model it came from scores otherwise
    float_model = AutoModelForCausalLM.from_pretrained(tmp_path / "float", dtype=torch.float32)
    assert (lp - theirs(float_model)).abs().max() > 1e-3


def test_fp8_blocks_on_ragged_edges_and_e8m0_scales():
    """A weight whose sides are not multiples of the block (the last blocks short: DeepSeek's ceil grid), and
    scales stored as e8m0 exponents (`scale_fmt: ue8m0`)."""
    w = torch.randn(200, 300)
    q, s = fp8_blocks(w)
    assert s.shape == (2, 3)
    want = q.float() * s.repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[:, :300]
    assert torch.equal(scaled_fp8(q, s, (128, 128), torch.float32), want)
    exps = torch.randint(100, 140, (2, 3), dtype=torch.uint8)
    from lmbatch.model.dequantize import e8m0
    assert torch.equal(e8m0(exps), torch.exp2(exps.float() - 127))


@pytest.mark.parametrize("activations", ["static", "dynamic"])
def test_compressed_tensors_fp8_scores_as_its_dequantized_model(tmp_path, activations):
    path, ref = ct_checkpoint(tmp_path, activations)
    _, lp = ours(path)
    assert (lp - theirs(AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32))).abs().max() < TOL


def test_mxfp4_experts_score_as_transformers_mxfp4_decoder(tmp_path):
    """qwen3_moe with its stacked experts in MXFP4 (`mlp.experts.gate_up_proj_blocks` / `_scales`, as gpt-oss
    stores its experts); the reference's experts decoded by transformers' MXFP4 decoder."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    cfg = _qwen3_moe()
    tensors = _save_random(cfg, tmp_path / "float", seed=2)
    out, ref = {}, {}
    for name, t in tensors.items():
        ref[name] = out[name] = t
    model = AutoModelForCausalLM.from_config(cfg)
    expert_keys = [k for k in model.state_dict() if ".experts." in k]
    assert expert_keys == ["model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"]
    per_expert = {k: v for k, v in out.items() if ".experts." in k}
    for k in per_expert:
        del out[k], ref[k]
    p = "model.layers.0.mlp.experts."
    stacked = {"gate_up_proj": torch.stack([torch.cat([per_expert[f"{p}{e}.gate_proj.weight"],
                                                       per_expert[f"{p}{e}.up_proj.weight"]]) for e in range(4)]),
               "down_proj": torch.stack([per_expert[f"{p}{e}.down_proj.weight"] for e in range(4)])}
    for proj, w in stacked.items():
        blocks, scales = mxfp4_pack(w)
        out[p + proj + "_blocks"], out[p + proj + "_scales"] = blocks, scales
        ref[p + proj] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2).contiguous()
        assert (ref[p + proj] - w).abs().max() < 0.5 * w.abs().max()      # a coarse copy of w, not noise
    config = json.loads((tmp_path / "float" / "config.json").read_text())
    _write(tmp_path / "mx", out, config, {"quant_method": "mxfp4", "modules_to_not_convert": ["lm_head"]})
    _write(tmp_path / "ref", ref, config, None)
    (tmp_path / "ref" / "config.json").write_text(json.dumps(config))
    _, lp = ours(tmp_path / "mx")
    assert (lp - theirs(AutoModelForCausalLM.from_pretrained(tmp_path / "ref", dtype=torch.float32))).abs().max() < TOL


def test_gpt_oss_mxfp4_release_scores_as_transformers_dequantized(tmp_path):
    """gpt-oss as it is released: its experts in MXFP4 (`*_blocks` / `*_scales`, out-major), the rest as is;
    against transformers' own gpt-oss MXFP4 loader (Mxfp4Config(dequantize=True))."""
    from conftest import TINY_CONFIGS
    from transformers import Mxfp4Config

    tensors = _save_random(TINY_CONFIGS["gpt_oss"](), tmp_path / "float", seed=4)
    out = {}
    for name, t in tensors.items():
        if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            # stored [E, in, out] unquantized; the release packs [E, out, in / 32, 16]
            out[name + "_blocks"], out[name + "_scales"] = mxfp4_pack(t.transpose(1, 2).contiguous())
        else:
            out[name] = t
    assert sum(name.endswith("_blocks") for name in out) == 4         # 2 layers x gate_up, down
    config = json.loads((tmp_path / "float" / "config.json").read_text())
    unconverted = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]
    _write(tmp_path / "mx", out, config, {"quant_method": "mxfp4", "modules_to_not_convert": unconverted})
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "mx", dtype=torch.float32,
                                              quantization_config=Mxfp4Config(dequantize=True))
    _, lp = ours(tmp_path / "mx")
    assert (lp - theirs(hf)).abs().max() < TOL


def test_mxfp4_decoder_matches_transformers_transposed():
    """gpt-oss's layout: the dequantized experts transposed ([E, in, out]) as its unquantized checkpoint stores them."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks = torch.randint(0, 256, (3, 40, 2, 16), dtype=torch.uint8)
    scales = torch.randint(110, 140, (3, 40, 2), dtype=torch.uint8)
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    assert torch.equal(mxfp4(blocks, scales, torch.float32, transposed=True), want)


# ---- the FP8 GEMM path -----------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["block", "ct"])
def test_fp8_gemm_layers_hold_the_checkpoints_weights(tmp_path, kind):
    """Loaded for FP8 GEMMs (here on the CPU: the reference GEMM), each dense layer keeps the stored FP8 weight
    and a scale grid that dequantize to exactly the dequantized model's weight (q, k and v fused, each with
    its own scales); routed experts are dequantized as ever; the scores stay close (activations quantized)."""
    path = fp8_block_checkpoint(tmp_path, "qwen3_moe") if kind == "block" else ct_checkpoint(tmp_path)[0]
    plain, lp = ours(path)
    fp8_model, lp8 = ours(path, fp8_gemm=True)
    params = dict(plain.named_parameters())
    layers = [(n, m) for n, m in fp8_model.named_modules() if getattr(m, "weight", None) is not None
              and m.weight.dtype == torch.float8_e4m3fn]
    # qkv and o of 2 layers, gate_up and down of each dense MLP (qwen3_moe's layer 0 routes: its experts stay
    # dequantized)
    assert len(layers) == (6 if kind == "block" else 8)
    if kind == "block":
        assert fp8_model.layers[0].mlp.gate_up_proj.dtype == torch.float32
    for name, m in layers:
        assert m.fp8_block == ((128, 128) if kind == "block" else (1, m.in_features))
        assert torch.equal(scaled_fp8(m.weight, m.weight_scale, m.fp8_block, torch.float32), params[name + ".weight"])
    assert 0 < (lp - lp8).abs().mean() < 0.1


def test_fp8_gemm_dispatch():
    q = read_quantization({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}})
    cfg = ModelConfig.from_json({"model_type": "qwen3", **SMALL, "intermediate_size": 384})
    assert fits(q, cfg, Where("cuda", "bfloat16", (9, 0))) == (True, "FP8 tensor cores")
    assert not fits(q, cfg, Where("cpu", "float32", None))[0]
    assert not fits(q, cfg, Where("cuda", "bfloat16", (8, 0)))[0]          # A100: no FP8 tensor cores
    assert not fits(q, cfg, Where("cuda", "float16", (9, 0)))[0]
    assert not fits(q, cfg, Where("cuda", "bfloat16", (9, 0), ranks=2))[0]
    assert not fits(q, cfg, Where("cuda", "bfloat16", (9, 0), deterministic=True))[0]
    assert not fits(None, cfg, Where("cuda", "bfloat16", (9, 0)))[0]
    odd = ModelConfig.from_json({"model_type": "qwen3", **SMALL, "intermediate_size": 320})
    assert fits(q, odd, Where("cuda", "bfloat16", (9, 0)))[1] == "its scale blocks do not fit the fused q/k/v and " \
                                                        "gate/up layers"
    mx = read_quantization({"quantization_config": {"quant_method": "mxfp4"}})
    assert not fits(mx, cfg, Where("cuda", "bfloat16", (9, 0)))[0]


def test_fit_dequantizes_on_the_cpu(tmp_path):
    from lmbatch.engine.build import fit
    from lmbatch.engine.options import EngineOptions, EngineSpec

    path = fp8_block_checkpoint(tmp_path, "qwen3")
    spec, _ = fit(EngineSpec(str(path), "cpu", options=EngineOptions(None, None)), ModelConfig.from_dir(path))
    assert spec.options.fp8_gemm is False


# ---- one line for what cannot be read -------------------------------------------------------------------
def _edit(path, drop=(), change=None, config=None):
    t = load_file(path / "model.safetensors")
    for k in drop:
        del t[k]
    t.update(change or {})
    save_file(t, path / "model.safetensors", metadata={"format": "pt"})
    if config is not None:
        c = json.loads((path / "config.json").read_text())
        c.update(config)
        (path / "config.json").write_text(json.dumps(c))


def _error(path) -> str:
    with pytest.raises(UserError) as e:
        resolve_model(str(path))
    message = str(e.value)
    assert "\n" not in message
    return message


def test_unreadable_quantized_checkpoints_say_which_tensor_and_format(tmp_path):
    path = fp8_block_checkpoint(tmp_path, "qwen3")
    q = "model.layers.1.self_attn.q_proj"
    _edit(path, drop=[q + ".weight_scale_inv"])
    assert _error(path).endswith(f"model.safetensors holds {q}.weight in F8_E4M3 but not its scale "
                                 f"{q}.weight_scale_inv (fp8 (FP8 e4m3, a scale per 128x128 block: X.weight in "
                                 "F8_E4M3 beside X.weight_scale_inv))")
    _edit(path, change={q + ".weight_scale_inv": torch.ones(1, 2)})
    assert f"holds {q}.weight_scale_inv of shape [1, 2], which is not the scale grid of a [256, 256] weight" \
        in _error(path)
    _edit(path, change={q + ".weight_scale_inv": torch.ones(2, 2), q + ".weight": torch.zeros(256, 256,
                                                                                              dtype=torch.int8)})
    assert f"holds {q}.weight in I8, which fp8" in _error(path)
    _edit(path, change={q + ".weight": torch.zeros(256, 256, dtype=torch.float8_e4m3fn)},
          config={"quantization_config": {"quant_method": "awq", "bits": 4}})
    assert _error(path).endswith("config.json: quantization_config.quant_method 'awq' is not a format lmbatch "
                                 "reads (fp8, compressed-tensors, mxfp4)")
    _edit(path, config={"quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized"}})
    assert "quantization_config.format 'pack-quantized': lmbatch reads compressed-tensors FP8" in _error(path)
    c = json.loads((path / "config.json").read_text())
    del c["quantization_config"]
    (path / "config.json").write_text(json.dumps(c))
    assert _error(path).endswith("model.safetensors holds model.layers.0.mlp.down_proj.weight in F8_E4M3, not a "
                                 "float type, but config.json declares no quantization_config (fp8, "
                                 "compressed-tensors, mxfp4)")


def test_unreadable_mxfp4_scales_say_so(tmp_path):
    cfg = _qwen3_moe()
    tensors = _save_random(cfg, tmp_path / "float")
    p = "model.layers.0.mlp.experts."
    for e in range(4):
        for part in ("gate_proj", "up_proj", "down_proj"):
            del tensors[f"{p}{e}.{part}.weight"]
    tensors[p + "gate_up_proj_blocks"] = torch.zeros(4, 512, 8, 16, dtype=torch.uint8)
    tensors[p + "gate_up_proj_scales"] = torch.zeros(4, 512, 8, dtype=torch.uint8)
    tensors[p + "down_proj_blocks"] = torch.zeros(4, 256, 8, 16, dtype=torch.uint8)
    tensors[p + "down_proj_scales"] = torch.zeros(4, 256, 4, dtype=torch.uint8)
    config = json.loads((tmp_path / "float" / "config.json").read_text())
    _write(tmp_path / "mx", tensors, config, {"quant_method": "mxfp4"})
    assert _error(tmp_path / "mx").endswith(f"model.safetensors holds {p}down_proj_blocks of shape [4, 256, 8, 16], "
                                            f"whose MXFP4 scales {p}down_proj_scales must be U8 of [4, 256, 8], not "
                                            "[4, 256, 4] in U8")
