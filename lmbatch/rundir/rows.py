"""The rows of the Parquet tables a run writes, as typed records (docs/outputs.md): instances.parquet's
(`InstanceRow`) and requests.parquet's (`RequestRow`), their Arrow schemas derived from them, and the
tables read back (as records, or as `lmbatch report` reads them); every column name is spelled here.

Imports nothing beyond the standard library at import time (pyarrow when a schema or table is made)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    import pyarrow as pa


INT32 = {"arrow": "int32"}      # a column narrower than int64 (the annotation says int)


@dataclass
class InstanceRow:
    """A row of instances.parquet (docs/outputs.md): one program instance, its answer, scores and tokens;
    `attempt` the attempt that ran it, `number` its place in the task (in parts only)."""
    task: str
    subject: str
    id: str
    prediction: str | None
    gold: str | None
    correct: bool | None
    logprobs: list[float]
    is_greedy: list[bool]
    metrics: dict[str, float]
    outputs: str
    error: str | None
    prompt_tokens: int
    cached_tokens: int
    computed_tokens: int
    decode_tokens: int
    inputs: str
    attempt: int = field(default=0, metadata=INT32)
    number: int = 0


@dataclass
class RequestRow:
    """A row of requests.parquet: one executed request of an instance kept (`token_ids` with
    --save-token-ids, else None and not written)."""
    order: int
    wave: int = field(metadata=INT32)
    instance_id: str
    task: str | None
    stage: int = field(metadata=INT32)
    call: str
    kind: str
    choices: list[int]
    prompt_tokens: int
    cached_tokens: int
    computed_tokens: int
    decode_tokens: int
    token_ids: list[int] | None = None
    attempt: int = field(default=0, metadata=INT32)


def _arrow(annotation: str, meta: Any) -> pa.DataType:
    import pyarrow as pa

    if meta.get("arrow") == "int32":
        return pa.int32()
    scalar = {"str": pa.string(), "int": pa.int64(), "float": pa.float64(), "bool": pa.bool_()}
    kind = annotation.removesuffix(" | None")
    if kind.startswith("list["):
        item = kind[5:-1]
        return pa.list_(pa.int32() if item == "int" else scalar[item])
    if kind.startswith("dict[str, "):
        return pa.map_(pa.string(), scalar[kind[10:-1]])
    return scalar[kind]


def _schema(row: type, leave_out: tuple[str, ...]) -> pa.Schema:
    import pyarrow as pa

    return pa.schema([(f.name, _arrow(str(f.type), f.metadata)) for f in dataclasses.fields(row)
                      if f.name not in leave_out])


@cache
def instance_schema(part: bool = False) -> pa.Schema:
    """instances.parquet's columns as a program's scoring gives them; `part`: with its attempt and number, as
    a part holds them (the merged file has the attempt, not the number)."""
    return _schema(InstanceRow, () if part else ("attempt", "number"))


@cache
def request_schema(with_tokens: bool, part: bool = False) -> pa.Schema:
    """requests.parquet's columns (`token_ids` with --save-token-ids); `part`: with the attempt, as a part and
    the merged file hold them."""
    return _schema(RequestRow, ("token_ids",) * (not with_tokens) + ("attempt",) * (not part))


Row = TypeVar("Row", InstanceRow, RequestRow)


def table(rows: list[Row], schema: pa.Schema) -> pa.Table:
    """Rows as a table of `schema` (the fields it leaves out are not written)."""
    import pyarrow as pa

    return pa.Table.from_pylist([vars(r) for r in rows], schema=schema)


def instance_rows(t: pa.Table) -> list[InstanceRow]:
    """A table of instance rows back as records (a Parquet map reads back as pairs: a dict again)."""
    return [InstanceRow(**{**d, "metrics": dict(d["metrics"])}) for d in t.to_pylist()]


def numbered(path: Path) -> list[tuple[int, str]]:
    """The (number, id) of each instance of a part's instances file."""
    import pyarrow.parquet as pq

    t = pq.read_table(path, columns=["number", "id"])
    return list(zip(t.column("number").to_pylist(), t.column("id").to_pylist()))


def in_order(instances: pa.Table, requests: pa.Table) -> tuple[pa.Table, pa.Table]:
    """Parts' rows in the final files' order: instances by number, requests by attempt, then in the order their
    results became final."""
    return instances.sort_by("number"), requests.sort_by([("attempt", "ascending"), ("order", "ascending")])


def unnumbered(instances: pa.Table) -> pa.Table:
    """Instance rows as instances.parquet holds them: without the number a part keeps them by."""
    return instances.drop_columns(["number"])


@dataclass
class InstanceScores:
    """What `lmbatch report` reads of an instance row: its task, id, metrics (None where it failed) and token
    counts (0 in files written before they were recorded)."""
    task: str
    id: str
    metrics: dict[str, float] | None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    computed_tokens: int = 0


class ColumnMissing(ValueError):
    """An instances file without a column report reads: not one lmbatch wrote."""


SCORE_COLUMNS = ("task", "id", "metrics", "error")


TOKEN_COLUMNS = ("prompt_tokens", "cached_tokens", "computed_tokens")


def read_scores(path: Path) -> list[InstanceScores]:
    """An instances file's rows as report reads them, in file order; ColumnMissing naming a column it lacks
    (pyarrow's errors for a file that is no Parquet file)."""
    import pyarrow.parquet as pq

    names = set(pq.read_schema(path).names)
    missing = [c for c in SCORE_COLUMNS if c not in names]
    if missing:
        raise ColumnMissing(f"{path} has no column {missing[0]!r}: not an instances file lmbatch wrote")
    t = pq.read_table(path, columns=[*SCORE_COLUMNS, *(c for c in TOKEN_COLUMNS if c in names)])
    return [InstanceScores(str(d["task"]), str(d["id"]),
                           None if d["error"] is not None else {str(k): v for k, v in d["metrics"] or []},
                           **{k: d.get(k) or 0 for k in TOKEN_COLUMNS}) for d in t.to_pylist()]
