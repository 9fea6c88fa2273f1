"""MMLU with lm-evaluation-harness's ``mmlu`` prompt; the data is `lmbatch.data.mmlu`."""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Protocol, Sequence

from lmbatch.data.mmlu import MMLUQuestion, data_root, dev_shots, load_questions, subject_names
from lmbatch.frontend import State, select
from lmbatch.frontend.chat import ChatOptions, render
from lmbatch.frontend.tokenize import choice_texts, split_choices
from lmbatch.frontend.workload import Instance, LoadArgs, Workload

LETTERS = ("A", "B", "C", "D")
CONTINUATIONS = tuple(" " + letter for letter in LETTERS)  # target_delimiter " " + choice


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


def doc_to_text(d: MMLUQuestion) -> str:
    """lm-eval's mmlu ``doc_to_text``."""
    c = d.choices
    return f"{d.question.strip()}\nA. {c[0]}\nB. {c[1]}\nC. {c[2]}\nD. {c[3]}\nAnswer:"


@lru_cache(maxsize=None)
def _prefix(subject: str, shots: int) -> str:
    pool = dev_shots(subject)
    return _description(subject) + "".join(f"{doc_to_text(d)} {LETTERS[d.answer]}\n\n" for d in pool[:shots])


def _description(subject: str) -> str:
    return f"The following are multiple choice questions (with answers) about {subject.replace('_', ' ')}.\n\n"


def build_context(subject: str, shots: int, question: MMLUQuestion, chat: ChatOptions = ChatOptions(),
                  tokenizer: Any = None) -> str:
    """lm-eval ``mmlu`` context: description, first ``shots`` dev examples (first_n), then the question;
    with `chat`, as lm-eval renders them (system instruction, chat template: frontend/chat.py)."""
    if not chat.apply and not chat.system_instruction:
        return _prefix(subject, shots) + doc_to_text(question)
    examples = [(doc_to_text(d), LETTERS[d.answer]) for d in dev_shots(subject)[:shots]]
    return render(getattr(tokenizer, "hf", tokenizer), chat, _description(subject), examples, doc_to_text(question))


def encode_pair(tokenizer: Tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval HFLM ``_encode_pair``: context's trailing whitespace moves onto the continuation."""
    ctx, (cont,) = encode_choices(tokenizer, context, [continuation])
    return ctx, cont


def encode_choices(tokenizer: Tokenizer, context: str,
                   continuations: Sequence[str]) -> tuple[list[int], list[list[int]]]:
    """``encode_pair`` for several continuations of one context, encoding the context once."""
    context, wholes = choice_texts(context, continuations)
    return split_choices(tokenizer.encode(context, add_special_tokens=False),
                         [tokenizer.encode(w, add_special_tokens=False) for w in wholes])


def program(s: State, context: str, choices: tuple[str, ...] = CONTINUATIONS) -> None:
    """The MMLU program: the few-shot context, then a select over the four letters (after a chat
    template's generation prompt: the letters alone, as lm-eval sends them)."""
    s += context
    s += select("answer", choices)


def instances(args: LoadArgs) -> list[Instance]:
    extra = {"choices": LETTERS} if args.chat.apply else {}
    return [Instance(f"{q.subject}/{q.index}", {"context": build_context(q.subject, args.shots, q, args.chat,
                                                                         args.tokenizer), **extra},
                     q.subject, q.answer)
            for q in load_questions(args.subjects, args.limit)]


def score(inst: Instance, s: State) -> dict[str, float]:
    return {"acc": float(s.meta("answer")["index"] == inst.gold)}


WORKLOAD = Workload("mmlu", "MMLU, 57 subjects, 14,042 test questions; shots from each subject's dev split "
                    "(lm-evaluation-harness prompt)", program, instances, score, max_shots=5, answer="answer",
                    subjects=subject_names, chat=True, generates=False,
                    data_files=lambda: sorted(f for f in data_root().rglob("*") if f.is_file()))
