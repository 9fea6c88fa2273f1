"""Issue 47 item 3: a model with NaN weights scored `acc 0.5000` with NaN logprobs and no warning. A NaN score is
now no score: the instance failed with an error that says so, and the run warns (closing line, summary.json)."""
import json

import pyarrow.parquet as pq
import torch
from conftest import make_tiny_with_tokenizer
from transformers import AutoModelForCausalLM

from lmbatch.options import RunOptions
from lmbatch.results.task_results import NAN_ERROR
from lmbatch.run.run import run


def test_a_model_with_nan_weights_fails_its_instances_and_warns(tmp_path, capsys):
    model = make_tiny_with_tokenizer(tmp_path / "nan", 2048)
    m = AutoModelForCausalLM.from_pretrained(model)
    with torch.no_grad():
        m.model.norm.weight[0] = float("nan")           # every position's logits NaN
    m.save_pretrained(model)
    out = run(RunOptions.of(task="mmlu", shots=1, limit=2, subjects=["anatomy", "virology"], model=str(model),
                         out=tmp_path / "runs", run_id="nan", device="cpu"))
    s = json.loads((out / "summary.json").read_text())
    assert (s["counts"]["instances"], s["counts"]["failed_instances"]) == (4, 4)
    assert s["accuracy"] is None and s["metrics"] == {}
    assert s["warnings"] == ["4 of 4 instances scored NaN and count as failed: the model computes NaN (its "
                             "weights, or its numerics in this dtype, are broken)"]
    rows = pq.read_table(out / "instances.parquet").to_pylist()
    assert all(r["error"].startswith(NAN_ERROR) and "log-probabilities" in r["error"] and r["metrics"] == []
               and r["correct"] is None for r in rows), rows[0]["error"]
    last = capsys.readouterr().err.replace("\r", "\n").strip().splitlines()[-1]
    assert "4 FAILED" in last and f"  WARNING: {s['warnings'][0]}" in last, last
