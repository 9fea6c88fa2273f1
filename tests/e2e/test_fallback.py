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
