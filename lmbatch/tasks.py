"""Task registry: a task turns its data into program instances whose requests the engine runs."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from lmbatch.errors import UserError
from lmbatch.requests import ScoreRequest, ScoreResult


@dataclass
class ChoiceInstance:
    """A multiple-choice question scored by loglikelihood of each continuation (lm-eval semantics)."""
    task: str
    subject: str
    id: str
    gold: int
    context: list[int]
    continuations: list[list[int]]

    def requests(self) -> list[ScoreRequest]:
        return [ScoreRequest(self.context, c) for c in self.continuations]

    def truncate_left(self, max_len: int) -> bool:
        """Drop the context's oldest tokens so every request fits max_len. True if it changed."""
        over = len(self.context) + max(len(c) for c in self.continuations) - max_len
        if over <= 0:
            return False
        self.context = self.context[over:]
        return True

    @staticmethod
    def prediction(results: list[ScoreResult]) -> int:
        logprobs = [r.logprob for r in results]
        return max(range(len(logprobs)), key=logprobs.__getitem__)


@dataclass(frozen=True)
class Task:
    name: str
    description: str
    build: Callable  # (tokenizer, shots, limit, subjects) -> list[ChoiceInstance]
    max_shots: int


def _mmlu_build(*args):
    from lmbatch.programs import mmlu
    return mmlu.build_instances(*args)


TASKS = {
    "mmlu": Task("mmlu", "MMLU, 57 subjects, 14,042 test questions; shots from each subject's dev split "
                 "(lm-evaluation-harness prompt)", _mmlu_build, max_shots=5),
}


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise UserError(f"unknown task {name!r}; known tasks: {', '.join(sorted(TASKS))}")
    return TASKS[name]
