"""The benchmarks' random checkpoints (benchmarks/random_checkpoint.py) name and shape their tensors as
transformers saves each family, and load in lmbatch as written (the quantized ones too): a benchmark's GPU
call that dies on a misnamed tensor costs its whole device time."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from conftest import TINY_CONFIGS
from safetensors import safe_open
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from random_checkpoint import tensors, write_checkpoint  # noqa: E402

FAMILIES = ["llama", "qwen2", "qwen3", "gpt_oss", "deepseek_v3"]


@pytest.mark.parametrize("family", FAMILIES)
def test_names_and_shapes_are_transformers_own(tmp_path, family):
    cfg = TINY_CONFIGS[family]()
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        saved = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert tensors(cfg.to_dict()) == saved


@pytest.mark.parametrize("family,quant", [
    ("qwen3", {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}),
    ("deepseek_v3", {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                     "weight_block_size": [128, 128]}),
    ("gpt_oss", {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "lm_head"]}),
])
def test_quantized_checkpoints_score_as_transformers_reads_them(tmp_path, family, quant):
    """lmbatch and transformers (dequantizing as it loads) read the written release alike."""
    from test_quantized import ours, theirs
    from transformers import FineGrainedFP8Config, Mxfp4Config

    cfg = {**TINY_CONFIGS[family]().to_dict(), "quantization_config": quant}
    path = write_checkpoint(json.loads(json.dumps(cfg)), tmp_path / family)
    with safe_open(next(path.glob("*.safetensors")), "pt") as f:
        kinds = {f.get_slice(k).get_dtype() for k in f.keys()}
    assert ("F8_E4M3" if quant["quant_method"] == "fp8" else "U8") in kinds
    config = FineGrainedFP8Config(dequantize=True) if quant["quant_method"] == "fp8" else Mxfp4Config(dequantize=True)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, quantization_config=config)
    _, lp = ours(path)
    assert torch.isfinite(lp).all()
    assert (lp - theirs(hf)).abs().max() < 1e-4
