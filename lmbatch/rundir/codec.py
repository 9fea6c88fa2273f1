"""Typed records as JSON: a dataclass written field by field in its declared order (`Record.to_json`), and read
back with every field checked against its annotation (`Record.from_json`), so that a file of another shape is
one line naming the field, never a KeyError or a TypeError where the value is used.

Reading holds to what files of earlier lmbatch versions hold: a field with a default may be absent (None, or
`ABSENT` where absence means something else than null), keys a record does not name are ignored (a newer
file), and a number where a float is declared may be written as an integer. Non-finite numbers are refused
except where the annotation is `Score` (a metric's mean)."""
from __future__ import annotations

import dataclasses
import enum
import math
import types
from typing import Annotated, Any, TypeVar, Union, get_args, get_origin, get_type_hints


class Absent(enum.Enum):
    """A field that files of earlier versions lack, where null is a value of its own (`shots`: a suite's
    tasks' differ); `to_json` leaves it out."""
    ABSENT = "absent"


ABSENT = Absent.ABSENT
NAN_OK = "NaN allowed"
Score = Annotated[float, NAN_OK]        # a metric's mean: JSON's NaN is one (a float like any other here)


class RecordError(ValueError):
    """A field of a file that is not what its record says: absent (`value` is ABSENT), or of another type."""

    def __init__(self, field: str, value: Any = ABSENT, kind: str = ""):
        self.field, self.value, self.kind = field, value, kind
        super().__init__(self.line(""))

    def line(self, where: str) -> str:
        """'WHERE lacks field X', or 'WHERE: field X is VALUE (TYPE), not KIND'."""
        if self.value is ABSENT:
            return f"{where} lacks field '{self.field}'".lstrip()
        shown = repr(self.value) if len(repr(self.value)) <= 40 else repr(self.value)[:37] + "..."
        head = f"{where}: " if where else ""
        return f"{head}field '{self.field}' is {shown} ({type(self.value).__name__}), not {self.kind}"


R = TypeVar("R", bound="Record")


class Record:
    """A dataclass whose fields are JSON values, lists, objects of string keys, and other records."""

    def to_json(self) -> dict[str, Any]:
        """Its fields in declared order, each record within as its own object; ABSENT fields left out."""
        assert dataclasses.is_dataclass(self)
        return {f.name: _out(getattr(self, f.name)) for f in dataclasses.fields(self)
                if getattr(self, f.name) is not ABSENT}

    @classmethod
    def from_json(cls: type[R], data: Any, path: str = "") -> R:
        """The record `data` holds; RecordError naming the first field (dotted from `path`) that is absent
        without a default or not of its type."""
        if not isinstance(data, dict):
            raise RecordError(path or "(top)", data, "an object")
        values = {}
        for f, hint in _fields(cls):
            dotted = f"{path}.{f.name}" if path else f.name
            if f.name in data:
                optional = f.default is None
                values[f.name] = _parse(data[f.name], hint, dotted, optional)
            elif f.default is not dataclasses.MISSING:
                values[f.name] = f.default
            elif f.default_factory is not dataclasses.MISSING:
                values[f.name] = f.default_factory()
            else:
                raise RecordError(dotted)
        return cls(**values)


_FIELDS: dict[type, list[tuple[dataclasses.Field[Any], Any]]] = {}


def _fields(cls: type) -> list[tuple[dataclasses.Field[Any], Any]]:
    """A record's fields with their annotations resolved (once per class)."""
    if cls not in _FIELDS:
        hints = get_type_hints(cls, include_extras=True)
        _FIELDS[cls] = [(f, hints[f.name]) for f in dataclasses.fields(cls)]
    return _FIELDS[cls]


def _out(value: Any) -> Any:
    if isinstance(value, Record):
        return value.to_json()
    if isinstance(value, list):
        return [_out(v) for v in value]
    if isinstance(value, dict):
        return {k: _out(v) for k, v in value.items()}
    return value


def _parse(value: Any, hint: Any, dotted: str, optional: bool = False) -> Any:
    """`value` checked against `hint`; `optional`: the field's default is None (absent in earlier files), so
    null is taken as absent and the error names its type alone."""
    base, nan_ok = hint, False
    if get_origin(hint) is Annotated:
        base, *extra = get_args(hint)
        nan_ok = NAN_OK in extra
    if base is Any:
        return value
    if get_origin(base) in (Union, types.UnionType):
        nullable = type(None) in get_args(base)
        if nullable and value is None:
            return None
        (only,) = [a for a in get_args(base) if a not in (Absent, type(None))]
        return _parse_one(value, only, dotted, nan_ok, " or null" if nullable and not optional else "")
    return _parse_one(value, base, dotted, nan_ok, "")


def _parse_one(value: Any, hint: Any, dotted: str, nan_ok: bool, null: str) -> Any:
    if get_origin(hint) is Annotated:
        hint, *extra = get_args(hint)
        nan_ok = nan_ok or NAN_OK in extra
    origin = get_origin(hint)
    if isinstance(hint, type) and issubclass(hint, Record):
        if not isinstance(value, dict):
            raise RecordError(dotted, value, "an object" + null)
        return hint.from_json(value, dotted)
    if origin is list:
        if not isinstance(value, list):
            raise RecordError(dotted, value, "a list" + null)
        (item,) = get_args(hint)
        return [_parse(v, item, f"{dotted}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise RecordError(dotted, value, "an object" + null)
        _, item = get_args(hint)
        return {k: _parse(v, item, f"{dotted}.{k}") for k, v in value.items()}
    if _fits(value, hint, nan_ok):
        return value
    raise RecordError(dotted, value, KINDS[hint] + null)


KINDS = {float: "a number", int: "an integer", str: "a string", bool: "true or false"}


def _fits(value: Any, hint: Any, nan_ok: bool) -> bool:
    if hint is bool:
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if hint is int:
        return isinstance(value, int)
    if hint is float:
        return isinstance(value, (int, float)) and (nan_ok or math.isfinite(value))
    return isinstance(value, hint)
