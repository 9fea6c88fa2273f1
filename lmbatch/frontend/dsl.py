"""LM program frontend: a program is a Python function over a prompt state `s`.

    from lmbatch.frontend import gen, select

    def program(s, question):
        s += "Q: " + question + "\\nA:"
        s += gen("answer", max_tokens=32, stop="\\n")
        forks = s.fork(2)
        for f in forks:
            f += " Is that right?" + select("ok", [" yes", " no"])
        forks.join()              # s["ok"] == [first fork's choice, second fork's choice]

`gen` and `select` do not wait: each is queued with the state's text as its prompt and a
placeholder stands for its result in the state. A program waits only where it needs a value
(`s[name]`, `s.text`, or a call whose prompt still holds a pending result). The interpreter
(`lmbatch.frontend.interpreter`) runs the queued calls of all waiting programs together, then resumes them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Protocol, TypeAlias

if TYPE_CHECKING:
    from lmbatch.frontend.workload import Instance
    from lmbatch.grammar import Constraint  # imports xgrammar: loaded on the first constraint
    from lmbatch.requests import TokenCounts


class _Plus:
    """`"text" + gen(...) + "more"` builds a sequence of items to append to a state."""

    def __add__(self, other: str | _Plus) -> "Seq":
        return Seq(_items(self) + _items(other))

    def __radd__(self, other: str | _Plus) -> "Seq":
        return Seq(_items(other) + _items(self))


@dataclass(frozen=True)
class Gen(_Plus):
    name: str
    max_tokens: int = 32
    stop: tuple[str, ...] = ()
    temperature: float = 0.0
    top_p: float = 1.0
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None
    think: bool = False             # thinking first, unconstrained, up to think_budget tokens
    think_budget: int = 1024
    think_end: str | None = None    # the end-of-thinking marker's text (default: the tokenizer's "</think>")

    @property
    def constrained(self) -> bool:
        return self.regex is not None or self.json_schema is not None or self.ebnf is not None


@dataclass(frozen=True)
class Select(_Plus):
    name: str
    choices: tuple[str, ...]
    encoding: str = "pair"          # how its token ids are made: ENCODINGS


# a select's token ids: "pair", lm-eval's `_encode_pair` (context + choice encoded whole, split at the
# context's length; the context's trailing whitespace moves onto the choice); "separate", as OLMo's
# evaluator (olmo_eval) builds OLMES requests: the context and each choice encoded on their own, with the
# tokens the tokenizer puts before a text (a BOS, where it adds one) before the context
ENCODINGS = ("pair", "separate")


@dataclass(frozen=True)
class Seq(_Plus):
    items: list


def _items(x: object) -> list:
    if isinstance(x, Seq):
        return list(x.items)
    if isinstance(x, (str, Gen, Select)):
        return [x]
    raise TypeError(f"cannot add {type(x).__name__} to an LM program state (str, gen(...) or select(...))")


def gen(name: str, max_tokens: int = 32, stop: str | list[str] | tuple[str, ...] = (), temperature: float = 0.0,
        top_p: float = 1.0, regex: str | None = None, json_schema: str | dict | None = None,
        ebnf: str | None = None, think: bool = False, think_budget: int = 1024, think_end: str | None = None) -> Gen:
    """Generate text into `s[name]`; stops at EOS, at a stop string (cut from the text) or after max_tokens.
    At most one constraint: `regex`, `json_schema` or `ebnf` (a grammar in xgrammar's EBNF, rule `root`).

    `think=True` (thinking models): the model first writes its thinking, unconstrained, until it
    writes the end-of-thinking marker (`think_end`, default the tokenizer's `</think>`) or has written
    `think_budget` tokens (then the marker is appended for it); the constraint, stop strings and
    `max_tokens` apply to what follows. `s[name]` is that answer, `s.meta(name)["thinking"]` the
    thinking's text."""
    if max_tokens < 1:
        raise ValueError(f"gen({name!r}): max_tokens must be at least 1")
    if think_budget < 0:
        raise ValueError(f"gen({name!r}): think_budget must be at least 0")
    if sum(c is not None for c in (regex, json_schema, ebnf)) > 1:
        raise ValueError(f"gen({name!r}): give at most one of regex, json_schema, ebnf")
    stop = (stop,) if isinstance(stop, str) else tuple(stop)
    if isinstance(json_schema, dict):
        import json
        json_schema = json.dumps(json_schema)   # key order kept: it is the order of the output
    return Gen(name, max_tokens, stop, temperature, top_p, regex, json_schema, ebnf, think, think_budget, think_end)


def select(name: str, choices: list[str] | tuple[str, ...], encoding: str = "pair") -> Select:
    """Pick the choice of highest loglikelihood after the state's text (lm-eval semantics: the
    text's trailing whitespace moves onto the choices; `encoding="separate"`: OLMES's, see ENCODINGS);
    `s[name]` is the chosen string."""
    if not choices:
        raise ValueError(f"select({name!r}): no choices")
    if encoding not in ENCODINGS:
        raise ValueError(f"select({name!r}): encoding {encoding!r}: use one of {', '.join(ENCODINGS)}")
    return Select(name, tuple(choices), encoding)


class CallOwner(Protocol):
    """What a call knows of the program that issued it (the interpreter's `ProgramRun`)."""
    index: int                      # the program's place in the batch
    number: int                     # its instance's place in the task (the batch of a resumed run is a part)
    instance: Instance
    tokens: TokenCounts             # what its calls have put through the model

    @property
    def started(self) -> bool:
        """Some call of it has been in a wave."""
        ...


SelectIds: TypeAlias = tuple[list[int], list[list[int]]]   # a select's context and its choices' continuations
CallIds: TypeAlias = list[int] | SelectIds                  # a gen's prompt, or a select's SelectIds


@dataclass(eq=False)
class Pending:
    """A queued call and, once run, its result."""
    op: Gen | Select
    prompt: str
    owner: CallOwner                # the interpreter's record of the program that issued it
    stage: int                      # how many times the program had waited when it issued this call
    seq: int                        # the call's number within its program
    done: bool = False
    value: str = ""                 # the text the result adds to the state
    meta: dict[str, Any] = field(default_factory=dict)    # what `s.meta(name)` shows
    # the interpreter's own, while the call waits to run:
    ids: CallIds | None = None      # token ids, once tokenized and checked
    bad: str | None = None          # why its constraint cannot compile
    constraint: Constraint | None = None    # its grammar's matcher (a constrained gen)
    forced: str = ""                # text its grammar forces at the start (jump-forward): joins the prompt
    think_ids: tuple[int, ...] = () # a thinking gen's end-of-thinking marker


class CallQueue(Protocol):
    """Where a state's calls go (the interpreter's `ProgramRun`)."""

    def submit(self, op: Gen | Select, prompt: str) -> Pending: ...

    def wait(self, pending: list[Pending]) -> None: ...

    def chat(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str: ...


class State:
    """The prompt state of one program (or of one fork of it)."""

    def __init__(self, queue: CallQueue, parts: list | None = None, variables: dict | None = None):
        self._queue = queue
        self._parts: list[str | Pending] = parts or []
        self._vars: dict[str, Any] = variables or {}

    def __iadd__(self, other: str | _Plus) -> "State":
        for item in _items(other):
            if isinstance(item, str):
                self._parts.append(item)
            else:
                p = self._queue.submit(item, self.text)
                self._parts.append(p)
                self._vars[item.name] = p
        return self

    @property
    def text(self) -> str:
        """The state's whole text (waits for pending results in it)."""
        self._queue.wait([p for p in self._parts if isinstance(p, Pending) and not p.done])
        text = "".join(p if isinstance(p, str) else p.value for p in self._parts)
        self._parts = [text]
        return text

    def __getitem__(self, name: str) -> Any:
        value = self._vars[name]
        self._queue.wait([p for p in _pendings(value) if not p.done])
        return _resolve(value, lambda p: p.value)

    def __setitem__(self, name: str, value: Any) -> None:
        self._vars[name] = value

    def __contains__(self, name: str) -> bool:
        return name in self._vars

    def meta(self, name: str) -> Any:
        """Details of a call's result: for select, logprobs/is_greedy/num_tokens per choice and the
        chosen index; for gen, finish_reason and token counts."""
        value = self._vars[name]
        self._queue.wait([p for p in _pendings(value) if not p.done])
        return _resolve(value, lambda p: p.meta)

    def chat(self, messages: list, add_generation_prompt: bool = True) -> str:
        """`messages` ({"role": ..., "content": ...} dicts or (role, content) pairs) rendered through the
        model's chat template, ending with the assistant's generation prompt: `s += s.chat([...])`.
        Programs that put the same first turns first share them as a prefix, as any text."""
        msgs = [m if isinstance(m, dict) else {"role": m[0], "content": m[1]} for m in messages]
        return self._queue.chat(msgs, add_generation_prompt)

    def variables(self) -> dict[str, Any]:
        """Every named value, results resolved (waits for them)."""
        return {name: self[name] for name in self._vars}

    def fork(self, n: int) -> "Forks":
        """n copies of this state that continue independently; they share the text so far, so its
        KV is computed once."""
        if n < 1:
            raise ValueError("fork(n) needs n >= 1")
        return Forks(self, [State(self._queue, list(self._parts), dict(self._vars)) for _ in range(n)])


class Forks(list):
    """The states of one fork. `forks += x` appends x to each; `join()` gathers into the parent
    every variable the forks set or changed, as a list with one value per fork."""

    def __init__(self, parent: State, states: list[State]):
        super().__init__(states)
        self.parent = parent

    # mypy wants an __iadd__ to match list.__add__, which typeshed overloads; this one appends to each state
    def __iadd__(self, other: str | _Plus) -> "Forks":  # type: ignore[misc, override]
        for s in self:
            s += other
        return self

    def join(self) -> State:
        before = self.parent._vars
        names = dict.fromkeys(n for s in self for n, v in s._vars.items() if before.get(n, _MISSING) is not v)
        for name in names:
            self.parent._vars[name] = [s._vars.get(name) for s in self]
        return self.parent


_MISSING = object()


def _pendings(value: object) -> list[Pending]:
    if isinstance(value, Pending):
        return [value]
    if isinstance(value, list):
        return [p for v in value for p in _pendings(v)]
    return []


def _resolve(value: object, get: Callable[[Pending], Any]) -> Any:
    if isinstance(value, Pending):
        return get(value)
    if isinstance(value, list):
        return [_resolve(v, get) for v in value]
    return value
