"""Prompts through a model's chat template, as lm-evaluation-harness renders them.

lm-eval 0.4.13 (`ConfigurableTask.fewshot_context`, `--apply_chat_template`, `--fewshot_as_multiturn`,
`--system_instruction`) builds a task's prompt as messages: a system message (the system
instruction and the task's description, joined by the few-shot delimiter where neither has
whitespace at the join), each few-shot example as a user turn (the question, then the target
delimiter) and an assistant turn (the answer, then the few-shot delimiter), then the question as a
user turn. Without a chat template the messages are concatenated as text (the plain prompt). With
one, they are rendered by `tokenizer.apply_chat_template(..., add_generation_prompt=True)`, either
as they are (`fewshot_as_multiturn`) or with every non-system message's text joined into one user
message. A template that rejects a system message gets the messages without it, as lm-eval retries.
A multiple-choice continuation then has no target delimiter before it (the template's generation
prompt ends the context).

`render` is that, for the built-in tasks; `State.chat` renders a program's own messages.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence


@dataclass(frozen=True)
class ChatOptions:
    """A run's --apply-chat-template, --system-instruction and --fewshot-as-multiturn."""
    apply: bool = False
    system_instruction: str | None = None
    fewshot_as_multiturn: bool = False

    @property
    def target_delimiter(self) -> str | None:
        """The delimiter before a multiple-choice continuation: none through a template (lm-eval's
        construct_requests), else the task's own (None: keep it)."""
        return "" if self.apply else None


def _delimit(prefix: str | None, suffix: str, delimiter: str) -> str:
    """lm-eval's maybe_delimit: joined with `delimiter` unless there is whitespace at the join."""
    if not prefix:
        return suffix
    if not suffix:
        return prefix
    return prefix + suffix if prefix[-1].isspace() or suffix[0].isspace() else prefix + delimiter + suffix


class Delimiters(NamedTuple):
    """A task's delimiters (lm-eval's defaults): before an answer, and after each few-shot example."""
    target: str = " "
    fewshot: str = "\n\n"


def render(tokenizer: Any, opts: ChatOptions, description: str, shots: Sequence[tuple[str, str]], question: str,
           delimiters: Delimiters = Delimiters()) -> str:
    """A task's context for one question: `shots` are (question, answer) pairs."""
    target_delimiter, fewshot_delimiter = delimiters
    system = _delimit(opts.system_instruction, description, fewshot_delimiter)
    turns: list[tuple[str, str, str]] = []          # (role, content, delimiter as text)
    for q, a in shots:
        turns += [("user", q, target_delimiter), ("assistant", a, fewshot_delimiter)]
    turns.append(("user", question, ""))
    if not opts.apply:
        return system + "".join(c + d for _, c, d in turns)
    if opts.fewshot_as_multiturn:
        messages = [{"role": r, "content": c} for r, c, _ in turns]
    else:
        messages = [{"role": "user", "content": "".join(c + d for _, c, d in turns)}]
    if system:
        messages.insert(0, {"role": "system", "content": system})
    return apply_template(tokenizer, messages)


def apply_template(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
    """The tokenizer's chat template over `messages` (without the system message if the template
    rejects one, as lm-eval does)."""
    import jinja2

    def go(msgs: list[dict[str, str]]) -> str:
        return str(tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                 continue_final_message=not add_generation_prompt))
    try:
        return go(messages)
    except jinja2.exceptions.TemplateError:
        return go([m for m in messages if m["role"] != "system"])


def has_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))
