"""Architectures network.py does not implement run through transformers (lmbatch/model/fallback.py): a tiny
random GPT-NeoX (Pythia: partial rotary, parallel residual) and GPT-2 (learned positions, `GPT2LMHeadModel`)
checkpoint over the small trained tokenizer, scored by `lmbatch run hellaswag` on the CPU in float32, give
transformers' own log-softmax continuation scores (lm-eval's context/continuation split) with the plan's
optimal prefix reuse; an encoder-only folder is a one-line error."""
from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
import torch
from baseline import first_selects, score_pairs
from conftest import make_small_tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer, BertConfig, BertForMaskedLM, GPT2Config, GPTNeoXConfig
from typer.testing import CliRunner

from lmbatch.cli import app
from lmbatch.frontend.workload import LoadArgs
from lmbatch.model.config import ARCHITECTURES
from lmbatch.programs import hellaswag

SHOTS, LIMIT = 2, 3
SPECIAL = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
CONFIGS = {
    "gpt_neox": lambda vocab: GPTNeoXConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                                            num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=2048,
                                            rotary_pct=0.25, tie_word_embeddings=False, **SPECIAL),
    "gpt2": lambda vocab: GPT2Config(vocab_size=vocab, n_embd=64, n_layer=2, n_head=4, n_positions=2048, **SPECIAL),
}


def make_tiny(kind: str, path, seed: int = 0):
    """A tiny random `kind` over the small tokenizer, saved to `path`; every weight drawn at random."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(CONFIGS[kind](len(make_small_tokenizer(path))), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            norm = ("norm" in name or ".ln_" in name) and name.endswith("weight")
            p.copy_(1 + 0.1 * torch.randn_like(p) if norm else 0.08 * torch.randn_like(p))
    model.eval().save_pretrained(path)
    return model


def _run(model, out, *extra):
    return CliRunner().invoke(app, ["run", "hellaswag", "--shots", str(SHOTS), "--limit", str(LIMIT), "--model",
                                    str(model), "--device", "cpu", "--out", str(out), "--run-id", "r", *extra])


def _parity(hf, model, out):
    """The run's scores against transformers' own, with lm-eval's context/continuation split."""
    ours = pq.read_table(out / "r" / "instances.parquet").column("logprobs").to_pylist()
    tok = AutoTokenizer.from_pretrained(str(model))
    insts = hellaswag.WORKLOAD.instances(LoadArgs(tok, shots=SHOTS, limit=LIMIT))
    base = score_pairs(hf, first_selects(hellaswag.program, insts, tok))
    assert [len(o) for o in ours] == [len(b) for b in base.logprobs]
    worst = max(abs(a - b) for o, lps in zip(ours, base.logprobs) for a, b in zip(o, lps))
    assert worst < 1e-4, worst


def _notice(res) -> str:
    lines = [ln for ln in res.stderr.splitlines() if "transformers fallback (slower" in ln]
    assert len(lines) == 1, res.stderr
    return lines[0]


# issue 58: a native model_type's checkpoint with what lmbatch's network lacks runs on the fallback, saying why
NOT_NATIVE = {
    # a tensor transformers' Llama has (mlp_bias) and lmbatch's network has no place for
    "llama-mlp-bias": ({"mlp_bias": True}, ".mlp.down_proj.bias, which transformers' llama model of this "
                                            "config.json has and lmbatch's network has no place for"),
    # a feature: a RoPE lmbatch does not compute
    "llama-dynamic-rope": ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}},
                           "rope type 'dynamic' is not supported (default, linear, llama3, yarn)"),
    # weights lmbatch's network does not read
    "llama-pickles": ({}, "its weights are PyTorch pickles (pytorch_model*.bin), which lmbatch's network does not "
                          "read"),
}


@pytest.mark.parametrize("case", list(NOT_NATIVE))
def test_what_the_network_lacks_runs_on_the_fallback_saying_why(case, tmp_path):
    from conftest import make_tiny_hf

    changes, why = NOT_NATIVE[case]
    model, out = tmp_path / "model", tmp_path / "out"
    hf = make_tiny_hf("llama", model, vocab_size=len(make_small_tokenizer(model)), max_position_embeddings=2048,
                      **SPECIAL, **changes)
    if case == "llama-pickles":
        torch.save(hf.state_dict(), model / "pytorch_model.bin")
        (model / "model.safetensors").unlink()
    res = _run(model, out)
    assert res.exit_code == 0, res.output
    notice = _notice(res)
    assert notice.startswith(f"lmbatch: model at {model} runs on the transformers fallback (slower; no decode "
                             "graphs or tensor parallelism): ") and notice.endswith(why), notice
    summary = json.loads((out / "r" / "summary.json").read_text())
    assert (summary["model_runtime"], summary["model_type"]) == ("transformers", "llama")
    _parity(hf, model, out)


def test_latent_attention_the_network_cannot_run_is_one_line(tmp_path):
    """A DeepSeek-V3 checkpoint with a RoPE lmbatch lacks cannot go to the fallback either (its KV pool holds
    keys and values, not a latent): one line saying both, before any data is loaded."""
    from conftest import make_tiny_hf

    model, out = tmp_path / "model", tmp_path / "out"
    make_tiny_hf("deepseek_v3", model, vocab_size=len(make_small_tokenizer(model)),
                 rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    res = _run(model, out)
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert lines == [f"error: model at {model}: lmbatch's network does not run it (rope type 'dynamic' is not "
                     "supported (default, linear, llama3, yarn)), and the transformers fallback cannot either: its "
                     "multi-head latent attention caches a latent per token, not keys and values of (kv heads, "
                     "head dim), so the fallback's KV pool cannot hold them"], res.stderr
    assert "Traceback" not in res.output and not (out / "r").exists()


def test_a_stray_tensor_is_still_a_broken_checkpoint(tmp_path):
    """A tensor neither lmbatch's network nor transformers' model has a place for is not a feature to fall back
    for (transformers would drop it silently): one line naming it."""
    from conftest import make_tiny_hf
    from safetensors.torch import load_file, save_file

    model = tmp_path / "model"
    make_tiny_hf("llama", model, vocab_size=len(make_small_tokenizer(model)))
    tensors = load_file(str(model / "model.safetensors"))
    save_file({**tensors, "model.layers.0.mlp.stray.weight": torch.zeros(4)}, str(model / "model.safetensors"),
              metadata={"format": "pt"})
    res = _run(model, tmp_path / "out")
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "holds model.layers.0.mlp.stray.weight, which a llama model of this config.json " \
        "has no place for" in lines[0], res.stderr


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_fallback_scores_as_transformers(kind, tmp_path):
    assert kind not in ARCHITECTURES
    hf = make_tiny(kind, tmp_path / "model")
    out = tmp_path / "out"
    res = CliRunner().invoke(app, ["run", "hellaswag", "--shots", str(SHOTS), "--limit", str(LIMIT), "--model",
                                   str(tmp_path / "model"), "--device", "cpu", "--out", str(out), "--run-id", "r"])
    assert res.exit_code == 0, res.output
    closing = [ln for ln in res.stderr.splitlines() if ln.strip()][-1]
    assert f"  transformers fallback {kind}  -> " in closing, closing
    assert _notice(res).endswith(f": model_type {kind!r} is not one lmbatch's network implements")
    summary = json.loads((out / "r" / "summary.json").read_text())
    assert (summary["model_runtime"], summary["model_type"]) == ("transformers", kind)
    assert summary["hit_rate"] > 0.5
    assert summary["hit_rate"] == pytest.approx(summary["optimal_hit_rate"], abs=1e-12)
    assert summary["tokens"]["computed"] == summary["tokens"]["unique"]
    ours = pq.read_table(out / "r" / "instances.parquet").column("logprobs").to_pylist()
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "model"))
    insts = hellaswag.WORKLOAD.instances(LoadArgs(tok, shots=SHOTS, limit=LIMIT))
    selects = first_selects(hellaswag.program, insts, tok)
    base = score_pairs(hf, selects)
    assert [len(o) for o in ours] == [len(b) for b in base.logprobs]
    worst = max(abs(a - b) for o, lps in zip(ours, base.logprobs) for a, b in zip(o, lps))
    assert worst < 1e-4, worst


def test_encoder_only_model_is_a_one_line_error(tmp_path):
    cfg = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    BertForMaskedLM(cfg).save_pretrained(tmp_path / "bert")
    r = CliRunner().invoke(app, ["run", "hellaswag", "--limit", "1", "--model", str(tmp_path / "bert"),
                                 "--device", "cpu", "--out", str(tmp_path / "out")])
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    for needle in ("BertForMaskedLM (bert)", "causal LMs", "natively llama, qwen2", "through transformers"):
        assert needle in lines[0], lines[0]
    assert not (tmp_path / "out").exists()
