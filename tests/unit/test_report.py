"""lmbatch report (lmbatch/results/: runs, table, compare) on synthetic run directories (no model, no data)."""

import json
import math
import re
from pathlib import Path

import pytest
from conftest import assert_self_contained_html as assert_self_contained

from lmbatch.errors import UserError
from lmbatch.results.compare import compare_runs
from lmbatch.results.runs import load_summary
from lmbatch.results.table import render, report_rows
from lmbatch.rundir.records import FileRecord


def file_record(path: Path, rows: int) -> dict:
    """What a run records of a file, as summary.json holds it."""
    return FileRecord.of(path, rows).to_json()


def compare(base, cand, **kw) -> tuple[bool, list[str]]:
    """`compare_runs`, as `lmbatch report --compare` calls it, as (ok, lines)."""
    found = compare_runs(base, cand, **kw)
    return found.ok, found.lines


def make_summary(run_id="mmlu-a", task="mmlu", instances=570, accuracy=0.31, hit_rate=0.86,
                 optimal_hit_rate=0.86, programs_per_s=12.0, execute_s=47.5) -> dict:
    """A summary.json dict following docs/outputs.md."""
    return {
        "run_id": run_id, "task": task, "created": "2026-11-21T06:15:00+00:00",
        "lmbatch_version": "0.1.0", "git_commit": None,
        "model": "/root/.cache/lmbatch/models/SmolLM2-135M-Instruct",
        "device": "cpu", "dtype": "float32", "options": {"shots": 5, "schedule": "dfs"},
        "counts": {"instances": instances, "requests": 4 * instances},
        "accuracy": accuracy, "accuracy_by_subject": {"abstract_algebra": 0.3},
        "tokens": {"prompt": 1000, "cached": 800, "computed": 200, "unique": 140, "decode": 0},
        "hit_rate": hit_rate, "optimal_hit_rate": optimal_hit_rate, "engine_optimal_hit_rate": 0.86,
        "time_s": {"load": 1.0, "plan": 0.5, "execute": execute_s, "total": 49.0},
        "throughput": {"programs_per_s": programs_per_s, "prompt_tokens_per_s": 21052.63,
                       "computed_tokens_per_s": 4210.5},
    }


def write_run(root: Path, summary: dict) -> Path:
    run = root / summary["run_id"]
    run.mkdir()
    (run / "summary.json").write_text(json.dumps(summary))
    return run


@pytest.fixture
def rows(tmp_path):
    a = write_run(tmp_path, make_summary("run-a", hit_rate=0.43, optimal_hit_rate=0.86))
    b = write_run(tmp_path, make_summary("run-b", hit_rate=0.0, optimal_hit_rate=0.0,
                                         programs_per_s=3.25))
    return report_rows([load_summary(a), load_summary(b)])


def test_rows_and_ratio(rows):
    assert [r["run_id"] for r in rows] == ["run-a", "run-b"]
    a = rows[0]
    assert a == {
        "run_id": "run-a", "task": "mmlu", "model": "SmolLM2-135M-Instruct", "shots": 5, "dtype": "float32",
        "device": "cpu", "instances": 570, "failed": None, "accuracy": 0.31, "accuracy_stderr": None, "hit_rate": 0.43,
        "optimal_hit_rate": 0.86,
        "hit_ratio": 0.5, "execute_s": 47.5, "programs_per_s": 12.0,
        "prompt_tokens_per_s": 21052.63, "computed_tokens_per_s": 4210.5,
    }
    assert rows[1]["hit_ratio"] == 1.0  # optimum 0 -> ratio 1.0


def test_render_table(rows):
    lines = render(rows, "table").splitlines()
    assert len(lines) == 4  # header, rule, two runs
    assert lines[0].split() == ["run_id", "task", "model", "shots", "dtype", "device", "instances", "failed",
                                "accuracy", "hit_rate", "optimal_hit_rate", "hit_ratio", "execute_s",
                                "programs_per_s", "prompt_tokens_per_s", "computed_tokens_per_s"]
    assert set(lines[1].replace(" ", "")) == {"-"}
    assert lines[2].split() == ["run-a", "mmlu", "SmolLM2-135M-Instruct", "5", "float32", "cpu", "570", "-",
                                "0.3100", "0.4300", "0.8600", "0.5000", "47.50", "12.0", "21052.6", "4210.5"]
    assert lines[3].split()[-4:] == ["47.50", "3.25", "21052.6", "4210.5"]  # rates under 10: 3 digits
    # aligned: every column of the run lines ends where the header's column ends (right-aligned)
    assert lines[2].index("12.0") + 4 == lines[0].index("programs_per_s") + len("programs_per_s")


def test_render_markdown(rows):
    lines = render(rows, "markdown").splitlines()
    assert lines[0].startswith("| run_id | task | model |")
    assert lines[1].startswith("|---|---|")
    assert all(line.startswith("|") and line.endswith("|") for line in lines)
    assert lines[2].startswith("| run-a | mmlu | SmolLM2-135M-Instruct | 5 | float32 | cpu | 570 | - | 0.3100 |")
    assert "| run-b |" in lines[3]
    assert len(lines) == 4


def test_render_json(rows):
    assert json.loads(render(rows, "json")) == rows


def test_render_unknown_format(rows):
    with pytest.raises(UserError, match="unknown format 'html'"):
        render(rows, "html")


def test_missing_summary(tmp_path):
    with pytest.raises(UserError, match=r"is not an lmbatch run directory \(no summary.json\)"):
        load_summary(tmp_path)
    with pytest.raises(UserError, match="not an lmbatch run directory"):
        load_summary(tmp_path / "absent")
    (tmp_path / "summary.json").write_text("{oops")
    with pytest.raises(UserError, match="is not valid JSON"):
        load_summary(tmp_path)


def test_compare_pass():
    ok, lines = compare(make_summary(programs_per_s=12.0, hit_rate=0.8),
                        make_summary(programs_per_s=12.3, accuracy=0.32))
    assert ok
    assert lines == [
        "speed: candidate 12.3 programs/s vs base 12 (execute phase): 2.5% faster, not checked (--max-slowdown not "
        "given)",
        "hit rate: candidate 0.8600 of optimal 0.8600 (ratio 1.0000, base 0.9302) ok",
        "accuracy: candidate 0.3200 vs base 0.3100 (+0.0100) ok",
    ]


def test_compare_speed_regression():
    # exactly 5% slower (base / cand - 1 == 0.05) passes; beyond it fails
    ok, lines = compare(make_summary(programs_per_s=10.5), make_summary(programs_per_s=10.0), max_slowdown=0.05)
    assert ok and lines[0].startswith("speed: ") and lines[0].endswith(" ok")
    ok, lines = compare(make_summary(programs_per_s=12.0), make_summary(programs_per_s=11.2), max_slowdown=0.05)
    assert not ok
    assert lines[0] == ("REGRESSION speed: candidate 11.2 programs/s vs base 12 (execute phase): 7.1% slower "
                        "(more than the 5.0% allowed)")
    # one percentage, and small rates readable (not "0.0 programs/s")
    ok, lines = compare(make_summary(programs_per_s=0.303), make_summary(programs_per_s=0.0142), max_slowdown=0.05)
    assert lines[0] == ("REGRESSION speed: candidate 0.0142 programs/s vs base 0.303 (execute phase): 2033.8% "
                        "slower (more than the 5.0% allowed)")
    assert not lines[1].startswith("REGRESSION") and not lines[2].startswith("REGRESSION")


def test_compare_hit_ratio_regression():
    ok, lines = compare(make_summary(), make_summary(hit_rate=0.99, optimal_hit_rate=1.0))
    assert ok and lines[1].endswith(" ok")  # ratio exactly 0.99
    ok, lines = compare(make_summary(), make_summary(hit_rate=0.8, optimal_hit_rate=0.86))
    assert not ok
    assert lines[1] == ("REGRESSION hit rate: candidate 0.8000 of optimal 0.8600 "
                        "(ratio 0.9302, base 1.0000) is below the 0.9900 required")
    assert [line.startswith("REGRESSION") for line in lines] == [False, True, False]
    # optimum 0 counts as ratio 1.0
    assert compare(make_summary(), make_summary(hit_rate=0.0, optimal_hit_rate=0.0))[0]


def test_compare_accuracy_regression():
    ok, lines = compare(make_summary(accuracy=0.31), make_summary(accuracy=0.305))
    assert ok and lines[2] == "accuracy: candidate 0.3050 vs base 0.3100 (-0.0050) ok"
    ok, lines = compare(make_summary(accuracy=0.31), make_summary(accuracy=0.304))
    assert not ok
    assert lines[2] == ("REGRESSION accuracy: candidate 0.3040 vs base 0.3100 (-0.0060) "
                        "dropped by more than the 0.0050 allowed")
    assert [line.startswith("REGRESSION") for line in lines] == [False, False, True]


def test_compare_custom_thresholds():
    ok, _ = compare(make_summary(programs_per_s=12.0), make_summary(programs_per_s=11.2),
                    max_slowdown=0.10, min_hit_ratio=0.9)
    assert ok


def test_the_speed_gate_is_off_unless_asked_for_and_compares_one_device(tmp_path):
    """Issue 47 item 4: an identical re-run on a loaded machine was flagged 72.7% slower by default. Speed is
    now checked only with --max-slowdown, on the execute phase's rate, and only between runs on one device."""
    noisy = make_summary(programs_per_s=12.0 / 1.727)
    ok, lines = compare(make_summary(programs_per_s=12.0), noisy)
    assert ok and lines[0] == ("speed: candidate 6.95 programs/s vs base 12 (execute phase): 72.7% slower, not "
                               "checked (--max-slowdown not given)")
    assert not compare(make_summary(programs_per_s=12.0), noisy, max_slowdown=0.05)[0]
    base = write_run(tmp_path, make_summary("base", programs_per_s=12.0))
    cand = write_run(tmp_path, {**make_summary("cand", programs_per_s=6.9), "device": "cuda"})
    assert report_cli("--compare", base, cand).exit_code == 0          # other devices: fine when speed is unchecked
    r = report_cli("--compare", base, cand, "--max-slowdown", 0.05)
    assert_one_line_error(r, "cannot check speed (--max-slowdown): base and candidate ran on other devices",
                          "device 'cpu' vs 'cuda'")


def test_compare_refuses_different_runs():
    with pytest.raises(UserError, match=r"^cannot compare: base and candidate ran different workloads \(base vs "
                                        r"candidate: instances 570 vs 57\)$"):
        compare(make_summary(instances=570), make_summary(instances=57))
    with pytest.raises(UserError, match="task 'mmlu' vs 'hellaswag'"):
        compare(make_summary(), make_summary(task="hellaswag"))


def test_summary_not_utf8_is_one_line(tmp_path):
    (tmp_path / "summary.json").write_bytes(b'{"run_id": "\xff\xfe"}')
    with pytest.raises(UserError, match="not UTF-8"):
        load_summary(tmp_path)


def test_small_rates_are_readable():
    from lmbatch.results.table import _cell

    assert _cell("programs_per_s", 0.0142) == "0.0142" and _cell("programs_per_s", 123.45) == "123.5"


# --- a run's files are checked against its summary (#22 item 5) -------------------------------------------

def instances_table(task: str, scores: dict, errors: dict | None = None):
    """instances.parquet's table (lmbatch.rundir.records.instance_schema) of one task: each id's metrics, or its error
    (errors: id -> message; such an instance has no metrics)."""
    import pyarrow as pa

    from lmbatch.rundir.rows import instance_schema

    errors = errors or {}
    ids = list(dict.fromkeys([*scores, *errors]))
    rows = [dict(task=task, subject="", id=i, prediction="0", gold="0",
                 correct=None if i in errors or "acc" not in scores[i] else bool(scores[i]["acc"]),
                 logprobs=[], is_greedy=[], metrics=list(({} if i in errors else scores[i]).items()), outputs="{}",
                 error=errors.get(i), prompt_tokens=10, cached_tokens=6, computed_tokens=4, decode_tokens=0,
                 inputs="{}")
            for i in ids]
    return pa.Table.from_pylist(rows, schema=instance_schema())


def write_checked_run(root: Path, run_id: str, ids=("a1", "a2")) -> Path:
    """A run directory whose summary records its two Parquet files as the runner does (FileRecord.of)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    run = root / run_id
    run.mkdir()
    tables = {"instances.parquet": instances_table("mmlu", {i: {"acc": 1.0} for i in ids}),
              "requests.parquet": pa.table({"order": list(range(2 * len(ids))),
                                            "instance_id": [i for i in ids for _ in (0, 1)]})}
    files = {}
    for name, table in tables.items():
        pq.write_table(table, run / name)
        files[name] = file_record(run / name, table.num_rows)
    (run / "summary.json").write_text(json.dumps({**make_summary(run_id), "files": files}))
    return run


def report_cli(*args):
    from typer.testing import CliRunner

    from lmbatch.cli import app

    return CliRunner().invoke(app, ["report", *(str(a) for a in args)])


def assert_one_line_error(r, *needles):
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output and isinstance(r.exception, SystemExit), r.exception   # no other exception
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def test_file_record(tmp_path):
    import hashlib

    data = bytes(range(256)) * 5000     # more than one 1 MiB block
    (tmp_path / "f").write_bytes(data)
    assert file_record(tmp_path / "f", 7) == {"rows": 7, "bytes": len(data),
                                              "sha256": hashlib.sha256(data).hexdigest()}


def test_report_of_an_intact_run(tmp_path):
    a, b = write_checked_run(tmp_path, "run-a"), write_checked_run(tmp_path, "run-b", ids=("b1", "b2"))
    r = report_cli(a, b)
    assert r.exit_code == 0, r.output
    assert [ln.split()[0] for ln in r.stdout.splitlines()[2:]] == ["run-a", "run-b"]
    r = report_cli("--compare", a, write_checked_run(tmp_path, "run-a2"))      # the same instances
    assert r.exit_code == 0, r.output
    assert load_summary(a).files["instances.parquet"].rows == 2
    # other instances (ids a1, a2 vs b1, b2) are not compared: one line
    assert_one_line_error(report_cli("--compare", a, b), "cannot compare: base and candidate ran different "
                          "instances (task 'mmlu': 2 instances only in base, e.g. id 'a1'; task 'mmlu': 2 "
                          "instances only in candidate, e.g. id 'b1')")


def _truncate(run: Path, other: Path) -> None:
    f = run / "instances.parquet"
    f.write_bytes(f.read_bytes()[:-40])


def _copy_same_size(run: Path, other: Path) -> None:
    # another run's file, of the same size (same shape, other ids): only the checksum tells them apart
    src, dst = other / "instances.parquet", run / "instances.parquet"
    assert src.stat().st_size == dst.stat().st_size and src.read_bytes() != dst.read_bytes()
    dst.write_bytes(src.read_bytes())


def _copy_other_size(run: Path, other: Path) -> None:
    (run / "requests.parquet").write_bytes((other.parent / "big" / "requests.parquet").read_bytes())


def _flip_a_byte(run: Path, other: Path) -> None:
    f = run / "requests.parquet"
    b = bytearray(f.read_bytes())
    b[len(b) // 2] ^= 0xFF
    f.write_bytes(bytes(b))


def _remove_requests(run: Path, other: Path) -> None:
    (run / "requests.parquet").unlink()


@pytest.mark.parametrize("alter,needles", [
    (_truncate, ["instances.parquet does not belong to this run's summary (size ", " bytes)",
                 "altered or mixed with another run"]),
    (_copy_same_size, ["instances.parquet does not belong", "(same size, its checksum differs)"]),
    (_copy_other_size, ["requests.parquet does not belong", "(size "]),
    (_flip_a_byte, ["requests.parquet does not belong", "checksum differs"]),
    (_remove_requests, ["requests.parquet is missing"]),
], ids=["truncated", "other-run-same-size", "other-run-other-size", "flipped-byte", "missing"])
def test_report_refuses_a_run_whose_files_are_not_its_own(tmp_path, alter, needles):
    run, other = write_checked_run(tmp_path, "run-a"), write_checked_run(tmp_path, "run-b", ids=("b1", "b2"))
    write_checked_run(tmp_path, "big", ids=("c1", "c2", "c3", "c4"))
    alter(run, other)
    for args in ([run], [other, run], ["--compare", run, other], ["--compare", other, run]):
        assert_one_line_error(report_cli(*args), str(run), *needles)
    with pytest.raises(UserError, match="run directory was altered"):
        load_summary(run)
    assert load_summary(other).run_id == "run-b"     # the source of a copy is untouched and intact


@pytest.mark.parametrize("compare", [False, True])
def test_report_of_an_incomplete_run_says_how_to_resume(tmp_path, compare):
    run = tmp_path / "run-x"
    (run / "parts").mkdir(parents=True)
    (run / "INCOMPLETE").write_text("")
    args = ["--compare", write_checked_run(tmp_path, "run-a"), run] if compare else [run]
    assert_one_line_error(report_cli(*args), f"{run} is an incomplete run (interrupted, or still running)",
                          "re-run the same lmbatch run command to resume it")
    (tmp_path / "no-marker" / "parts").mkdir(parents=True)     # without the marker it is no run at all
    assert_one_line_error(report_cli(tmp_path / "no-marker"), "not an lmbatch run directory (no summary.json)")


def test_report_of_a_summary_without_file_records(tmp_path):
    """Runs written before summaries recorded their files have their Parquet files read whole instead:
    a whole one is reported, one that is not is one line (issue 36)."""
    import shutil

    legacy = write_run(tmp_path, make_summary("old"))
    new = write_checked_run(tmp_path, "new")
    for name in ("instances.parquet", "requests.parquet"):
        shutil.copy(new / name, legacy / name)
    r = report_cli(legacy, new)
    assert r.exit_code == 0, r.output
    assert [ln.split()[0] for ln in r.stdout.splitlines()[2:]] == ["old", "new"]
    assert report_cli("--compare", legacy, new).exit_code == 0
    f = legacy / "instances.parquet"
    f.write_bytes(f.read_bytes()[:-40])
    assert_one_line_error(report_cli(legacy), str(f), "not a whole Parquet file", "records no checksums")
    (legacy / "instances.parquet").write_bytes(b"not parquet at all")
    assert_one_line_error(report_cli("--compare", new, legacy), str(f), "not a whole Parquet file")


# --- issue 36: each task's metrics and what tells runs apart as columns; compare what ran --------------------

def test_each_tasks_own_metrics_are_columns(tmp_path):
    hs = make_summary("hs", task="hellaswag")
    hs["metrics"] = {"acc": 0.31, "acc_norm": 0.4}
    js = make_summary("js", task="json", accuracy=None)
    js["metrics"] = {"complete": 1.0, "valid": 0.75, "hit_rate": 0.5}      # a metric named like a column
    rows = report_rows([hs, js, make_summary("mm")])
    assert rows[0]["acc_norm"] == 0.4 and "acc" not in rows[0]
    assert rows[1]["valid"] == 0.75 and rows[1]["metric:hit_rate"] == 0.5 and rows[1]["hit_rate"] == 0.86
    lines = render(rows, "table").splitlines()
    assert lines[0].split()[8:13] == ["accuracy", "acc_norm", "complete", "metric:hit_rate", "valid"]
    assert lines[2].split()[8:13] == ["0.3100", "0.4000", "-", "-", "-"]
    assert lines[3].split()[8:13] == ["-", "-", "1.0000", "0.5000", "0.7500"]
    assert "| acc_norm |" in render(rows, "markdown").splitlines()[0]


def test_compare_refuses_runs_of_other_workloads():
    from lmbatch.results.compare import workload_differences
    from lmbatch.results.runs import as_run

    def with_options(**kw):
        s = make_summary()
        s["options"] = {**s["options"], **kw}
        return s

    def differences(base: dict, cand: dict) -> list[str]:
        return workload_differences(as_run(base).summary, as_run(cand).summary)
    base = with_options(subjects=["a", "b"], limit=10, seed=0)
    assert differences(base, with_options(subjects=["b", "a", "a"], limit=10, seed=0)) == []
    assert differences(base, with_options(subjects=["a"], limit=10, seed=0)) == \
        ["subjects ['a', 'b'] vs ['a']"]
    other = with_options(shots=0, subjects=["a", "b"], limit=1, seed=0)
    other["model"], other["dtype"] = "/elsewhere/Other", "bfloat16"
    with pytest.raises(UserError, match=r"^cannot compare: base and candidate ran different workloads \(base vs "
                                        r"candidate: model 'SmolLM2-135M-Instruct' vs 'Other'; dtype 'float32' vs "
                                        r"'bfloat16'; shots 5 vs 0; limit 10 vs 1\)$"):
        compare(base, other)
    moved = make_summary()
    moved["model"] = "/home/ci/.cache/lmbatch/models/SmolLM2-135M-Instruct"      # the same model elsewhere
    older = make_summary()
    del older["dtype"], older["options"]            # an older summary: what it lacks is not compared
    assert compare(make_summary(), moved)[0] and compare(older, make_summary())[0]


@pytest.mark.parametrize("kw,needle", [
    (dict(max_slowdown=-0.1), "--max-slowdown -0.1: it must be at least 0"),
    (dict(max_slowdown=float("nan")), "--max-slowdown nan"),
    (dict(min_hit_ratio=1.01), "--min-hit-ratio 1.01: it must be a fraction from 0 to 1"),
    (dict(min_hit_ratio=-1), "--min-hit-ratio -1"),
    (dict(max_acc_drop=2), "--max-acc-drop 2"),
    (dict(max_acc_drop=float("nan")), "--max-acc-drop nan"),
])
def test_thresholds_are_checked(kw, needle):
    with pytest.raises(UserError, match=re.escape(needle)):
        compare(make_summary(), make_summary(), **kw)
    assert compare(make_summary(), make_summary(), max_slowdown=float("inf"), min_hit_ratio=0, max_acc_drop=1)[0]


@pytest.mark.parametrize("field,value,needle", [
    ("hit_rate", "0.9", "field 'hit_rate' is '0.9' (str), not a number"),
    ("accuracy", True, "field 'accuracy' is True (bool), not a number or null"),
    ("optimal_hit_rate", float("nan"), "field 'optimal_hit_rate' is nan (float), not a number"),
    ("counts", {"instances": 1.5}, "field 'counts.instances' is 1.5 (float), not an integer"),
    ("run_id", ["x"], "field 'run_id' is ['x'] (list), not a string"),
    ("files", [], "field 'files' is [] (list), not an object"),
    ("metrics", {"acc_norm": "0.3"}, "field 'metrics.acc_norm' is '0.3' (str), not a number or null"),
])
def test_a_summary_with_a_field_of_another_type_is_one_line(tmp_path, field, value, needle):
    """`hit_rate` a string was a TypeError in report; now one line naming the file and the field."""
    s = {**make_summary("r"), field: value}
    run = tmp_path / "r"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps(s))
    with pytest.raises(UserError, match=re.escape(needle)) as e:
        load_summary(run)
    assert str(e.value).startswith(str(run / "summary.json"))
    if field != "files":            # the same check on a summary given as a dict
        with pytest.raises(UserError, match=re.escape(needle.split(" is ")[0])):
            report_rows([s])


# --- issue 39: standard errors, per-task views, paired comparisons, the HTML report ----------------------------

def write_scored_run(root: Path, run_id: str, scores: dict, errors: dict | None = None, tasks_block: bool = False,
                     **summary) -> Path:
    """A run directory as lmbatch writes it, of made-up per-instance results: scores is task -> id -> metrics
    (errors: task -> id -> message, failed instances). Its summary records instances.parquet; its metrics are
    the means over the scored instances; with tasks_block, it has summary.json's `tasks` block too."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    errors = errors or {}
    run = root / run_id
    run.mkdir()
    table = pa.concat_tables([instances_table(t, scores.get(t, {}), errors.get(t)) for t in {**scores, **errors}])
    pq.write_table(table, run / "instances.parquet")
    values = [m for t in scores.values() for m in t.values()]
    names = sorted({k for m in values for k in m})
    means = {k: sum(m[k] for m in values if k in m) / sum(k in m for m in values) for k in names}
    s = make_summary(run_id, task=",".join(scores) if len(scores) > 1 else next(iter(scores)),
                     instances=table.num_rows, accuracy=means.get("acc"))
    s.update(metrics=means, files={"instances.parquet": file_record(run / "instances.parquet", table.num_rows)},
             **summary)
    s["counts"]["failed_instances"] = sum(len(e) for e in errors.values())
    if tasks_block:
        s["tasks"] = {t: task_block(v) for t, v in scores.items()}
    (run / "summary.json").write_text(json.dumps(s))
    return run


def task_block(scores: dict) -> dict:
    """A task of summary.json's `tasks` block, as the suite runner writes it (its stderr by hand: 0.0 marks it)."""
    acc = [m["acc"] for m in scores.values()]
    return {"n": len(scores), "failed": 0, "primary_metric": "acc",
            "metrics": {"acc": sum(acc) / len(acc), "acc_stderr": 0.0123},
            "prompt_tokens": 10 * len(scores), "cached_tokens": 6 * len(scores), "computed_tokens": 4 * len(scores),
            "hit_rate": 0.6, "optimal_hit_rate": 0.625}


def accs(values: list) -> dict:
    return {f"q{i}": {"acc": float(v)} for i, v in enumerate(values)}


BASE = [i % 2 for i in range(400)]                                  # 200 of 400 right


def flipped(worse: int, better: int) -> list:
    """BASE with `worse` right answers turned wrong and `better` wrong ones turned right."""
    out, right, wrong = list(BASE), [i for i, v in enumerate(BASE) if v], [i for i, v in enumerate(BASE) if not v]
    for i in right[:worse]:
        out[i] = 0
    for i in wrong[:better]:
        out[i] = 1
    return out


def test_the_table_shows_standard_errors_computed_by_hand(tmp_path):
    from lmbatch.results.runs import load_run

    run = write_scored_run(tmp_path, "r", {"mmlu": accs([1, 0, 1, 1])})
    row = report_rows([load_run(run)])[0]
    assert row["accuracy"] == 0.75 and row["accuracy_stderr"] == pytest.approx(0.25, abs=1e-15)   # see test_stats
    lines = render([row], "table").splitlines()
    assert "0.7500 ± 0.2500" in lines[2] and "accuracy_stderr" not in lines[0]
    assert "| 0.7500 ± 0.2500 |" in render([row], "markdown")
    assert json.loads(render([row], "json"))[0]["accuracy_stderr"] == pytest.approx(0.25)


def test_every_metric_has_its_standard_error(tmp_path):
    from lmbatch.results.runs import load_run

    scores = {"a": {"acc": 1.0, "acc_norm": 1.0}, "b": {"acc": 0.0, "acc_norm": 1.0},
              "c": {"acc": 0.0, "acc_norm": 0.0}}
    row = report_rows([load_run(write_scored_run(tmp_path, "hs", {"hellaswag": scores}))])[0]
    third = math.sqrt((2 * (1 / 3) ** 2 + (2 / 3) ** 2) / 2) / math.sqrt(3)
    assert row["accuracy_stderr"] == pytest.approx(third) and row["acc_norm_stderr"] == pytest.approx(third)
    assert render([row], "table").splitlines()[0].split()[8:10] == ["accuracy", "acc_norm"]


def test_a_suite_run_has_a_row_per_task(tmp_path):
    from lmbatch.results.runs import load_run

    run = write_scored_run(tmp_path, "suite", {"arc_easy:rc": accs([1, 0, 1]), "boolq:mc": accs([1, 1])},
                           tasks_block=True)
    rows = report_rows([load_run(run)])
    assert [(r["run_id"], r["task"]) for r in rows] == [("suite", "arc_easy:rc,boolq:mc"), ("suite", "arc_easy:rc"),
                                                        ("suite", "boolq:mc")]
    arc = rows[1]
    assert (arc["instances"], arc["failed"], arc["accuracy"], arc["accuracy_stderr"]) == (3, 0, 2 / 3, 0.0123)
    assert (arc["hit_rate"], arc["optimal_hit_rate"], arc["hit_ratio"]) == (0.6, 0.625, 0.96)
    assert arc["programs_per_s"] is None            # one batch over one tree: speed is the run's
    assert "0.6667 ± 0.0123" in render(rows, "table")


def test_a_tasks_block_of_another_type_is_one_line(tmp_path):
    from lmbatch.results.runs import load_run

    run = write_scored_run(tmp_path, "s", {"t": accs([1, 0])}, tasks={"t": {"n": "2", "metrics": {}}})
    with pytest.raises(UserError, match=r"field 'tasks.t.n' is '2' \(str\), not an integer"):
        report_rows([load_run(run)])


def compare_cli(base: Path, cand: Path, *extra):
    r = report_cli("--compare", base, cand, *extra)
    assert r.exit_code in (0, 1), r.output
    return r.exit_code, [ln for ln in r.stdout.splitlines() if ln.startswith(("REGRESSION", "mmlu"))]


def test_a_real_drop_is_a_regression_a_noise_sized_one_is_not(tmp_path):
    base = write_scored_run(tmp_path, "base", {"mmlu": accs(BASE)})
    real = write_scored_run(tmp_path, "real", {"mmlu": accs(flipped(40, 5))})     # -0.0875
    noise = write_scored_run(tmp_path, "noise", {"mmlu": accs(flipped(10, 6))})   # -0.0100
    code, lines = compare_cli(base, real)
    assert code == 1 and lines == [
        f"REGRESSION mmlu acc: candidate 0.4125 ± 0.0246 vs base 0.5000 ± 0.0250 (-0.0875 over 400 instances: "
        f"40 worse, 5 better; McNemar mid-p p={mcnemar(40, 5):.3g}) a significant drop (p {mcnemar(40, 5):.3g} "
        f"< alpha 0.05)"]
    code, lines = compare_cli(base, noise)
    assert code == 0 and lines[0].startswith("mmlu acc: candidate 0.4900") and lines[0].endswith(
        f"(-0.0100 over 400 instances: 10 worse, 6 better; McNemar mid-p p={mcnemar(10, 6):.3g}) ok")
    assert mcnemar(10, 6) > 0.3
    # the drop the old fixed threshold (0.005) flagged, when asked for; --alpha 0: that threshold alone
    assert compare_cli(base, noise, "--max-acc-drop", 0.005)[1][0].endswith("dropped by more than the 0.0050 allowed")
    assert compare_cli(base, noise, "--max-acc-drop", 0.01)[0] == 0                 # inclusive
    assert compare_cli(base, real, "--alpha", 0)[0] == 0
    assert compare_cli(base, real, "--alpha", 0, "--max-acc-drop", 0.005)[0] == 1
    # a rise is never a regression, however significant
    assert compare_cli(real, base)[0] == 0


def mcnemar(b: int, c: int) -> float:
    from lmbatch.results.stats import mcnemar_midp

    return mcnemar_midp(b, c)


def test_an_instance_that_failed_counts_against_its_run(tmp_path):
    """Issue 47 item 1: instances that failed in the candidate were left out of the pairs, so failing passed. Now
    each counts as the metric's worst score (0) in the run where it failed, and more failures is a regression."""
    base = write_scored_run(tmp_path, "base", {"mmlu": accs(BASE)})
    scores = accs(flipped(0, 0))
    failed = {k: "score: ValueError: x" for k in list(scores)[:20]}      # 10 right, 10 wrong in base
    cand = write_scored_run(tmp_path, "cand", {"mmlu": {k: v for k, v in scores.items() if k not in failed}},
                            errors={"mmlu": failed})
    code, lines = compare_cli(base, cand)
    assert code == 1 and lines == [
        f"REGRESSION mmlu acc: candidate 0.4750 ± 0.0250 vs base 0.5000 ± 0.0250 (-0.0250 over 400 instances: 10 "
        f"worse, 0 better; McNemar mid-p p={mcnemar(10, 0):.3g}; failed, each scored 0: candidate 20, base 0) a "
        f"significant drop (p {mcnemar(10, 0):.3g} < alpha 0.05)",
        "REGRESSION mmlu failed: candidate 20 of 400 instances failed, base 0: more instances failed (see "
        "instances.parquet's error column)"]
    # the other way round: the candidate fixed them (the base's failures count against the base)
    code, lines = compare_cli(cand, base)
    assert code == 0 and lines[0].endswith("failed, each scored 0: candidate 0, base 20) ok")
    assert lines[1] == "mmlu failed: candidate 0 of 400 instances failed, base 20 ok"


@pytest.mark.parametrize("cand_scores,needle", [
    ({"mmlu": {**accs(BASE[:399]), "other": {"acc": 1.0}}},
     "task 'mmlu': 1 instance only in base, e.g. id 'q399'; task 'mmlu': 1 instance only in candidate, e.g. id "
     "'other'"),
    ({"mmlu": accs(BASE[:200]), "hellaswag": accs(BASE[200:])}, "task 'hellaswag' only in candidate"),
], ids=["other-ids", "other-tasks"])
def test_compare_refuses_runs_over_other_instances_in_one_line(tmp_path, cand_scores, needle):
    base = write_scored_run(tmp_path, "base", {"mmlu": accs(BASE)})
    cand = write_scored_run(tmp_path, "cand", cand_scores)
    s = json.loads((cand / "summary.json").read_text())
    s["task"] = "mmlu"                  # the same workload as far as the summaries tell
    (cand / "summary.json").write_text(json.dumps(s))
    assert_one_line_error(report_cli("--compare", base, cand), "cannot compare: base and candidate ran different "
                          "instances (task 'mmlu'", needle)
    with pytest.raises(UserError, match="ran different instances"):
        compare(*map(__import__("lmbatch.results.runs", fromlist=["load_run"]).load_run, (base, cand)))


def test_compare_a_suite_per_task(tmp_path):
    scores = {"arc_easy:rc": accs(BASE), "boolq:mc": accs(BASE)}
    base = write_scored_run(tmp_path, "base", scores, tasks_block=True)
    cand = write_scored_run(tmp_path, "cand", {"arc_easy:rc": accs(BASE), "boolq:mc": accs(flipped(40, 5))},
                            tasks_block=True)
    r = report_cli("--compare", base, cand)
    assert r.exit_code == 1
    lines = r.stdout.splitlines()[2:]
    assert len(lines) == 2 and lines[0].startswith("arc_easy:rc acc: candidate 0.5000") and lines[0].endswith(" ok")
    assert lines[1].startswith("REGRESSION boolq:mc acc: candidate 0.4125")


@pytest.mark.parametrize("args,needle", [
    (["--alpha", 1.5], "--alpha 1.5: it must be a fraction from 0 to 1"),
    (["--alpha", "nan"], "--alpha nan"),
    (["--max-acc-drop", -0.1], "--max-acc-drop -0.1"),
])
def test_alpha_and_max_acc_drop_are_checked(tmp_path, args, needle):
    base = write_scored_run(tmp_path, "base", {"mmlu": accs(BASE)})
    assert_one_line_error(report_cli("--compare", base, base, *args), needle)


def test_the_html_report_is_one_self_contained_file(tmp_path):
    base = write_scored_run(tmp_path, "base", {"mmlu": accs(BASE)})
    cand = write_scored_run(tmp_path, "cand", {"mmlu": accs(flipped(40, 5))})
    suite = write_scored_run(tmp_path, "suite", {"arc_easy:rc": accs([1, 0, 1]), "boolq:mc": accs([1, 1])},
                             tasks_block=True)
    out = tmp_path / "out" / "report.html"
    out.parent.mkdir()
    out.write_text("<!DOCTYPE html>\n<p>an earlier report</p>")
    r = report_cli(base, cand, suite, "--html", out)
    assert r.exit_code == 0, r.output
    assert r.stdout.splitlines()[0].split()[:2] == ["run_id", "task"]      # the text table stays the output
    assert [p.name for p in out.parent.iterdir()] == ["report.html"]       # replaced, no temporary file left
    page = assert_self_contained(out.read_text(encoding="utf-8"), plots=4)
    text = " ".join(page.text)
    # scores with their standard errors, a bar per run: mmlu's two runs, the suite's two tasks
    for shown in ("mmlu acc", "0.5000 ± 0.0250", "0.4125 ± 0.0246", "arc_easy:rc acc", "0.6667 ± 0.0123"):
        assert shown in text, shown
    assert "0.6000 of 0.6250" in text and "0.8600 of 0.8600" in text         # hit rate of its optimum
    assert "200 of 1k (20.0%)" in text and "12 of 30 (40.0%)" in text      # tokens computed of prompt tokens
    assert "cand: execute 47.50s" in text                                    # where the time went


def test_the_html_report_of_a_comparison_shows_each_tasks_delta(tmp_path):
    base = write_scored_run(tmp_path, "base", {"mmlu": accs(BASE)})
    cand = write_scored_run(tmp_path, "cand", {"mmlu": accs(flipped(40, 5))})
    out = tmp_path / "cmp.html"
    r = report_cli("--compare", base, cand, "--html", out)
    assert r.exit_code == 1 and "REGRESSION mmlu acc" in r.stdout
    page = assert_self_contained(out.read_text(encoding="utf-8"), plots=5)
    text = " ".join(page.text)
    assert "-0.0875 p=4.41e-08" in text and "REGRESSION: a significant drop (p 4.41e-08 < alpha 0.05)" in text
    assert "#d03c3c" in out.read_text()                                    # the regression's bar is red


def test_an_html_file_that_cannot_be_written_is_one_line(tmp_path):
    base = write_scored_run(tmp_path, "base", {"mmlu": accs(BASE)})
    assert_one_line_error(report_cli(base, "--html", tmp_path / "absent" / "r.html"), "--html", "does not exist")
    assert_one_line_error(report_cli(base, "--html", tmp_path), "--html", "name a file to write")
    assert_one_line_error(report_cli(tmp_path / "nothing", "--html", tmp_path / "r.html"), "not an lmbatch run")
    assert not (tmp_path / "r.html").exists()


def test_a_suite_raises_no_more_false_alarms_than_one_task(tmp_path):
    """p 0.021 on one task alone is a regression at alpha 0.05; as one of ten tasks compared together it is
    what chance gives one task in ten (Holm: second smallest of ten, 9 x 0.021), while a real drop stays one."""
    from lmbatch.results.compare import compare_runs
    from lmbatch.results.runs import load_run

    alone = compare_runs(load_run(write_scored_run(tmp_path, "b1", {"t0": accs(BASE)})),
                         load_run(write_scored_run(tmp_path, "c1", {"t0": accs(flipped(12, 3))})))
    assert [d.regression for d in alone.deltas] == [True] and alone.deltas[0].p_holm == mcnemar(12, 3) < 0.05
    tasks = {f"t{i}": accs(BASE) for i in range(10)}
    base = load_run(write_scored_run(tmp_path, "base", tasks, tasks_block=True))
    cand = load_run(write_scored_run(tmp_path, "cand", {**tasks, "t0": accs(flipped(12, 3)),
                                                        "t1": accs(flipped(40, 5))}, tasks_block=True))
    found = compare_runs(base, cand)
    assert [d.regression for d in found.deltas] == [False, True] + [False] * 8
    assert found.deltas[0].p_holm == pytest.approx(9 * mcnemar(12, 3)) and found.deltas[0].tests == 10
    assert found.lines[2].endswith(f"McNemar mid-p p={mcnemar(12, 3):.3g}, Holm {9 * mcnemar(12, 3):.3g}) ok")
    assert found.lines[3].endswith(f"a significant drop (p {mcnemar(40, 5):.3g}, Holm-adjusted over 10 tests "
                                   f"{10 * mcnemar(40, 5):.3g} < alpha 0.05)")


def test_the_primary_metric_a_tasks_block_declares_decides(tmp_path):
    """A run written before the tasks block (primary acc, derived) against one whose block declares acc_norm:
    acc_norm decides, whichever run is the base."""
    from lmbatch.results.compare import compare_runs
    from lmbatch.results.runs import load_run

    same, worse = accs(BASE), accs(flipped(40, 5))
    old = {k: {"acc": v["acc"], "acc_norm": v["acc"]} for k, v in same.items()}
    new = {k: {"acc": v["acc"], "acc_norm": w["acc"]} for (k, v), w in zip(same.items(), worse.values())}
    legacy = load_run(write_scored_run(tmp_path, "legacy", {"hellaswag": old}))
    block = {"hellaswag": {**task_block(same), "primary_metric": "acc_norm"}}
    block["hellaswag"]["metrics"]["acc_norm"] = 0.4125         # the primary metric its instances carry
    current = load_run(write_scored_run(tmp_path, "current", {"hellaswag": new}, tasks=block))
    for base, cand in ((legacy, current), (current, legacy)):
        found = compare_runs(base, cand)
        assert [(d.task, d.metric) for d in found.deltas] == [("hellaswag", "acc_norm")]
    assert not compare_runs(legacy, current).ok and compare_runs(current, legacy).ok


def test_a_suite_summarys_own_accuracy_error_and_shots_are_shown(tmp_path):
    """A suite's accuracy is over each task's primary metric: its summary's accuracy_stderr is that mean's,
    not acc's; its top-level shots (null when its tasks' differ) is the one shown."""
    from lmbatch.results.runs import load_run

    run = write_scored_run(tmp_path, "suite", {"arc_easy:rc": accs([1, 0, 1]), "boolq:mc": accs([1, 1])},
                           tasks_block=True, accuracy_stderr=0.0456, shots=None)
    row = report_rows([load_run(run)])[0]
    assert (row["accuracy_stderr"], row["shots"]) == (0.0456, None)
    s = json.loads((run / "summary.json").read_text())
    (run / "summary.json").write_text(json.dumps({**s, "accuracy_stderr": "0.1"}))
    with pytest.raises(UserError, match="field 'accuracy_stderr' is '0.1'"):
        load_run(run)


# --- issue 47: a CI gate that cannot be fooled ----------------------------------------------------------------

SIX = {"mmlu": accs([1, 1, 1, 0, 0, 0])}


def gate(base: Path, cand: Path, *extra) -> tuple[int, list[str]]:
    """report --compare's exit code and its lines."""
    r = report_cli("--compare", base, cand, *extra)
    assert r.exit_code in (0, 1) and "Traceback" not in r.output, r.output
    return r.exit_code, r.stdout.splitlines()


def regressions(lines: list[str]) -> list[str]:
    return [x for x in lines if x.startswith("REGRESSION")]


def test_a_run_passes_against_itself(tmp_path):
    for name, scores in (("mmlu", SIX), ("json", {"json": {f"c{i}": {"complete": 1.0, "valid": float(i % 2)}
                                                           for i in range(8)}})):
        run = write_scored_run(tmp_path, name, scores)
        code, lines = gate(run, run, "--max-slowdown", 0.05, "--max-acc-drop", 0.0)
        assert code == 0 and not regressions(lines), lines


def test_a_candidate_whose_every_instance_failed_is_a_regression(tmp_path):
    """Item 1: `6 instances  6 FAILED` compared as `rl acc: no instance scored in both runs, skipped`, exit 0."""
    base = write_scored_run(tmp_path, "base", SIX)
    cand = write_scored_run(tmp_path, "cand", {"mmlu": {}}, errors={"mmlu": {f"q{i}": "boom" for i in range(6)}})
    code, lines = gate(base, cand)
    assert code == 1 and regressions(lines) == [
        "REGRESSION mmlu failed: candidate 6 of 6 instances failed, base 0: more instances failed (see "
        "instances.parquet's error column)"]
    assert f"(-0.5000 over 6 instances: 3 worse, 0 better; McNemar mid-p p={mcnemar(3, 0):.3g}; failed, each scored " \
           "0: candidate 6, base 0) ok" in lines[2]           # 3 of 6: too few to be significant alone
    code, lines = gate(base, cand, "--max-acc-drop", 0.01)
    assert code == 1 and regressions(lines)[0].startswith(
        "REGRESSION mmlu acc: candidate 0.0000 ± 0.0000 vs base 0.5000 ± 0.2236 ")
    assert regressions(lines)[0].endswith("dropped by more than the 0.0100 allowed")


def test_a_candidate_failing_exactly_the_instances_base_got_right_is_a_regression(tmp_path):
    """Item 1: `... failed: candidate 3, base 0) ok`, exit 0: the instances left were those both got wrong."""
    base = write_scored_run(tmp_path, "base", SIX, tasks_block=True)
    scores = {k: v for k, v in accs([0, 0, 0, 0, 0, 0]).items() if k >= "q3"}
    cand = write_scored_run(tmp_path, "cand", {"mmlu": scores}, errors={"mmlu": {f"q{i}": "x" for i in range(3)}},
                            tasks={"mmlu": {**task_block(scores), "failed": 3}})
    code, lines = gate(base, cand, "--max-acc-drop", 0.01)
    assert code == 1 and [x.split(":")[0] for x in regressions(lines)] == ["REGRESSION mmlu acc",
                                                                          "REGRESSION mmlu failed"]
    assert "(-0.5000 over 6 instances: 3 worse, 0 better" in regressions(lines)[0]
    assert gate(base, cand)[0] == 1                                 # the failures alone


def json_scores(valid: list) -> dict:
    return {f"c{i}": {"complete": 1.0, "valid": float(v)} for i, v in enumerate(valid)}


def test_every_metric_of_a_json_task_is_compared(tmp_path):
    """Item 2: json's summary said primary_metric acc, which no instance has, so --compare skipped it."""
    from lmbatch.results.report_html import _categories
    from lmbatch.results.runs import load_run

    old_block = {"json": {**task_block(accs([1])), "primary_metric": "acc", "metrics": {"complete": 1.0, "valid": 1.0}}}
    base = write_scored_run(tmp_path, "base", {"json": json_scores([1] * 20)}, tasks=old_block)     # an older run
    new_block = {"json": {**task_block(accs([1])), "primary_metric": "complete", "compared_metrics": [
        "complete", "valid"], "metrics": {"complete": 1.0, "valid": 0.1}}}
    cand = write_scored_run(tmp_path, "cand", {"json": json_scores([1, 1] + [0] * 18)}, tasks=new_block)
    code, lines = gate(base, cand)
    assert code == 1 and lines[2].startswith("json complete: candidate 1.0000") and lines[2].endswith(" ok")
    assert regressions(lines) == [
        f"REGRESSION json valid: candidate 0.1000 ± 0.0688 vs base 1.0000 ± 0.0000 (-0.9000 over 20 instances: 18 "
        f"worse, 0 better; McNemar mid-p p={mcnemar(18, 0):.3g}, Holm {2 * mcnemar(18, 0):.3g}) a significant drop "
        f"(p {mcnemar(18, 0):.3g}, Holm-adjusted over 2 tests {2 * mcnemar(18, 0):.3g} < alpha 0.05)"]
    assert gate(base, base)[0] == 0
    # the HTML plots the metrics the runs have, not an empty acc row
    assert _categories([load_run(base), load_run(cand)]) == [("json", "complete"), ("json", "valid")]


def test_a_program_files_own_continuous_metric_gets_a_paired_t_test(tmp_path):
    """Item 2: a program file's f1 falling from 0.7 to 0.0 passed (skipped: no acc)."""
    from lmbatch.results.stats import paired_test

    f1 = [0.6, 0.7, 0.8, 0.65, 0.75, 0.7, 0.72, 0.68]
    base = write_scored_run(tmp_path, "base", {"qa": {f"i{k}": {"f1": v} for k, v in enumerate(f1)}})
    cand = write_scored_run(tmp_path, "cand", {"qa": {f"i{k}": {"f1": 0.0} for k in range(8)}})
    code, lines = gate(base, cand)
    p = paired_test(f1, [0.0] * 8).p
    assert code == 1 and regressions(lines) == [
        f"REGRESSION qa f1: candidate 0.0000 ± 0.0000 vs base 0.7000 ± 0.0215 (-0.7000 over 8 instances: 8 lower, 0 "
        f"higher; paired t p={p:.3g}) a significant drop (p {p:.3g} < alpha 0.05)"]
    # a candidate that scored nothing at all (every instance failed) is compared on the base's metric
    failed = write_scored_run(tmp_path, "failed", {"qa": {}}, errors={"qa": {f"i{k}": "x" for k in range(8)}})
    code, lines = gate(base, failed)
    assert code == 1 and [x.split(":")[0] for x in regressions(lines)] == ["REGRESSION qa f1", "REGRESSION qa failed"]


def test_the_tasks_block_names_a_primary_metric_its_instances_carry():
    """Item 2 where summary.json is written: json's and a program file's primary metric is one of their own,
    and every one of their metrics is compared; a declared primary metric (acc, an OLMES config's) stays."""
    from lmbatch.frontend.workload import Workload
    from lmbatch.results.task_results import accuracy, tasks_block
    from lmbatch.rundir.rows import InstanceRow

    def row(error: str | None, metrics: dict) -> InstanceRow:
        return InstanceRow(task="qa", subject="", id="i", prediction=None, gold=None, correct=None, logprobs=[],
                           is_greedy=[], metrics=metrics, outputs="{}", error=error, prompt_tokens=0,
                           cached_tokens=0, computed_tokens=0, decode_tokens=0, inputs="{}")
    rows = [row(None, {"f1": 0.5, "em": 0.0}), row("boom", {})]
    own = Workload("qa", "", lambda s: None, lambda a: [], primary_metric=None)
    block = tasks_block(own, rows, {}, {})["qa"]
    assert (block.primary_metric, block.compared_metrics, block.failed) == ("em", ["em", "f1"], 1)
    assert accuracy(own, rows) == [0.0]
    declared = Workload("qa", "", lambda s: None, lambda a: [], primary_metric="f1")
    block = tasks_block(declared, rows, {}, {})["qa"]
    assert (block.primary_metric, block.compared_metrics) == ("f1", ["f1"])


def test_html_never_writes_over_a_run_file_or_another_file(tmp_path):
    """Item 6: `lmbatch report w1 --html w1/summary.json` replaced the run's summary with HTML, exit 0."""
    run = write_scored_run(tmp_path, "w1", SIX)
    summary = (run / "summary.json").read_bytes()
    assert_one_line_error(report_cli(run, "--html", run / "summary.json"), "--html", "is a file of run")
    assert_one_line_error(report_cli("--compare", run, run, "--html", run / "instances.parquet"), "is a file of run")
    assert_one_line_error(report_cli(run / "summary.json", "--html", run / "summary.json"), "is a file of run")
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes")
    assert_one_line_error(report_cli(run, "--html", notes), "--html", "exists and is not an HTML page")
    assert (run / "summary.json").read_bytes() == summary and notes.read_text() == "my notes"
    assert report_cli(run, "--html", tmp_path / "new.html").exit_code == 0           # a new file, or a report
    assert report_cli(run, "--html", tmp_path / "new.html").exit_code == 0


def test_a_suites_olmes_task_shows_its_primary_metric(tmp_path):
    """Item 8a: a suite's OLMES task showed `accuracy -` (its primary metric is acc_per_char, not acc)."""
    from lmbatch.results.runs import load_run

    scores = {"arc_challenge:rc": {f"q{i}": {"acc_raw": 0.0, "acc_per_char": float(i % 2)} for i in range(4)},
              "mmlu": accs([1, 0])}
    blocks = {"arc_challenge:rc": {**task_block(accs([1])), "n": 4, "primary_metric": "acc_per_char",
                                   "metrics": {"acc_raw": 0.0, "acc_raw_stderr": 0.0, "acc_per_char": 0.5,
                                               "acc_per_char_stderr": 0.2887}},
              "mmlu": task_block(accs([1, 0]))}
    rows = report_rows([load_run(write_scored_run(tmp_path, "suite", scores, tasks=blocks))])
    arc = rows[1]
    assert arc["task"] == "arc_challenge:rc" and (arc["accuracy"], arc["accuracy_stderr"]) == (0.5, 0.2887)
    assert "0.5000 ± 0.2887" in render(rows, "table").splitlines()[3]


def test_compare_honours_format_json(tmp_path):
    """Item 8c: `--compare ... --format json` printed the text lines."""
    base = write_scored_run(tmp_path, "base", {"mmlu": accs(BASE)})
    cand = write_scored_run(tmp_path, "cand", {"mmlu": accs(flipped(40, 5))})
    r = report_cli("--compare", base, cand, "--format", "json")
    assert r.exit_code == 1
    doc = json.loads(r.stdout)
    assert (doc["ok"], doc["base"], doc["candidate"]) == (False, "base", "cand")
    assert len(doc["regressions"]) == 1 and doc["regressions"][0].startswith("REGRESSION mmlu acc")
    (task,) = doc["tasks"]
    assert (task["task"], task["metric"], task["test"], task["instances"], task["worse"], task["better"]) == \
        ("mmlu", "acc", "McNemar mid-p", 400, 40, 5)
    assert task["regression"] and task["p"] == pytest.approx(mcnemar(40, 5)) and task["delta"] == pytest.approx(-0.0875)
    md = report_cli("--compare", base, cand, "--format", "markdown")
    assert md.exit_code == 1 and all(x.startswith("- ") for x in md.stdout.splitlines())
    assert_one_line_error(report_cli("--compare", base, cand, "--format", "yaml"), "unknown format 'yaml'")


def test_the_html_page_fits_a_1280px_window(tmp_path):
    """Item 8d: the runs table and the compare lines overflowed a 1280-px window: wide tables scroll in a box of
    their own, the lines wrap, plots shrink to the page."""
    base = write_scored_run(tmp_path, "base", {"mmlu": accs(BASE)})
    cand = write_scored_run(tmp_path, "cand", {"mmlu": accs(flipped(40, 5))})
    out = tmp_path / "cmp.html"
    assert report_cli("--compare", base, cand, "--html", out).exit_code == 1
    text = out.read_text()
    assert_self_contained(text, plots=5)
    assert text.count('<div class="scroll"><table>') == text.count("<table>") == 3
    for rule in (".scroll{max-width:100%;overflow-x:auto", "white-space:pre-wrap", "svg{max-width:100%"):
        assert rule in text, rule


def test_a_summary_json_path_names_its_run(tmp_path):
    """Item 8e: `lmbatch report X/summary.json` said "(no summary.json)"."""
    run = write_scored_run(tmp_path, "r", SIX)
    r = report_cli(run / "summary.json")
    assert r.exit_code == 0 and r.stdout.splitlines()[2].split()[:2] == ["r", "mmlu"]
    assert gate(run / "summary.json", run)[0] == 0
