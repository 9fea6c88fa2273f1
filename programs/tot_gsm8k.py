"""Tree of thought on GSM8K, in the style of the SGLang paper's ToT benchmark.

Each level forks every kept state into BRANCHES sampled proposals of a next step, asks the model
to judge each proposal (a select between " yes" and " no"), and keeps the KEEP best by the
judgement's log-odds; after LEVELS levels the best state states its final answer, which is scored
against the number after "####". A question issues 16 generation and 15 select calls in 7 stages,
and all of them share the few-shot prefix and the question's own growing text.

The prompt pieces (few-shot prefix, question block, judge and answer prompts) and the answer
extraction and scoring live here; `lmbatch.data.gsm8k` loads the rows and their gold numbers.
"""
from __future__ import annotations

import re
from decimal import Decimal

from lmbatch.data.gsm8k import (
    NUMBER,
    GSM8KQuestion,
    canonical_number,
    clean_numbers,
    data_file,
    load_questions,
    normalize_number,
)
from lmbatch.frontend import State, gen, select
from lmbatch.frontend.workload import Instance, LoadArgs, Workload

LEVELS = 3
BRANCHES = 3
KEEP = 2
STEP_TOKENS = 48
ANSWER_TOKENS = 16
TEMPERATURE = 0.7

# Appended after a candidate step to ask the model to judge it; the program scores " yes" vs " no".
EVAL_PROMPT = "\nIs this step correct and useful? Answer yes or no:"
# Appended (after the chosen steps) to ask the model for the final number.
ANSWER_PROMPT = "The answer is"

_ANSWER_IS = re.compile(r"the answer is[\s:*]*", re.IGNORECASE)
_HASHES = re.compile(r"####[\s:*]*")


def _number_after(marker: re.Pattern[str], text: str) -> str | None:
    """The number right after the first occurrence of ``marker`` that is followed by one."""
    for m in marker.finditer(text):
        n = NUMBER.match(text, m.end())
        if n:
            return n.group()
    return None


def extract_answer(text: str) -> str | None:
    """The final answer in generated text: the number after "The answer is" (first such, any case),
    else after "####", else the last number in the text; normalized. None if the text has no number."""
    text = clean_numbers(text)
    raw = _number_after(_ANSWER_IS, text) or _number_after(_HASHES, text)
    if raw is None:
        numbers = NUMBER.findall(text)
        raw = numbers[-1] if numbers else None
    return None if raw is None else canonical_number(raw)


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


def _judge(states: list) -> list[float]:
    """Log-odds that each state's last step is correct, by the model's own yes/no. Every question
    is queued before the first answer is read, so they run in one wave."""
    asked = []
    for state in states:
        e = state.fork(1)[0]
        e += EVAL_PROMPT + select("ok", [" yes", " no"])
        asked.append(e)
    return [e.meta("ok")["logprobs"][0] - e.meta("ok")["logprobs"][1] for e in asked]


def program(s: State, question: str) -> None:
    s += FEWSHOT + question
    frontier = [s]
    for level in range(1, LEVELS + 1):
        children: list[State] = []
        for state in frontier:
            forks = state.fork(BRANCHES)
            forks += f"Step {level}:" + gen("step", STEP_TOKENS, stop="\n", temperature=TEMPERATURE)
            children.extend(forks)
        judged = _judge(children)
        keep = KEEP if level < LEVELS else 1
        best = sorted(range(len(children)), key=lambda k: -judged[k])[:keep]
        frontier = [children[k] for k in best]
        for state in frontier:
            state += "\n"
    final = frontier[0]
    final += ANSWER_PROMPT + gen("answer", ANSWER_TOKENS, stop="\n")
    s["answer"] = final["answer"]
    s["solution"] = final.text[len(FEWSHOT):]


def instances(args: LoadArgs) -> list[Instance]:
    return [Instance(str(q.index), {"question": question_prompt(q)}, gold=q.gold) for q in load_questions(args.limit)]


def score(inst: Instance, s: State) -> dict[str, float]:
    return {"acc": float(is_correct(extract_answer(s["answer"]), inst.gold))}


WORKLOAD = Workload("tot-gsm8k", f"Tree of thought on GSM8K, 1,319 test questions: {LEVELS} levels of {BRANCHES} "
                    f"sampled next steps per kept state, self-judged, best {KEEP} kept", program, instances, score,
                    max_shots=0, data_files=lambda: [data_file()], stages=2 * LEVELS + 1)
