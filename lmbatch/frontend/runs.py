"""`ProgramRun`: the interpreter's record of one instance's program while it runs in its greenlet."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Protocol

import greenlet

from lmbatch.errors import UserError
from lmbatch.frontend.dsl import Gen, Pending, Select, State
from lmbatch.frontend.workload import Instance
from lmbatch.requests import TokenCounts

if TYPE_CHECKING:
    from lmbatch.frontend.tokenize import TextEncoder


class Waves(Protocol):
    """What runs a program's calls (the `Interpreter`): the queue of every program's calls, and the
    greenlet that runs the waves."""
    ready: list[Pending]
    hub: greenlet.greenlet
    encoder: TextEncoder            # its `hf` tokenizer renders chat messages


class Status(Enum):
    NEW = "new"                 # no call of it has been in a wave yet
    STARTED = "started"         # some call of it has been in a wave
    COMPLETE = "complete"       # it has returned, and every call it made has its result


@dataclass(eq=False)
class ProgramRun:
    """One instance's program while it runs."""
    index: int                      # position in the interpreter's runs
    instance: Instance
    interp: Waves
    state: State | None = None
    glet: greenlet.greenlet | None = None
    stage: int = 0
    calls: list[Pending] = field(default_factory=list)
    error: str | None = None        # why it failed (its own exception, or a call that could not run)
    user_error: UserError | None = None     # a first-stage call that cannot run: the run stops with it
    tokens: TokenCounts = field(default_factory=TokenCounts)
    number: int = -1                # position in the task's instances (a resumed run runs only some)
    status: Status = Status.NEW

    @property
    def started(self) -> bool:
        """Some call of it has been in a wave."""
        return self.status is not Status.NEW

    @property
    def footprint(self) -> int:
        """Tokens this program has put into the cache (prefill and decode)."""
        return self.tokens.computed_tokens + self.tokens.decode_tokens

    def submit(self, op: Gen | Select, prompt: str) -> Pending:
        p = Pending(op, prompt, self, self.stage, len(self.calls))
        self.calls.append(p)
        self.interp.ready.append(p)
        return p

    def chat(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        from lmbatch.frontend.chat import apply_template, has_template

        hf = self.interp.encoder.hf
        if not has_template(hf):
            raise UserError(f"instance {self.instance.id}: s.chat: the model's tokenizer has no chat template")
        return apply_template(hf, messages, add_generation_prompt)

    def wait(self, pending: list[Pending]) -> None:
        if not pending:
            return
        if greenlet.getcurrent() is not self.glet:
            raise RuntimeError("a program's results were read before they were computed")
        while not all(p.done for p in pending):
            self.interp.hub.switch()
        self.stage += 1

    @property
    def finished(self) -> bool:
        return self.glet is None or self.glet.dead
