"""The run directory's files as typed records (lmbatch/rundir/records.py, rows.py; issue 59): docs/outputs.md describes
exactly the records, the derived Arrow schemas are those lmbatch always wrote, summaries round-trip byte for byte,
and a file of another shape is one line naming its field."""
from __future__ import annotations

import dataclasses
import json
import re
import typing
from pathlib import Path

import pyarrow as pa
import pytest

from lmbatch.rundir.codec import ABSENT, Record, RecordError
from lmbatch.rundir.records import Attempt, RunRecord, Summary
from lmbatch.rundir.rows import InstanceRow, RequestRow, instance_rows, instance_schema, request_schema, table

OUTPUTS = Path(__file__).resolve().parents[2] / "docs" / "outputs.md"


def _docs_summary() -> dict:
    """docs/outputs.md's summary.json block, its // comments removed."""
    text = OUTPUTS.read_text().split("## summary.json", 1)[1].split("```json\n", 1)[1].split("```", 1)[0]
    return json.loads(re.sub(r"\s*//[^\n]*", "", text))


def _same_fields(cls: type, value: object, where: str) -> list[str]:
    """Where a documented object's keys (and their order) are not its record's fields, recursively."""
    if not (isinstance(cls, type) and issubclass(cls, Record)):
        return []
    assert isinstance(value, dict), where
    names = [f.name for f in dataclasses.fields(cls)]
    out = [] if list(value) == names else [f"{where or 'summary'}: documented {list(value)}, record {names}"]
    hints = typing.get_type_hints(cls)
    for name in names:
        if name in value:
            out += _within(hints[name], value[name], f"{where}.{name}".lstrip("."))
    return out


def _within(hint: object, value: object, where: str) -> list[str]:
    for arg in typing.get_args(hint) or (hint,):          # X | None, list[X], dict[str, X]
        if typing.get_origin(arg) is list and isinstance(value, list):
            return [e for v in value for e in _within(typing.get_args(arg)[0], v, f"{where}[]")]
        if typing.get_origin(arg) is dict and isinstance(value, dict):
            item = typing.get_args(arg)[1]
            return [e for k, v in value.items() if k != "..." for e in _within(item, v, f"{where}.{k}")]
        if isinstance(arg, type) and issubclass(arg, Record):
            return _same_fields(arg, value, where)
    return []


def test_docs_summary_block_is_the_summary_record():
    """Every field docs/outputs.md shows is a field of `Summary` and the other way round, in the order summary.json
    is written, and of its type (a renamed or added field fails here until the docs say it)."""
    doc = _docs_summary()
    Summary.read(doc)
    assert not _same_fields(Summary, doc, "")


def _docs_columns(section: str) -> list[tuple[str, str]]:
    """A Parquet section's table of (column, type): its left half, then its right half."""
    body = OUTPUTS.read_text().split(f"## {section}\n", 1)[1].split("\n\n", 1)[0]
    left, right = [], []
    for line in body.splitlines()[2:]:
        cells = [c.strip().strip("`") for c in line.strip().strip("|").split("|")]
        left += [(cells[0], cells[1])] if cells[0] else []
        right += [(cells[3], cells[4])] if cells[3] else []
    return left + right


def _columns(schema: pa.Schema) -> list[tuple[str, str]]:
    return [(f.name, str(f.type).replace("item: ", "")) for f in schema]


def test_docs_tables_are_the_rows():
    assert _docs_columns("instances.parquet") == _columns(instance_schema(part=True))[:-1]    # not the part's number
    assert _docs_columns("requests.parquet") == _columns(request_schema(True, part=True))


def test_the_derived_schemas_are_those_lmbatch_always_wrote():
    """The schemas before they were derived from the rows (main 4787ceb, rundir/layout.py): the files stay the same."""
    instance = pa.schema([
        ("task", pa.string()), ("subject", pa.string()), ("id", pa.string()),
        ("prediction", pa.string()), ("gold", pa.string()), ("correct", pa.bool_()),
        ("logprobs", pa.list_(pa.float64())), ("is_greedy", pa.list_(pa.bool_())),
        ("metrics", pa.map_(pa.string(), pa.float64())), ("outputs", pa.string()), ("error", pa.string()),
        ("prompt_tokens", pa.int64()), ("cached_tokens", pa.int64()), ("computed_tokens", pa.int64()),
        ("decode_tokens", pa.int64()), ("inputs", pa.string())])
    assert instance_schema() == instance
    assert instance_schema(part=True) == instance.append(pa.field("attempt", pa.int32())).append(
        pa.field("number", pa.int64()))
    request = [("order", pa.int64()), ("wave", pa.int32()), ("instance_id", pa.string()), ("task", pa.string()),
               ("stage", pa.int32()), ("call", pa.string()), ("kind", pa.string()), ("choices", pa.list_(pa.int32())),
               ("prompt_tokens", pa.int64()), ("cached_tokens", pa.int64()), ("computed_tokens", pa.int64()),
               ("decode_tokens", pa.int64())]
    assert request_schema(False) == pa.schema(request)
    assert request_schema(True, part=True) == pa.schema([*request, ("token_ids", pa.list_(pa.int32())),
                                                         ("attempt", pa.int32())])


def test_rows_go_to_a_table_and_back():
    row = InstanceRow(task="mmlu", subject="anatomy", id="a/0", prediction="1", gold="2", correct=False,
                      logprobs=[-1.5, -0.5], is_greedy=[False, True], metrics={"acc": 0.0}, outputs="{}", error=None,
                      prompt_tokens=9, cached_tokens=4, computed_tokens=5, decode_tokens=0, inputs="{}", attempt=2,
                      number=7)
    assert instance_rows(table([row], instance_schema(part=True))) == [row]
    req = RequestRow(order=0, wave=1, instance_id="a/0", task="mmlu", stage=0, call="answer", kind="select",
                     choices=[0, 1], prompt_tokens=9, cached_tokens=4, computed_tokens=5, decode_tokens=0,
                     token_ids=[1, 2, 3])
    assert table([req], request_schema(False)).column_names == [f.name for f in request_schema(False)]


def test_a_summary_round_trips_byte_for_byte():
    doc = _docs_summary()
    del doc["stages"]["..."]
    text = json.dumps(doc, indent=2) + "\n"
    assert json.dumps(Summary.read(json.loads(text)).to_json(), indent=2) + "\n" == text


def test_fields_earlier_versions_lack():
    """A summary of the first versions: no shots (the --shots option said it), no accuracy_stderr, no tasks; an
    attempt of run.json killed before its first part has no execute_s. Absent stays absent when written again."""
    old = {k: v for k, v in _docs_summary().items() if k not in ("shots", "accuracy_stderr", "tasks", "files")}
    s = Summary.read(old)
    assert (s.shots, s.prompt_shots, s.accuracy_stderr, s.tasks, s.files) == (ABSENT, 0, ABSENT, None, None)
    assert "shots" not in s.to_json() and "accuracy_stderr" not in s.to_json()
    attempt = {"started": "2026-11-21T09:15:00+00:00", "seconds": 1.0, "instances": 0}
    record = RunRecord.from_json({"run_id": "r", "fingerprint": {"task": "mmlu"}, "dtype": None,
                                  "attempts": [attempt], "parts": {}})
    assert record.attempts == [Attempt("2026-11-21T09:15:00+00:00", 1.0, 0)]
    assert record.attempts[0].to_json() == {"started": "2026-11-21T09:15:00+00:00", "seconds": 1.0, "instances": 0}


@pytest.mark.parametrize("change,line", [
    (lambda s: s.pop("hit_rate"), "lacks field 'hit_rate'"),
    (lambda s: s["time_s"].pop("execute"), "lacks field 'time_s.execute'"),
    (lambda s: s["counts"].update(instances=True), "field 'counts.instances' is True (bool), not an integer"),
    (lambda s: s.update(accuracy="0.1"), "field 'accuracy' is '0.1' (str), not a number or null"),
    (lambda s: s.update(hit_rate=float("inf")), "field 'hit_rate' is inf (float), not a number"),
    (lambda s: s["tasks"]["tot-gsm8k"].update(compared_metrics="acc"),
     "field 'tasks.tot-gsm8k.compared_metrics' is 'acc' (str), not a list"),
    (lambda s: s["data_parallel"]["workers_load"][0].pop("busy_s"),
     "lacks field 'data_parallel.workers_load[0].busy_s'"),
], ids=["missing", "missing-phase", "bool-for-int", "str-for-number", "inf", "str-for-list", "nested-in-list"])
def test_a_field_of_another_shape_is_named(change, line):
    s = _docs_summary()
    change(s)
    with pytest.raises(RecordError) as e:
        Summary.read(s)
    assert e.value.line("") == line


def test_null_is_a_value_only_where_it_is_one():
    """null where a field is optional reads as absent; where null means something (shots: a suite's tasks
    differ; accuracy: none scored) it is kept; a metric's mean may be NaN."""
    s = _docs_summary()
    s.update(shots=None, accuracy=None, tokens=None, metrics={"acc": float("nan"), "acc_stderr": None})
    read = Summary.read(s)
    assert (read.shots, read.accuracy, read.tokens, read.prompt_shots) == (None, None, None, None)
    with pytest.raises(RecordError, match="field 'run_id' is None"):
        Summary.read({**s, "run_id": None})
