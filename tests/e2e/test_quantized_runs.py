"""`lmbatch run` over a block-FP8 checkpoint (Qwen3's `-FP8` layout, made here as tests/unit/test_quantized.py
makes it, over a small trained tokenizer) on the CPU: its scores are transformers' on the dequantized model
(`FineGrainedFP8Config(dequantize=True)`), summary.json and the run's fingerprint say the checkpoint's
quantization (an unquantized model's fingerprint holds none: runs made before stay resumable), and the lm-eval
score cache's key holds it."""
from __future__ import annotations

import json

import pyarrow.parquet as pq
import torch
from baseline import first_selects, score_pairs
from conftest import make_small_tokenizer
from quantized_checkpoints import fp8_block_checkpoint
from transformers import AutoModelForCausalLM, AutoTokenizer, FineGrainedFP8Config
from typer.testing import CliRunner

from lmbatch.caches import scores
from lmbatch.cli import app
from lmbatch.frontend.workload import LoadArgs
from lmbatch.options import RunOptions
from lmbatch.programs import hellaswag
from lmbatch.programs.registry import get_workload
from lmbatch.run.identity import fingerprint

RECORD = {"method": "fp8", "weights": "FP8 e4m3, a scale per 128x128 block", "activations": "dynamic"}


def test_fp8_run_scores_and_records_its_quantization(tmp_path):
    vocab = len(make_small_tokenizer(tmp_path / "tok"))
    path = fp8_block_checkpoint(tmp_path, "qwen3", vocab_size=vocab)
    for f in (tmp_path / "tok").iterdir():
        (path / f.name).write_bytes(f.read_bytes())
    out = tmp_path / "out"
    res = CliRunner().invoke(app, ["run", "hellaswag", "--shots", "0", "--limit", "2", "--model", str(path),
                                   "--device", "cpu", "--out", str(out), "--run-id", "r", "--quiet"])
    assert res.exit_code == 0, res.output
    summary = json.loads((out / "r" / "summary.json").read_text())
    assert summary["quantization"] == {**RECORD, "run_as": "dequantized to float32 on load"}
    o = RunOptions.of(task="hellaswag", shots=0, limit=2, model=str(path))
    assert fingerprint(o, get_workload("hellaswag"), path)["quantization"] == RECORD      # a resume holds to it
    ours = pq.read_table(out / "r" / "instances.parquet").column("logprobs").to_pylist()
    tok = AutoTokenizer.from_pretrained(str(path))
    selects = first_selects(hellaswag.program, hellaswag.WORKLOAD.instances(LoadArgs(tok, shots=0, limit=2)), tok)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                              quantization_config=FineGrainedFP8Config(dequantize=True))
    base = score_pairs(hf, selects, full_logits=False)
    assert max(abs(a - b) for o, lps in zip(ours, base.logprobs) for a, b in zip(o, lps)) < 1e-4


def test_score_cache_key_holds_the_quantization(tmp_path, monkeypatch):
    path = fp8_block_checkpoint(tmp_path, "qwen3")
    key = scores.key("requests", path, "cpu", "float32", {})
    monkeypatch.setattr(scores, "declared", lambda _: {**RECORD, "activations": "static"})
    assert scores.key("requests", path, "cpu", "float32", {}) != key
    monkeypatch.setattr(scores, "declared", lambda _: None)
    assert scores.key("requests", path, "cpu", "float32", {}) != key


def test_unquantized_fingerprint_is_as_before(tiny_tok):
    o = RunOptions.of(task="hellaswag", shots=0, limit=2, model=str(tiny_tok))
    assert "quantization" not in fingerprint(o, get_workload("hellaswag"), tiny_tok)
