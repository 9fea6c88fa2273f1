"""lmbatch.report on synthetic run directories (no model, no data)."""

import json
import re
from pathlib import Path

import pytest

from lmbatch.errors import UserError
from lmbatch.report import compare, load_summary, render, report_rows


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
        "device": "cpu", "instances": 570, "failed": None, "accuracy": 0.31, "hit_rate": 0.43, "optimal_hit_rate": 0.86,
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
        "speed: candidate 12.3 programs/s vs base 12: 2.5% faster ok",
        "hit rate: candidate 0.8600 of optimal 0.8600 (ratio 1.0000, base 0.9302) ok",
        "accuracy: candidate 0.3200 vs base 0.3100 (+0.0100) ok",
    ]


def test_compare_speed_regression():
    # exactly 5% slower (base / cand - 1 == 0.05) passes; beyond it fails
    ok, lines = compare(make_summary(programs_per_s=10.5), make_summary(programs_per_s=10.0))
    assert ok and lines[0].startswith("speed: ") and lines[0].endswith(" ok")
    ok, lines = compare(make_summary(programs_per_s=12.0), make_summary(programs_per_s=11.2))
    assert not ok
    assert lines[0] == ("REGRESSION speed: candidate 11.2 programs/s vs base 12: 7.1% slower "
                        "(more than the 5.0% allowed)")
    # one percentage, and small rates readable (not "0.0 programs/s")
    ok, lines = compare(make_summary(programs_per_s=0.303), make_summary(programs_per_s=0.0142))
    assert lines[0] == ("REGRESSION speed: candidate 0.0142 programs/s vs base 0.303: 2033.8% slower "
                        "(more than the 5.0% allowed)")
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
    from lmbatch.report import _cell

    assert _cell("programs_per_s", 0.0142) == "0.0142" and _cell("programs_per_s", 123.45) == "123.5"


# --- a run's files are checked against its summary (#22 item 5) -------------------------------------------

def write_checked_run(root: Path, run_id: str, ids=("a1", "a2")) -> Path:
    """A run directory whose summary records its two Parquet files as the runner does (outputs.file_record)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from lmbatch.outputs import file_record

    run = root / run_id
    run.mkdir()
    tables = {"instances.parquet": pa.table({"id": list(ids), "prediction": ["A"] * len(ids)}),
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

    from lmbatch.outputs import file_record

    data = bytes(range(256)) * 5000     # more than one 1 MiB block
    (tmp_path / "f").write_bytes(data)
    assert file_record(tmp_path / "f", 7) == {"rows": 7, "bytes": len(data),
                                              "sha256": hashlib.sha256(data).hexdigest()}


def test_report_of_an_intact_run(tmp_path):
    a, b = write_checked_run(tmp_path, "run-a"), write_checked_run(tmp_path, "run-b", ids=("b1", "b2"))
    r = report_cli(a, b)
    assert r.exit_code == 0, r.output
    assert [ln.split()[0] for ln in r.stdout.splitlines()[2:]] == ["run-a", "run-b"]
    r = report_cli("--compare", a, b)
    assert r.exit_code == 0, r.output
    assert load_summary(a)["files"]["instances.parquet"]["rows"] == 2


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
    assert load_summary(other)["run_id"] == "run-b"     # the source of a copy is untouched and intact


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
    from lmbatch.report import workload_differences

    def with_options(**kw):
        s = make_summary()
        s["options"] = {**s["options"], **kw}
        return s
    base = with_options(subjects=["a", "b"], limit=10, seed=0)
    assert workload_differences(base, with_options(subjects=["b", "a", "a"], limit=10, seed=0)) == []
    assert workload_differences(base, with_options(subjects=["a"], limit=10, seed=0)) == \
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
    ("metrics", {"acc_norm": "0.3"}, "field 'metrics.acc_norm' is '0.3', not a number"),
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
