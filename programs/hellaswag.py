"""HellaSwag with lm-evaluation-harness's ``hellaswag`` prompt; the data is `lmbatch.data.hellaswag`.

The few-shot context and acc_norm. The package has no train split, so few-shot examples come from
validation itself (seeded, excluding the question) and are shared by every question, so that one
prefix serves the whole run.
"""

from __future__ import annotations

import random
from functools import lru_cache
from typing import Any

from lmbatch.data.hellaswag import HellaSwagDoc, all_docs, count_docs, data_dir, load_docs
from lmbatch.frontend import State, select
from lmbatch.frontend.chat import ChatOptions, render
from lmbatch.frontend.workload import Instance, LoadArgs, Workload

TARGET_DELIMITER = " "
FEWSHOT_DELIMITER = "\n\n"
DEFAULT_SEED = 1234


def shot_indices(n_docs: int, shots: int, seed: int = DEFAULT_SEED) -> list[int]:
    """The seeded pool of ``shots + 1`` candidate rows; a question uses the first ``shots`` that are not itself."""
    return random.Random(seed).sample(range(n_docs), shots + 1)


def _shot_text(doc: HellaSwagDoc) -> str:
    return doc.query + TARGET_DELIMITER + doc.choices[doc.gold]


@lru_cache(maxsize=64)
def _prefix(shots: int, seed: int, skip: int) -> str:
    docs = all_docs()
    chosen = [i for i in shot_indices(len(docs), shots, seed) if i != skip][:shots]
    return "".join(_shot_text(docs[i]) + FEWSHOT_DELIMITER for i in chosen)


def build_context(doc: HellaSwagDoc, shots: int, seed: int = DEFAULT_SEED, chat: ChatOptions = ChatOptions(),
                  tokenizer: Any = None) -> str:
    """lm-eval ``hellaswag`` context: ``shots`` validation examples (never ``doc`` itself), then the query;
    with `chat`, as lm-eval renders them (frontend/chat.py)."""
    pool = shot_indices(len(all_docs()), shots, seed)
    skip = doc.index if doc.index in pool else -1  # -1: every non-shot doc shares one cached prefix
    if not chat.apply and not chat.system_instruction:
        return _prefix(shots, seed, skip) + doc.query
    docs = all_docs()
    examples = [(docs[i].query, docs[i].choices[docs[i].gold]) for i in pool if i != skip][:shots]
    return render(getattr(tokenizer, "hf", tokenizer), chat, "", examples, doc.query)


def continuations(doc: HellaSwagDoc, chat: ChatOptions = ChatOptions()) -> list[str]:
    """The four continuations: target_delimiter " " + choice (the choice alone after a chat template)."""
    delimiter = TARGET_DELIMITER if chat.target_delimiter is None else chat.target_delimiter
    return [delimiter + c for c in doc.choices]


def lm_eval_acc_norm(logprobs: list[float], continuations: list[str]) -> int:
    """lm-eval's acc_norm prediction: argmax of logprob / character length of the choice.

    lm-eval (``ConfigurableTask.process_results``, multiple_choice) computes
    ``completion_len = np.array([float(len(i)) for i in choices])`` with ``choices = doc_to_choice(doc)``,
    the bare choice strings; the target delimiter is only added when building the requests. So the length
    here excludes the leading " " of each continuation. Ties go to the first index, as ``np.argmax``.
    """
    if len(logprobs) != len(continuations) or not logprobs:
        raise ValueError(f"need one logprob per continuation, got {len(logprobs)} and {len(continuations)}")
    if not all(c.startswith(TARGET_DELIMITER) for c in continuations) and any(c[:1].isspace() for c in continuations):
        raise ValueError("continuations must all start with the target delimiter ' ' (see continuations()), or "
                         "none (after a chat template)")
    scores = [lp / len(c.removeprefix(TARGET_DELIMITER)) for lp, c in zip(logprobs, continuations)]
    return scores.index(max(scores))


# ---- the workload ----------------------------------------------------------------------------
def program(s: State, context: str, choices: list[str]) -> None:
    """The shots and the question's context, then a select over the four endings."""
    s += context
    s += select("answer", choices)


def instances(args: LoadArgs) -> list[Instance]:
    return [Instance(str(d.index), {"context": build_context(d, args.shots, args.seed, args.chat, args.tokenizer),
                                    "choices": continuations(d, args.chat)},
                     gold=d.gold) for d in load_docs(args.limit)]


def score(inst: Instance, s: State) -> dict[str, float]:
    meta = s.meta("answer")
    norm = lm_eval_acc_norm(meta["logprobs"], inst.inputs["choices"])
    return {"acc": float(meta["index"] == inst.gold), "acc_norm": float(norm == inst.gold)}


WORKLOAD = Workload("hellaswag", "HellaSwag, 10,042 validation questions; acc and acc_norm (lm-evaluation-harness "
                    "prompt); shots drawn once from validation, excluding the question", program, instances, score,
                    max_shots=None, answer="answer", shot_pool=count_docs, shot_pool_name="HellaSwag validation docs",
                    chat=True, generates=False,
                    data_files=lambda: sorted(f for f in data_dir().rglob("*") if f.is_file()))
