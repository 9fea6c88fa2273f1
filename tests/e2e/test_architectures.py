"""Every natively supported architecture end to end: a tiny random checkpoint of each (made here with
transformers' config class and save_pretrained, over a small trained byte-level tokenizer) scored by
`lmbatch run hellaswag` on the CPU in float32 gives transformers' log-softmax continuation scores,
with lm-eval's context/continuation split. The 2-shot prompts (~300 tokens) are far longer than
the sliding windows of the windowed configs."""
from __future__ import annotations

import pyarrow.parquet as pq
import pytest
from baseline import first_selects, score_pairs
from conftest import TINY_CONFIGS, make_small_tokenizer, make_tiny_hf
from transformers import AutoModelForCausalLM, AutoTokenizer
from typer.testing import CliRunner

from lmbatch.cli import app
from lmbatch.frontend.workload import LoadArgs
from lmbatch.model.config import ARCHITECTURES
from lmbatch.programs import hellaswag

SHOTS, LIMIT = 2, 3


def _checkpoint(kind: str, path) -> AutoModelForCausalLM:
    """The tiny parity config of `kind` over the small tokenizer, its window (if any) 48 tokens."""
    window = {"sliding_window": 48} if getattr(TINY_CONFIGS[kind](), "sliding_window", None) else {}
    return make_tiny_hf(kind, path, vocab_size=len(make_small_tokenizer(path)), max_position_embeddings=2048,
                        bos_token_id=1, eos_token_id=2, pad_token_id=0, **window)


def test_every_architecture_has_a_tiny_config():
    assert set(ARCHITECTURES) <= {TINY_CONFIGS[k]().model_type for k in TINY_CONFIGS}


@pytest.mark.parametrize("kind", [k for k in TINY_CONFIGS if k in ARCHITECTURES and k != "llama"])
def test_lmbatch_run_scores_as_transformers(kind, tmp_path):
    hf = _checkpoint(kind, tmp_path / "model")
    out = tmp_path / "out"
    res = CliRunner().invoke(app, ["run", "hellaswag", "--shots", str(SHOTS), "--limit", str(LIMIT), "--model",
                                   str(tmp_path / "model"), "--device", "cpu", "--out", str(out), "--run-id", "r",
                                   "--quiet"])
    assert res.exit_code == 0, res.output
    ours = pq.read_table(out / "r" / "instances.parquet").column("logprobs").to_pylist()
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "model"))
    insts = hellaswag.WORKLOAD.instances(LoadArgs(tok, shots=SHOTS, limit=LIMIT))
    selects = first_selects(hellaswag.program, insts, tok)
    assert max(len(c.context) for c in selects) > 48 * 4
    base = score_pairs(hf, selects, full_logits=False)
    worst = max(abs(a - b) for o, lps in zip(ours, base.logprobs) for a, b in zip(o, lps))
    assert worst < 1e-4, worst
