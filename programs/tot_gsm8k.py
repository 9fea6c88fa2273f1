"""Tree of thought on GSM8K, in the style of the SGLang paper's ToT benchmark.

Each level forks every kept state into BRANCHES sampled proposals of a next step, asks the model
to judge each proposal (a select between " yes" and " no"), and keeps the KEEP best by the
judgement's log-odds; after LEVELS levels the best state states its final answer, which is scored
against the number after "####". A question issues 16 generation and 15 select calls in 7 stages,
and all of them share the few-shot prefix and the question's own growing text.
"""
from __future__ import annotations

from lmbatch.data.gsm8k import (
    ANSWER_PROMPT,
    EVAL_PROMPT,
    FEWSHOT,
    extract_answer,
    is_correct,
    load_questions,
    question_prompt,
)
from lmbatch.frontend import gen, select
from lmbatch.frontend.workload import Instance, LoadArgs, Workload

LEVELS = 3
BRANCHES = 3
KEEP = 2
STEP_TOKENS = 48
ANSWER_TOKENS = 16
TEMPERATURE = 0.7


def _judge(states: list) -> list[float]:
    """Log-odds that each state's last step is correct, by the model's own yes/no. Every question
    is queued before the first answer is read, so they run in one wave."""
    asked = []
    for state in states:
        e = state.fork(1)[0]
        e += EVAL_PROMPT + select("ok", [" yes", " no"])
        asked.append(e)
    return [e.meta("ok")["logprobs"][0] - e.meta("ok")["logprobs"][1] for e in asked]


def program(s, question: str) -> None:
    s += FEWSHOT + question
    frontier = [s]
    for level in range(1, LEVELS + 1):
        children = []
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


def score(inst: Instance, s) -> dict[str, float]:
    return {"acc": float(is_correct(extract_answer(s["answer"]), inst.gold))}


WORKLOAD = Workload("tot-gsm8k", f"Tree of thought on GSM8K, 1,319 test questions: {LEVELS} levels of {BRANCHES} "
                    f"sampled next steps per kept state, self-judged, best {KEEP} kept", program, instances, score,
                    max_shots=0)
