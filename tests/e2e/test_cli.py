"""The CLI end to end on a tiny random model with a small trained tokenizer: outputs, user errors, report."""
import json
import os

import pyarrow.parquet as pq
import pytest
import torch
from conftest import make_tiny_with_tokenizer
from typer.testing import CliRunner

from lmbatch.cli import app
from lmbatch.timing import MAIN_LINE

runner = CliRunner()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_with_tokenizer(tmp_path_factory.mktemp("tiny"), 2048)


def lmbatch(*args):
    return runner.invoke(app, [str(a) for a in args])


def run_args(model, out, run_id, *extra):
    return ["run", "mmlu", "--shots", 2, "--limit", 1, "--subjects", "anatomy", "--subjects", "virology",
            "--model", model, "--out", out, "--run-id", run_id, "--quiet", *extra]


def test_run_writes_complete_outputs(tiny, tmp_path):
    r = lmbatch(*run_args(tiny, tmp_path, "a", "--save-token-ids"))
    assert r.exit_code == 0, r.output
    d = tmp_path / "a"
    assert sorted(p.name for p in d.iterdir()) == ["instances.parquet", "requests.parquet", "summary.json"]
    s = json.loads((d / "summary.json").read_text())
    assert s["counts"] == {"instances": 2, "failed_instances": 0, "scored_instances": 2, "calls": 2, "requests": 8,
                           "executed_requests": 2, "waves": 1, "truncated_calls": 0, "resumed_instances": 0}
    assert s["metric_counts"] == {"acc": 2} and s["accuracy_by_subject_counts"] == {"anatomy": 1, "virology": 1}
    assert len(s["attempts"]) == 1 and s["attempts"][0]["instances"] == 2
    assert {k: v["rows"] for k, v in s["files"].items()} == {"instances.parquet": 2, "requests.parquet": 2}
    assert s["hit_rate"] == pytest.approx(s["optimal_hit_rate"], abs=1e-12)
    assert s["tokens"]["computed"] == s["tokens"]["unique"]
    assert set(s["accuracy_by_subject"]) == {"anatomy", "virology"}
    assert s["options"]["shots"] == 2 and s["dtype"] == "float32"
    assert (s["model_runtime"], s["model_type"]) == ("native", "llama")
    inst = pq.read_table(d / "instances.parquet").to_pylist()
    assert [row["id"] for row in inst] == ["anatomy/0", "virology/0"]
    assert all(len(row["logprobs"]) == 4 and row["prediction"] == str(max(range(4), key=row["logprobs"].__getitem__))
               for row in inst)
    assert all((row["prediction"] == row["gold"]) == row["correct"] for row in inst)    # comparable as they are
    assert all(json.loads(row["inputs"])["context"].endswith("Answer:") for row in inst)   # the prompt text
    reqs = pq.read_table(d / "requests.parquet").to_pylist()
    assert [row["choices"] for row in reqs] == [[0, 1, 2, 3]] * 2
    assert sum(row["prompt_tokens"] for row in reqs) == s["tokens"]["prompt"]
    assert all(len(row["token_ids"]) == row["prompt_tokens"] for row in reqs)
    assert not list(tmp_path.glob(".*.tmp")) and not list(d.glob(".*.tmp"))


def _error(r, *needles):
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    for n in needles:
        assert n in lines[0]


def test_unknown_task_lists_known_ones(tmp_path):
    _error(lmbatch("run", "mmlux", "--out", tmp_path), "unknown task 'mmlux'", "mmlu")


def test_too_many_shots(tmp_path):
    _error(lmbatch("run", "mmlu", "--shots", 6, "--out", tmp_path), "--shots 6", "5")


def test_missing_model_path(tmp_path):
    _error(lmbatch("run", "mmlu", "--model", tmp_path / "nope", "--out", tmp_path), "does not exist")


def test_model_that_is_not_a_causal_lm(tmp_path):
    (tmp_path / "bert").mkdir()
    (tmp_path / "bert" / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertModel"]}))
    _error(lmbatch("run", "mmlu", "--model", tmp_path / "bert", "--out", tmp_path), "bert")


def test_prompt_longer_than_context_names_the_instance(tmp_path):
    short = make_tiny_with_tokenizer(tmp_path / "short", 64)
    _error(lmbatch(*run_args(short, tmp_path, "x")), "instance anatomy/0", "--truncate-left")
    assert not (tmp_path / "x").exists()
    r = lmbatch(*run_args(short, tmp_path, "x", "--truncate-left"))
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "x" / "summary.json").read_text())["counts"]["truncated_calls"] == 2


def test_existing_output_dir_needs_overwrite(tiny, tmp_path):
    assert lmbatch(*run_args(tiny, tmp_path, "a")).exit_code == 0
    before = (tmp_path / "a" / "summary.json").read_text()
    _error(lmbatch(*run_args(tiny, tmp_path, "a")), "exists", "--overwrite")
    assert (tmp_path / "a" / "summary.json").read_text() == before
    r = lmbatch(*run_args(tiny, tmp_path, "a", "--overwrite", "--schedule", "random"))
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "a" / "summary.json").read_text())["options"]["schedule"] == "random"


def test_bad_option_values(tmp_path):
    _error(lmbatch("run", "mmlu", "--schedule", "lifo", "--out", tmp_path), "--schedule lifo")
    _error(lmbatch("run", "mmlu", "--dtype", "int4", "--out", tmp_path), "--dtype int4")
    _error(lmbatch("run", "mmlu", "--threads", 0, "--out", tmp_path), "--threads 0: use a number of threads")
    _error(lmbatch("run", "mmlu", "--subjects", "astrology", "--out", tmp_path), "astrology")


def test_shots_limit_and_subjects_are_checked_once_before_any_work(tmp_path):
    """options.check is the one check of --shots, --limit and --subjects: the data modules trust it."""
    _error(lmbatch("run", "hellaswag", "--shots", 10042, "--out", tmp_path),
           "--shots 10042 needs more than the 10042 HellaSwag validation docs")
    _error(lmbatch("run", "hellaswag", "--shots", -1, "--out", tmp_path), "--shots must be at least 0")
    _error(lmbatch("run", "mmlu", "--subjects", "abstract_algebra", "--subjects", "astrology", "--out", tmp_path),
           "unknown MMLU subject 'astrology'; valid: abstract_algebra, ", "world_religions")
    _error(lmbatch("run", "json", "--subjects", "anatomy", "--out", tmp_path), "--subjects applies to mmlu only")
    for task in ("mmlu", "hellaswag", "tot-gsm8k", "json"):
        _error(lmbatch("run", task, "--limit", -1, "--out", tmp_path), "--limit must be at least 1")


def test_run_options_are_the_fields_of_RunOptions():
    """Each `lmbatch run` option is declared once, as a field of one of RunOptions' records (workload, engine,
    output): flag, default and help come from it."""
    import dataclasses

    import typer.main

    from lmbatch.options import option_fields

    negated = ("jump_forward", "workload_cache")        # flags --no-jump-forward, --no-workload-cache

    def name(f: dataclasses.Field) -> str:
        return "no_" + f.name if f.name in negated else f.name

    params = {p.name: p for p in typer.main.get_command(app).commands["run"].params}
    fields = [f for _, f in option_fields()]
    assert [p for p in params if p != "help"] == [name(f) for f in fields]
    for f in fields:
        p = params[name(f)]
        assert p.help == f.metadata["help"] and p.help
        assert p.default == (None if f.name == "task" else False if f.name in negated else f.default)
    assert params["no_jump_forward"].opts == ["--no-jump-forward"] and params["no_jump_forward"].is_flag
    assert params["no_cache"].opts == ["--no-cache"] and params["no_cache"].is_flag
    assert not params["no_cache"].secondary_opts and not params["dry_run"].secondary_opts
    assert params["subjects"].multiple and params["max_tokens_per_batch"].opts == ["--max-tokens-per-batch"]
    assert params["shots"].default == 0 and params["device"].default == "auto" and params["schedule"].default == "dfs"
    help_text = lmbatch("run", "--help").output
    assert "--no-jump-forward" in help_text and "--kv-cache-tokens" in help_text and "[default: dfs]" in help_text


def test_every_option_is_declared_as_every_typer_reads_it():
    """Each option's flag is spelled out and no metavar is its option's name: typer 0.27.0-0.27.3 named an
    option after a metavar equal to it (--DTYPE), and --dtype was "No such option". tools/smoke_cli.py parses
    every option on the oldest typer too (tools/smoke.sh --oldest)."""
    import typer.main

    command = typer.main.get_command(app)
    for sub in ("run", "report"):
        for p in command.commands[sub].params:
            names = {o.lstrip("-").lower() for o in p.opts} | {p.name.lower().replace("_", "-")}
            assert (p.metavar or "").lower().replace("_", "-") not in names, (sub, p.name, p.metavar)
    run_opts = {p.name: p.opts for p in command.commands["run"].params}
    assert run_opts["dtype"] == ["--dtype"] and run_opts["checkpoint_s"] == ["--checkpoint-s"]
    assert lmbatch("run", "-h").exit_code == 0 and "--dtype" in lmbatch("run", "-h").output


def test_report_and_compare_exit_codes(tiny, tmp_path):
    for name, extra in (("base", []), ("nocache", ["--no-cache"])):
        assert lmbatch(*run_args(tiny, tmp_path, name, *extra)).exit_code == 0
    r = lmbatch("report", tmp_path / "base", tmp_path / "nocache", "--format", "markdown")
    assert r.exit_code == 0 and "| base " in r.output and "| nocache " in r.output
    rows = json.loads(lmbatch("report", tmp_path / "base", "--format", "json").output)
    assert rows[0]["hit_ratio"] == pytest.approx(1.0)
    same = lmbatch("report", "--compare", tmp_path / "base", tmp_path / "base")
    assert same.exit_code == 0, same.output
    # no cache: achieved hit rate 0 against a positive optimum is a regression
    worse = lmbatch("report", "--compare", tmp_path / "base", tmp_path / "nocache", "--max-slowdown", 100)
    assert worse.exit_code == 1 and "REGRESSION hit rate" in worse.output
    _error(lmbatch("report", tmp_path / "missing"), "not an lmbatch run directory")


def test_report_of_real_runs_stderr_paired_compare_and_html(tiny, tmp_path):
    """Issue 39 on real runs (written by lmbatch run, no tasks block): the task's view derived from
    instances.parquet equals the summary's metrics, its standard error lm-eval's formula over the instances; a
    candidate scheduled otherwise scores the same instances the same (McNemar p 1); the HTML report of both."""
    from conftest import assert_self_contained_html

    from lmbatch.results.runs import load_run
    from lmbatch.results.stats import mean_stderr

    for name, extra in (("base", []), ("random", ["--schedule", "random"])):
        r = lmbatch("run", "mmlu", "--shots", 1, "--limit", 3, "--subjects", "anatomy", "--subjects", "virology",
                    "--model", tiny, "--out", tmp_path, "--run-id", name, "--quiet", *extra)
        assert r.exit_code == 0, r.output
    base = load_run(tmp_path / "base")
    task = base.tasks["mmlu"]
    acc = [m["acc"] for m in pq.read_table(tmp_path / "base" / "instances.parquet").to_pydict()["metrics"]
           for m in [dict(m)]]
    assert (task.n, task.failed, task.primary_metric) == (6, 0, "acc")
    assert task.metrics["acc"] == pytest.approx((base.summary.metrics or {})["acc"]) and len(acc) == 6
    assert task.stderr["acc"] == pytest.approx(mean_stderr(acc))
    rows = json.loads(lmbatch("report", tmp_path / "base", "--format", "json").output)
    assert rows[0]["accuracy_stderr"] == pytest.approx(mean_stderr(acc))
    html = tmp_path / "report.html"
    r = lmbatch("report", "--compare", tmp_path / "base", tmp_path / "random", "--max-slowdown", 100, "--html", html)
    assert r.exit_code == 0, r.output
    assert r.output.splitlines()[2].endswith("over 6 instances: 0 worse, 0 better; McNemar mid-p p=1) ok")
    assert_self_contained_html(html.read_text(encoding="utf-8"), plots=5)


def test_tasks_lists_the_builtin_workloads():
    r = lmbatch("tasks")
    assert r.exit_code == 0
    tasks, _, suites = r.output.partition("\n\nsuites")
    olmes = [f"{t}:{f}" for t in ("arc_challenge", "arc_easy", "boolq", "csqa", "hellaswag", "openbookqa", "piqa",
                                  "socialiqa", "winogrande") for f in ("rc", "mc")]
    assert [line.split()[0] for line in tasks.splitlines()] == ["hellaswag", "json", "mmlu", "tot-gsm8k", *olmes]
    assert "acc_per_char" in tasks.splitlines()[4]      # arc_challenge:rc's primary metric
    rows = {line.split()[0]: line for line in suites.splitlines()[1:]}
    assert list(rows) == ["olmes", "olmes:rc", "olmes:mc"]
    assert all(t in rows["olmes"] for t in olmes) and rows["olmes"].endswith("mmlu 5-shot")
    assert "winogrande:rc" in rows["olmes:rc"] and "winogrande:mc" not in rows["olmes:rc"]


PHASES = {"startup", "model_files", "data", "tokenize", "plan", "load", "execute", "write", "total"}


@pytest.mark.parametrize("task,extra", [
    ("mmlu", ["--shots", 2, "--limit", 3, "--subjects", "anatomy", "--subjects", "virology"]),
    ("hellaswag", ["--shots", 1, "--limit", 6]),
])
def test_dry_run_figures_equal_the_real_runs(tiny, tmp_path, task, extra):
    # not from the workload cache, which another run may have filled: a cached dry run tokenizes and plans nothing
    dry = lmbatch("run", task, *extra, "--model", tiny, "--out", tmp_path, "--run-id", "d", "--dry-run",
                  "--no-workload-cache")
    assert dry.exit_code == 0, dry.output
    plan = json.loads(dry.stdout)
    assert not (tmp_path / "d").exists(), "a dry run writes no run directory"
    r = lmbatch("run", task, *extra, "--model", tiny, "--out", tmp_path, "--run-id", "r", "--quiet")
    assert r.exit_code == 0, r.output
    s = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert plan["instances"] == s["counts"]["instances"]
    assert plan["requests"] == s["counts"]["requests"]
    assert plan["executed_requests"] == s["counts"]["executed_requests"]
    assert plan["prompt_tokens"] == s["tokens"]["prompt"]
    assert plan["unique_tokens"] == s["tokens"]["unique"] == s["tokens"]["computed"]
    assert plan["optimal_hit_rate"] == pytest.approx(s["optimal_hit_rate"], abs=1e-12)
    assert plan["flops"] > 0
    assert {"startup", "model_files", "data", "tokenize", "plan", "total"} <= set(plan["time_s"])
    assert "load" not in plan["time_s"] and "execute" not in plan["time_s"]


def test_summary_times_every_phase_and_names_the_device(tiny, tmp_path):
    assert lmbatch(*run_args(tiny, tmp_path, "a")).exit_code == 0
    s = json.loads((tmp_path / "a" / "summary.json").read_text())
    t = s["time_s"]
    assert PHASES <= set(t), t
    assert sum(v for k, v in t.items() if k in MAIN_LINE) <= t["total"] + 1e-6     # the model's side overlaps them
    assert s["device"] == "cpu" and s["options"]["device"] == "auto"      # no GPU in CI
    assert s["max_tokens_per_batch"] == 4096
    threads = s["threads"]          # issue 57: the CPU thread policy and what it did, every forward batch counted
    assert threads["given"] is None and threads["policy"].startswith("the cores other processes leave free")
    assert threads["wait_policy"] == os.environ.get("OMP_WAIT_POLICY", "PASSIVE")      # a user's own setting wins
    assert sum(threads["batches_by_threads"].values()) == s["forward_batches"]
    assert lmbatch(*run_args(tiny, tmp_path, "one", "--threads", 1)).exit_code == 0
    s = json.loads((tmp_path / "one" / "summary.json").read_text())
    assert s["options"]["threads"] == 1 and s["threads"]["given"] == 1
    assert s["threads"]["batches_by_threads"] == {"1": s["forward_batches"]}


def test_device_and_dtype_combinations_that_cannot_run(tiny, tmp_path):
    _error(lmbatch(*run_args(tiny, tmp_path, "x", "--device", "tpu")), "--device tpu")
    _error(lmbatch(*run_args(tiny, tmp_path, "x", "--device", "cpu", "--dtype", "float16")), "float16", "CPU")
    _error(lmbatch(*run_args(tiny, tmp_path, "x", "--max-tokens-per-batch", 0)), "--max-tokens-per-batch")
    _error(lmbatch(*run_args(tiny, tmp_path, "x", "--kv-cache-tokens", 100)), "--kv-cache-tokens 100", "needs")
    if not torch.cuda.is_available():
        _error(lmbatch(*run_args(tiny, tmp_path, "x", "--device", "cuda")), "no CUDA GPU")
    assert not (tmp_path / "x").exists()


def test_lm_eval_without_lm_eval_installed_is_one_line(monkeypatch):
    """Without lm-eval, `lmbatch lm-eval` says in one line how to install it (exit 2)."""
    import sys

    import lmbatch.lm_eval

    for name in [m for m in sys.modules if m == "lm_eval" or m.startswith("lm_eval.")] + ["lm_eval"]:
        monkeypatch.setitem(sys.modules, name, None)             # import lm_eval... -> ImportError
    for module in ("backend", "command"):
        monkeypatch.delitem(sys.modules, f"lmbatch.lm_eval.{module}", raising=False)
        monkeypatch.delattr(lmbatch.lm_eval, module, raising=False)   # as if never imported
    res = CliRunner().invoke(app, ["lm-eval", "--tasks", "hellaswag"])
    assert res.exit_code == 2
    assert res.output.strip().count("\n") == 0 and "pip install -e '.[lm-eval]'" in res.output


def test_lm_eval_tasks_writes_the_offline_task_files(tmp_path):
    """Issue 57: `lmbatch lm-eval-tasks DIR` writes the files `write_offline_tasks` writes (the same bytes), each
    including a file of lm-eval's and reading files that exist; the function is importable from the package
    (lazily: importing the package loads none of its modules) and from backend, its old home."""
    import importlib

    from lmbatch.lm_eval import write_offline_tasks as package_level
    from lmbatch.lm_eval.backend import write_offline_tasks as old_home
    from lmbatch.lm_eval.offline import TASKS, write_offline_tasks

    assert package_level is old_home is write_offline_tasks
    with pytest.raises(AttributeError):
        importlib.import_module("lmbatch.lm_eval").no_such_name  # noqa: B018
    r = lmbatch("lm-eval-tasks", tmp_path / "cli" / "tasks")
    assert r.exit_code == 0, r.output
    assert r.output.startswith(f"wrote {', '.join(TASKS)} ")
    assert f"--include_path {tmp_path / 'cli' / 'tasks'}" in r.output
    assert write_offline_tasks(tmp_path / "py") == list(TASKS)
    cli = {p.name: p.read_bytes() for p in (tmp_path / "cli" / "tasks").iterdir()}
    assert cli == {p.name: p.read_bytes() for p in (tmp_path / "py").iterdir()}
    assert len(cli) == len(TASKS) + 57 and {f"{t}.yaml" for t in TASKS} <= set(cli)
    for text in cli.values():
        spec = json.loads(text)
        assert "include" not in spec or os.path.isfile(spec["include"])
        files = spec.get("dataset_kwargs", {}).get("data_files", {}).values()
        assert all(os.path.isfile(f) for f in files) and ("include" not in spec or files)


def test_lm_eval_tasks_bad_places_and_no_lm_eval_are_one_line(tmp_path, monkeypatch):
    import sys

    (tmp_path / "f").write_text("keep me")
    _error(lmbatch("lm-eval-tasks", tmp_path / "f"), "is a file")
    _error(lmbatch("lm-eval-tasks", tmp_path / "f" / "sub"), "cannot write the task files into")
    _error(lmbatch("lm-eval-tasks", ""), "name a folder")
    assert (tmp_path / "f").read_text() == "keep me" and sorted(p.name for p in tmp_path.iterdir()) == ["f"]
    monkeypatch.setitem(sys.modules, "lm_eval", None)
    _error(lmbatch("lm-eval-tasks", tmp_path / "t"), "lm-eval is not installed", "pip install -e '.[lm-eval]'")
    assert not (tmp_path / "t").exists()


def _out_is_a_file(tmp_path):
    (tmp_path / "f").write_text("keep me")
    return ["--out", tmp_path / "f"], ["--out", "is a file"]


def _out_under_a_file(tmp_path):
    (tmp_path / "f").write_text("keep me")
    return ["--out", tmp_path / "f" / "sub"], ["--out", "is not writable"]


@pytest.mark.parametrize("case", [_out_is_a_file, _out_under_a_file])
def test_bad_output_places_fail_before_any_work(tiny, tmp_path, case):
    """Issue 22's bad inputs: one line, exit 2, nothing else touched; the output place is checked
    before the model loads (the results used to be lost after all the model work)."""
    extra, needles = case(tmp_path)
    r = lmbatch(*run_args(tiny, tmp_path, "x")[:-5], "--run-id", "x", "--quiet", *extra)
    _error(r, *needles)
    assert (tmp_path / "f").read_text() == "keep me"


def test_report_of_a_summary_that_is_not_text(tmp_path):
    (tmp_path / "summary.json").write_bytes(b'{"run_id": "\xff"}')
    _error(lmbatch("report", tmp_path), "not UTF-8")


def test_help_shows_flags_as_flags():
    out = lmbatch("run", "--help").output
    flags = [ln for ln in out.splitlines() if any(f in ln for f in ("--quiet", "--overwrite", "--dry-run"))]
    assert len(flags) == 3 and not any("<bool>" in ln for ln in flags) and "{task}" not in out
    assert "--quiet" in out and "mmlu: 0 to 5" in " ".join(out.split())


@pytest.mark.parametrize("command", [[], ["run"], ["report"], ["tasks"]])
def test_help_shows_metavars_never_type_labels(command):
    """Issue 47 (8g): typer 0.29 labels -h/--help `<bool>` and an argument `<str>` or `<list[Path]>`
    (0.27: `<str>`, `<path>`); help shows each option's metavar and each argument's name alone, on both
    (cli._plain_help; pyproject's range holds both)."""
    import re

    out = lmbatch(*command, "--help").output
    assert out.startswith("\n Usage: ") or "Usage: " in out
    labels = re.findall(r"<(?:bool|str|int|float|path|list\[[^]]*\]|Path)>", out)
    assert not labels, out
    if command == ["run"]:
        assert re.search(r"\*\s+TASK\|FILE\.py\s+Task name", out), out
        assert re.search(r"--shots\s+N\s+Few-shot", out) and re.search(r"--help\s+-h\s+Show this", out), out
    if command == ["report"]:
        assert re.search(r"RUN_DIR\s+Run directories", out), out


def test_progress_shows_phases_then_tokens_of_model_work(tiny, tmp_path):
    """Issue 22, item 8: the bar counts prompt tokens computed (not programs, which were all queued
    in the first second) and ends at the run's computed total; the phases before say what runs."""
    r = lmbatch(*run_args(tiny, tmp_path, "p")[:-1])         # without --quiet
    assert r.exit_code == 0, r.output
    err = r.stderr.replace("\r", "\n")
    s = json.loads((tmp_path / "p" / "summary.json").read_text())
    assert ("lmbatch: mmlu: loading, tokenizing and planning" in err or "mmlu: reading the cached workload" in err) \
        and "first-stage calls planned" in err
    bars = [ln for ln in err.splitlines() if ln.startswith("execute:")]
    assert bars and "tok/s" in bars[-1] and "hit=" in bars[-1]
    computed = s["tokens"]["computed"]
    assert f"{computed}/{computed}" in bars[-1], bars[-1]
    assert err.index("planned") < err.index("execute:") < err.index("hit rate")


def test_token_progress_over_waves():
    from types import SimpleNamespace as NS

    from lmbatch.run.progress import TokenProgress

    p = TokenProgress(disable=True)
    first = NS(computed_tokens=40, cached_tokens=0, unique_tokens=100, decode_tokens=0, decoding_tokens=0,
               decode_budget=0)    # a wave's counts (no generation)
    p(0, first)
    assert (p.n, p.bar.total) == (40, 100)
    first.computed_tokens, first.cached_tokens = 90, 10
    p(1, first)
    p(0, NS(computed_tokens=5, cached_tokens=30, unique_tokens=20, decode_tokens=7, decoding_tokens=0,
            decode_budget=7))    # the next wave's: a generation of 7 tokens, ended
    assert p.computed == 90                      # a prefix cached by an earlier wave: less to compute
    assert (p.n, p.bar.total) == (90 + 5 + 7, 90 + 20 + 7)
    p.close()
    assert (p.n, p.bar.total) == (102, 102)


def test_a_small_runs_bar_ends_at_its_hit_rate(capsys):
    """Issue 47 (8f): a run done before the bar's first redraw ended at hit=0.0000 (the postfix of its first
    request). The bar's last postfix is the run's hit rate, over every wave, and its decoded tokens."""
    from types import SimpleNamespace as NS

    from lmbatch.run.progress import TokenProgress

    p = TokenProgress()
    stats = NS(computed_tokens=10, cached_tokens=0, unique_tokens=40, decode_tokens=0, decoding_tokens=0,
               decode_budget=8)
    p(0, stats)                                             # drawn: nothing cached yet
    stats.computed_tokens, stats.cached_tokens, stats.decode_tokens = 40, 60, 3     # within REDRAW_S
    p(5, stats)
    p.close()
    assert p.bar.postfix == "hit=0.6000, decoded=3", p.bar.postfix
    err = capsys.readouterr().err
    assert err.rstrip().endswith("hit=0.6000, decoded=3]"), err


def test_ctrl_c_is_one_line_and_exit_130(tiny, tmp_path):
    """Issue 22: a Ctrl-C (SIGINT) at any moment exits 130 with one line, no traceback and nothing
    half-written: nothing at all, or an incomplete run of whole parts (tests/e2e/test_resume.py)."""
    import signal
    import subprocess
    import sys
    import time

    proc = subprocess.Popen([sys.executable, "-c", "from lmbatch.cli import main; main()", "run", "hellaswag",
                             "--model", str(tiny), "--out", str(tmp_path), "--run-id", "c", "--device", "cpu"],
                            stderr=subprocess.PIPE, text=True)
    time.sleep(6)                   # loading, tokenizing or executing: each must stop the same way
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("interrupted: "), err[-2000:]
    if "nothing written" in err:
        assert list(tmp_path.iterdir()) == []
    else:
        assert "instances kept; re-run the same command to resume" in err
        assert sorted(p.name for p in (tmp_path / "c").iterdir()) == ["INCOMPLETE", "parts", "run.json"]
        assert not [p for p in (tmp_path / "c" / "parts").iterdir() if p.name.startswith(".")]


def test_a_later_stage_longer_than_the_pool_fails_its_instances_not_the_run(tiny, tmp_path):
    """Issue 22, item 2: the first stage fits the pool, the second (known only after the first) does
    not: those instances fail with the reason kept, the others' results stay, exit 0."""
    import pandas as pd

    f = tmp_path / "long_later.py"
    f.write_text("from lmbatch.frontend import gen, select\n"
                 "def instances():\n    return [{'id': 'short', 'n': 1}, {'id': 'long', 'n': 300}]\n"
                 "def program(s, n):\n    s += 'Pick' + select('c', [' a', ' b'])\n"
                 "    s += ' word' * n + gen('g', max_tokens=2)\n")
    r = lmbatch("run", f, "--model", tiny, "--out", tmp_path, "--run-id", "r", "--quiet", "--kv-cache-tokens", 80,
                "--max-tokens-per-batch", 16)
    assert r.exit_code == 0, r.output
    df = pd.read_parquet(tmp_path / "r" / "instances.parquet").set_index("id")
    assert pd.isna(df.loc["short", "error"]) and json.loads(df.loc["short", "outputs"])["g"]
    assert "raise --kv-cache-tokens" in df.loc["long", "error"] and "gen 'g' needs" in df.loc["long", "error"]
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["counts"]["failed_instances"] == 1


def _truncate(d):
    f = d / "instances.parquet"
    f.write_bytes(f.read_bytes()[:-40])


def _same_size_other_bytes(d):
    f = d / "instances.parquet"
    b = bytearray(f.read_bytes())
    b[len(b) // 2] ^= 0xFF
    f.write_bytes(bytes(b))


def _other_runs_file(d):
    import shutil
    shutil.copy(d.parent / "other" / "requests.parquet", d / "requests.parquet")


@pytest.mark.parametrize("alter,needle", [(_truncate, "size"), (_same_size_other_bytes, "checksum"),
                                          (_other_runs_file, "requests.parquet does not belong"),
                                          (lambda d: (d / "requests.parquet").unlink(), "is missing")])
def test_report_refuses_a_run_whose_files_are_not_its_own(tiny, tmp_path, alter, needle):
    """Issue 22, item 5: summary.json records its Parquet files (rows, size, SHA-256); report checks them."""
    for run_id, extra in (("r", []), ("other", ["--shots", 0])):
        args = run_args(tiny, tmp_path, run_id)
        assert lmbatch(*args[:2], *extra, *args[4:] if extra else args[2:]).exit_code == 0
    d = tmp_path / "r"
    assert lmbatch("report", d).exit_code == 0
    alter(d)
    _error(lmbatch("report", d), needle)
    _error(lmbatch("report", "--compare", tmp_path / "other", d), needle)


def test_report_of_an_incomplete_run_says_how_to_resume(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "INCOMPLETE").write_text("")
    _error(lmbatch("report", tmp_path / "x"), "incomplete run", "resume")


def test_version_prints_the_installed_version():
    """Issue 57: `lmbatch --version` prints the package's version (the installed distribution's) and exits 0,
    before any command runs; the console script does the same."""
    import subprocess
    import sys
    from importlib.metadata import version

    import lmbatch as package

    r = lmbatch("--version")
    assert r.exit_code == 0 and r.output == f"lmbatch {version('lmbatch')}\n" == f"lmbatch {package.__version__}\n"
    assert lmbatch("--version", "run", "mmlux").output == r.output          # eager: no command is looked at
    p = subprocess.run([sys.executable, "-c", "from lmbatch.cli import main; main()", "--version"],
                       capture_output=True, text=True, timeout=60)
    assert (p.returncode, p.stdout, p.stderr) == (0, r.output, "")


def test_h_is_help_for_every_command_and_lm_eval_keeps_its_own():
    """Issue 36: `-h` is `--help` everywhere; `lmbatch lm-eval -h` is lm-eval's own help."""
    for args in ([], ["run"], ["tasks"], ["report"]):
        r = lmbatch(*args, "-h")
        assert r.exit_code == 0 and "Usage: " in r.output and "--help" in r.output, (args, r.output)
        assert r.output == lmbatch(*args, "--help").output
    r = lmbatch("lm-eval", "-h")
    assert r.exit_code == 0 and "usage: lm-eval" in r.output


def test_a_subject_given_twice_is_one_subject(tiny, tmp_path):
    """Issue 36: `--subjects anatomy --subjects anatomy` ran every question twice."""
    twice = lmbatch("run", "mmlu", "--limit", 2, "--subjects", "anatomy", "--subjects", "virology", "--subjects",
                    "anatomy", "--model", tiny, "--dry-run")
    assert twice.exit_code == 0, twice.output
    assert json.loads(twice.stdout)["instances"] == 4


SOME_FAIL = '''import sys

from lmbatch.frontend import gen, select

def instances():
    return [{"id": f"q{k}", "k": k, "gold": 0} for k in range(3)]

def program(s, k):
    s += "Pick" + select("c", [" a", " b"])
    s += " then" + gen("g", max_tokens=1)
    if k == 1:
        s["g"]
        sys.exit(4)         # after its first stage: it ends this program, not the run

def score(instance, s):
    return {"acc": 1.0, "valid": 0.5}
'''


def test_failed_instances_are_counted_beside_the_metrics(tiny, tmp_path):
    """Issue 36: with one of three instances failed, a run said `accuracy 1.0000 ... 1 FAILED`: the
    summary now says what each metric is over, and so does the closing line."""
    f = tmp_path / "some_fail.py"
    f.write_text(SOME_FAIL)
    r = lmbatch("run", f, "--model", tiny, "--out", tmp_path, "--run-id", "r")
    assert r.exit_code == 0, r.output
    s = json.loads((tmp_path / "r" / "summary.json").read_text())
    # every score the same: standard errors 0 (over the 2 instances that have them)
    assert (s["accuracy"], s["metrics"]) == (1.0, {"acc": 1.0, "acc_stderr": 0.0, "valid": 0.5, "valid_stderr": 0.0})
    assert s["metric_counts"] == {"acc": 2, "valid": 2}
    assert s["tasks"]["some_fail"]["n"] == 3 and s["tasks"]["some_fail"]["failed"] == 1
    errors = pq.read_table(tmp_path / "r" / "instances.parquet").column("error").to_pylist()
    assert errors == [None, "the program called sys.exit(4)", None]
    assert (s["counts"]["instances"], s["counts"]["failed_instances"], s["counts"]["scored_instances"]) == (3, 1, 2)
    last = r.stderr.replace("\r", "\n").strip().splitlines()[-1]
    assert last.startswith(f"some_fail 0-shot {tiny.name} float32 cpu: 3 instances  acc 1.0000  valid 0.5000 over "
                           "2 of 3 instances  1 FAILED (see the error column)"), last


def test_an_unwritable_workload_cache_is_one_notice_and_the_run_goes_on(tiny, tmp_path):
    """LMBATCH_CACHE on something that cannot hold folders: the workload cache says so in one line naming
    the variable; the run itself completes (the embedded model's conversion, which needs the cache, is a
    one-line error: tests/e2e/test_bad_inputs.py)."""
    import subprocess
    import sys

    (tmp_path / "file").write_text("")
    r = subprocess.run([sys.executable, "-c", "from lmbatch.cli import main; main()",
                        *map(str, run_args(tiny, tmp_path, "a"))], capture_output=True, text=True,
                       env={**os.environ, "LMBATCH_CACHE": str(tmp_path / "file")})
    assert r.returncode == 0, r.stderr      # the workload is prepared by a forked child: its line is on fd 2
    notes = [ln for ln in r.stderr.splitlines() if "LMBATCH_CACHE" in ln]
    assert len(notes) == 1 and "workload cache" in notes[0] and "not writable" in notes[0], r.stderr
    assert "Traceback" not in r.stderr and (tmp_path / "a" / "summary.json").is_file()


def test_bytecode_is_kept_in_the_cache_where_python_writes_none(tiny, tmp_path):
    """`python -B` (as PYTHONDONTWRITEBYTECODE=1): the command keeps the bytecode of what it imports and
    finds no current bytecode of beside (as installers write it) under LMBATCH_CACHE/pycache, and nowhere
    beside the sources; a second run keeps nothing more; LMBATCH_PYCACHE=0 keeps none; the outputs are
    the same."""
    import subprocess
    import sys

    from lmbatch.cache import _installed_bytecode

    def run(cache, run_id, **env):
        r = subprocess.run([sys.executable, "-B", "-c", "from lmbatch.cli import main; main()",
                            *map(str, run_args(tiny, tmp_path, run_id, "--dry-run"))], capture_output=True, text=True,
                           env={**os.environ, "LMBATCH_CACHE": str(cache), **env})
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)      # a dry run's plan summary

    kept = run(tmp_path / "c1", "a")
    tree = tmp_path / "c1" / "pycache"
    files = sorted(tree.rglob("*.pyc"))
    for f in files:     # .../x.cpython-311.pyc under the tree mirrors /.../x.py
        source = "/" + str(f.relative_to(tree).parent / (f.name.split(".")[0] + ".py"))
        assert _installed_bytecode(source) is None, f"{source}: its installed bytecode was compiled again"
    run(tmp_path / "c1", "a2")
    assert sorted(tree.rglob("*.pyc")) == files
    plain = run(tmp_path / "c2", "b", LMBATCH_PYCACHE="0")
    assert not (tmp_path / "c2" / "pycache").exists()
    assert {k: v for k, v in kept.items() if k not in ("time_s", "run_id")} == \
        {k: v for k, v in plain.items() if k not in ("time_s", "run_id")}


def test_installed_bytecode_is_read_as_python_reads_it(tmp_path):
    """Under keep_bytecode a module's bytecode beside its source is taken where Python itself would take it
    (a timestamp file matching the source's time and size, even if the text changed; an unchecked hash
    file) and not otherwise (a stale timestamp, a checked hash of other text): those are compiled and kept
    in lmbatch's cache. Each module's value is the one plain `python -B` gets; code names its source file."""
    import py_compile
    import subprocess
    import sys

    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    modes = {"a": "timestamp", "c": "timestamp", "d": "unchecked", "e": "checked"}
    for name in "abcde":
        src = pkg / f"{name}.py"
        src.write_text("V = 'old'\ndef f():\n    pass\n")
        if name in modes:
            mode = {"timestamp": py_compile.PycInvalidationMode.TIMESTAMP,
                    "unchecked": py_compile.PycInvalidationMode.UNCHECKED_HASH,
                    "checked": py_compile.PycInvalidationMode.CHECKED_HASH}[modes[name]]
            py_compile.compile(str(src), dfile=f"/elsewhere/{name}.py", invalidation_mode=mode, doraise=True)
        st = src.stat()
        new = "V = 'new'\ndef f():\n    pass\n" if name != "c" else "V = 'newer'\ndef f():\n    pass\n"
        src.write_text(new)
        if name == "a":     # the same size and time: Python cannot tell, and takes the old bytecode
            os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns))
        else:
            os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns + 2_000_000_000))
    code = ("import sys; {keep}import pkg.a, pkg.b, pkg.c, pkg.d, pkg.e as e; "
            "print([m.V for m in (pkg.a, pkg.b, pkg.c, pkg.d, e)], pkg.a.f.__code__.co_filename, "
            "pkg.d.f.__code__.co_filename)")
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "LMBATCH_CACHE": str(tmp_path / "cache")}
    env.pop("LMBATCH_PYCACHE", None)

    def values(keep: str) -> str:
        r = subprocess.run([sys.executable, "-B", "-c", code.format(keep=keep)], capture_output=True, text=True,
                           env=env, cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        return r.stdout.strip()

    python = values("")
    assert python == f"['old', 'new', 'newer', 'old', 'new'] {pkg / 'a.py'} {pkg / 'd.py'}"
    assert values("from lmbatch.cache import keep_bytecode; assert keep_bytecode(); ") == python
    tree = tmp_path / "cache" / "pycache"
    assert sorted(f.name.split(".")[0] for f in tree.rglob("*.pyc")) == ["__init__", "b", "c", "e"]
    assert values("from lmbatch.cache import keep_bytecode; assert keep_bytecode(); ") == python     # read back


def test_keep_bytecode_leaves_python_as_it_is_unless_told_to_write_none(tmp_path, monkeypatch):
    import sys

    from lmbatch.cache import keep_bytecode

    monkeypatch.setenv("LMBATCH_CACHE", str(tmp_path))
    monkeypatch.setattr(sys, "pycache_prefix", None)
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    monkeypatch.setenv("LMBATCH_KEEP_BYTECODE", "")      # restored (absent) after the test, whatever it sets
    monkeypatch.delenv("PYTHONPYCACHEPREFIX", raising=False)
    monkeypatch.setattr(sys, "path_hooks", list(sys.path_hooks))
    assert keep_bytecode() is None and sys.pycache_prefix is None      # Python writes beside the sources
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    monkeypatch.setattr(sys, "pycache_prefix", "/elsewhere")
    assert keep_bytecode() is None and sys.pycache_prefix == "/elsewhere"   # the user's own place
    monkeypatch.setattr(sys, "pycache_prefix", None)
    monkeypatch.setenv("LMBATCH_PYCACHE", "0")
    assert keep_bytecode() is None and sys.dont_write_bytecode
    monkeypatch.delenv("LMBATCH_PYCACHE")
    assert keep_bytecode() == str(tmp_path / "pycache") == sys.pycache_prefix
    assert not sys.dont_write_bytecode and os.environ["LMBATCH_KEEP_BYTECODE"] == "1"
    assert "PYTHONPYCACHEPREFIX" not in os.environ      # it would hide started processes' installed bytecode
    # a process the command starts keeps its bytecode there too, as soon as it imports lmbatch
    import subprocess

    r = subprocess.run([sys.executable, "-B", "-c", "import sys, lmbatch; print(sys.pycache_prefix)"],
                       capture_output=True, text=True, check=True)
    assert r.stdout.strip() == str(tmp_path / "pycache")
