"""Workload pieces of the programs that the data loaders do not hold: GSM8K's prompt pieces, answer
extraction and scoring (programs/tot_gsm8k.py), and the json workload's schema and prompt
(programs/json_cities.py)."""

from __future__ import annotations

import json
import re

import pytest

from lmbatch.data import gsm8k, wiki_cities
from lmbatch.programs import json_cities, tot_gsm8k


@pytest.mark.parametrize("text, want", [
    ("The answer is $1,234.", "1234"),
    ("#### 72", "72"),
    ("so 5 + 3 = 8 apples", "8"),
    ("none", None),
    ("", None),
    ("She has 10 - 3 = 7 left. The answer is 7.", "7"),
    ("the ANSWER is: **-12**", "-12"),
    ("Step 1: 2 * 4 = 8\nThe answer is 8.\n\nQuestion: Bob has 5 cats", "8"),  # first "The answer is" wins
    ("The answer is eighteen. 3 + 4 = 7", "7"),  # no number after it: last number
    ("It costs 2.50 each, 3 * 2.50 = 7.50\n#### 7.50 dollars, or 750 cents", "7.5"),  # #### over last number
    ("The answer is 9, #### 4", "9"),  # "The answer is" over ####
    ("a temperature of -3 degrees", "-3"),
    ("10-3=7", "7"),  # a hyphen between numbers is not a sign
    ("He picks boxes 1,2,3", "3"),  # only 3-digit groups are thousands
    ("The answer is 0.5.", "0.5"),
])
def test_extract_answer(text: str, want: str | None) -> None:
    assert tot_gsm8k.extract_answer(text) == want


@pytest.mark.parametrize("pred, gold, want", [
    ("18", "18", True), ("18.0", "18", True), ("18.00", "18", True), ("$18", "18", True),
    ("1,234", "1234", True), ("-3", "-3", True), ("3", "-3", False), ("17", "18", False),
    ("0.5", "0.50", True), (None, "18", False), ("none", "18", False),
])
def test_is_correct(pred: str | None, gold: str, want: bool) -> None:
    assert tot_gsm8k.is_correct(pred, gold) is want


def test_extract_then_score_pipeline() -> None:
    q = gsm8k.load_questions(1)[0]
    assert tot_gsm8k.is_correct(tot_gsm8k.extract_answer(q.answer), q.gold)  # the reference solution scores
    assert tot_gsm8k.is_correct(tot_gsm8k.extract_answer("16 - 3 - 4 = 9, 9 * 2 = 18. The answer is $18.00."), q.gold)


def test_question_prompt_and_constants() -> None:
    q = gsm8k.load_questions(1)[0]
    assert tot_gsm8k.question_prompt(q) == f"Question: {q.question}\nAnswer: Let's think step by step.\n"
    assert tot_gsm8k.ANSWER_PROMPT == "The answer is"
    assert tot_gsm8k.EVAL_PROMPT.startswith("\n") and tot_gsm8k.EVAL_PROMPT.endswith("yes or no:")


_SHOT = re.compile(r"Question: (.+)\nAnswer: Let's think step by step\.\n((?:Step \d+: .+\n)+)The answer is (\S+)\.")
_ARITH = re.compile(r"(\d+) ([-+*]) (\d+) = (\d+)")


def test_fewshot_format_and_answers() -> None:
    assert tot_gsm8k.FEWSHOT.endswith("\n\n") and not tot_gsm8k.FEWSHOT.endswith("\n\n\n")
    blocks = tot_gsm8k.FEWSHOT[:-2].split("\n\n")
    assert len(blocks) == 2
    questions = {q.question for q in gsm8k.load_questions()}
    answers = []
    for block in blocks:
        m = _SHOT.fullmatch(block)
        assert m, block
        question, steps, answer = m.groups()
        assert question not in questions  # original, not from the test set we evaluate on
        step_lines = steps.rstrip("\n").split("\n")
        assert [s.split(":")[0] for s in step_lines] == [f"Step {i}" for i in range(1, len(step_lines) + 1)]
        assert _ARITH.search(steps)
        for a, op, b, c in _ARITH.findall(steps):  # the worked arithmetic is right
            assert {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op] == int(c)
        assert tot_gsm8k.extract_answer(block) == answer
        assert tot_gsm8k.extract_answer(step_lines[-1]) == answer  # the last step ends on the answer
        answers.append(answer)
    assert answers == ["29", "13"]
    assert tot_gsm8k.extract_answer(tot_gsm8k.FEWSHOT) == "29"  # extraction takes the first "The answer is"


def test_prompt_ends_where_the_json_begins() -> None:
    doc = wiki_cities.load_cities(1)[0]
    p = json_cities.prompt(doc)
    assert p.startswith(json_cities.INSTRUCTION) and doc.summary.strip() in p and p.endswith("\nJSON:\n")


def test_schema_compiles_and_bounds_strings() -> None:
    pytest.importorskip("xgrammar")
    from transformers import AutoTokenizer

    from lmbatch.grammar import GrammarCompiler
    from lmbatch.model.embedded import embedded_model_dir

    tok = AutoTokenizer.from_pretrained(embedded_model_dir())
    gc = GrammarCompiler(tok, vocab_size=len(tok))
    gc.compile(json_schema=json_cities.SCHEMA)
    good = {"name": "São Paulo", "country": "Brazil", "population": 12325232, "founded": "1554",
            "landmarks": ["Paulista Avenue", "Ibirapuera Park"]}
    text = json.dumps(good, separators=(",", ":"), ensure_ascii=False)

    def accepts(s: str) -> bool:
        c = gc.constraint(json_schema=json_cities.SCHEMA)
        return c.accept_string(s) and c.is_completed()

    assert gc.constraint(json_schema=json_cities.SCHEMA).jump_forward() == '{"name":"'
    assert accepts(text)
    assert accepts(text.replace('"1554"', "null").replace('"population":12325232', '"population":null'))
    assert not accepts(text.replace("São Paulo", "x" * 41))          # at most 40 characters
    assert not accepts(text.replace("São Paulo", "São\tPaulo"))      # no raw control character
    assert not accepts(text.replace('"Brazil"', '""'))               # no empty name or country
    assert not accepts(text.replace("]", ',"a","b"]'))               # at most 3 landmarks
    assert gc.compiled_count == 1
    # the prompt's tokens then the JSON's are the tokenization of the whole text
    p = json_cities.prompt(wiki_cities.load_cities(1)[0])
    ids = tok.encode(p, add_special_tokens=False) + tok.encode(text, add_special_tokens=False)
    assert ids == tok.encode(p + text, add_special_tokens=False)
