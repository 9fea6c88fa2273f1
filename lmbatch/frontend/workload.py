"""What a workload is: a program, its instances and how an instance's result is scored.

Built-in workloads live in `programs/`; `load_file` turns a user's Python file into one.
"""
from __future__ import annotations

import importlib.util
import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, cast

from lmbatch.errors import UserError, first_line
from lmbatch.frontend.chat import ChatOptions

if TYPE_CHECKING:
    from importlib.abc import Loader
    from importlib.machinery import ModuleSpec


@dataclass
class Instance:
    id: str
    inputs: dict[str, Any]          # keyword arguments of the program
    subject: str = ""               # group for per-subject metrics
    gold: Any = None
    task: str = ""                  # the task it belongs to (set as the run loads it; a suite's has several)


@dataclass(frozen=True)
class LoadArgs:
    tokenizer: Any
    shots: int = 0
    limit: int | None = None
    subjects: list[str] | None = None
    seed: int = 0
    chat: ChatOptions = ChatOptions()   # chat template, system instruction (built-in tasks that take them)


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    program: Callable                                   # program(s, **instance.inputs)
    instances: Callable[[LoadArgs], list[Instance]]
    score: Callable[[Instance, Any], dict[str, float]] | None = None   # (instance, final state) -> metrics
    max_shots: int | None = 0                           # None: any number, up to shot_pool's
    answer: str | None = None       # a select whose choice and logprobs go into the instance rows
    subjects: Callable[[], list[str]] | None = None     # its valid subject names, if it takes --subjects
    # the number of rows the shots are drawn from, the question among them (so shots must be fewer), and
    # what those rows are; the runner checks --shots against them before any work
    shot_pool: Callable[[], int] | None = None
    shot_pool_name: str = ""
    chat: bool = False              # takes --apply-chat-template, --system-instruction, --fewshot-as-multiturn
    generates: bool = True          # some call generates (a run captures decode graphs ahead only then)
    stages: int = 1                 # its programs' model calls made one after another (a run's waves, at least)
    # the files its instances are read from: a built-in task's loaded, tokenized and planned workload is
    # cached, keyed by them among the rest (lmbatch/caches/workloads.py); None: not cached (a program file,
    # whose code may read anything)
    data_files: Callable[[], list[Path]] | None = None
    # the metric `correct` and `accuracy` are, and `report --compare` tests (OLMES: its config's primary_metric);
    # None: a task with its own metrics (json, a program file): accuracy is the first (by name) its instances
    # carry, and a comparison tests every one
    primary_metric: str | None = "acc"
    # the few-shot examples its prompts hold whatever --shots says (OLMES's request files hold 5; a suite's
    # MMLU is pinned at 5): --shots may only be left out or be this
    fixed_shots: int | None = None
    # a suite: its tasks by name; each instance runs, and is scored by, the task its `task` names
    tasks: dict[str, Workload] | None = None

    def task_of(self, inst: Instance) -> Workload:
        """The workload that runs and scores `inst`: its task's, in a suite; else this one."""
        return self.tasks[inst.task] if self.tasks is not None else self

    @property
    def programs(self) -> Callable[..., None] | dict[str, Callable[..., None]]:
        """What the interpreter runs: the program, or a suite's programs by task."""
        return self.program if self.tasks is None else {name: t.program for name, t in self.tasks.items()}

    def shots(self, given: int) -> int:
        """The few-shot examples its prompts hold when --shots is `given`."""
        return given if self.fixed_shots is None else self.fixed_shots


RESERVED = ("id", "gold", "subject")


def exit_call(e: SystemExit) -> str:
    """How a program's SystemExit came about, as its message says it: `sys.exit(1)`."""
    return f"sys.exit({'' if e.code is None else repr(e.code)})"


def load_file(path: Path) -> Workload:
    """A user program file defines `program(s, **inputs)` and `instances()` (a list of dicts of
    inputs; the keys id, gold and subject are kept out of the inputs), and optionally
    `score(instance, s) -> dict[str, float]`, where instance is the dict."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"program file {path} does not exist")
    spec = cast("ModuleSpec", importlib.util.spec_from_file_location(f"lmbatch_user_{path.stem}", path))
    module = importlib.util.module_from_spec(spec)
    try:
        cast("Loader", spec.loader).exec_module(module)
    except SystemExit as e:     # sys.exit() in the file: the run would end with no word
        raise UserError(f"{path}: the program file called {exit_call(e)} while it was imported: a program file "
                        "defines functions and returns") from None
    except Exception as e:  # the user's code: report it in one line
        raise UserError(f"{path}: {type(e).__name__}: {first_line(e)}") from e
    for name in ("program", "instances"):
        if not callable(getattr(module, name, None)):
            raise UserError(f"{path} must define a function `{name}` (see the README's program file example)")
    user_score: Any = getattr(module, "score", None)     # whatever the file defines; called only if callable

    def instances(args: LoadArgs) -> list[Instance]:
        fn = module.instances
        try:
            rows = fn(args) if inspect.signature(fn).parameters else fn()
        except SystemExit as e:
            raise UserError(f"{path}: instances() called {exit_call(e)}: it must return the instances") from None
        except Exception as e:  # the user's code: report it in one line, as load errors are
            raise UserError(f"{path}: instances() raised {type(e).__name__}: {first_line(e)}") from e
        if not isinstance(rows, (list, tuple)):
            try:
                rows = list(rows)          # a generator, say
            except TypeError:
                raise UserError(f"{path}: instances() must return a list of dicts, got {type(rows).__name__}") from None
        out: list[Instance] = []
        seen: dict[str, int] = {}      # id -> the item that had it
        for k, row in enumerate(rows[:args.limit] if args.limit else rows):
            if not isinstance(row, dict):
                raise UserError(f"{path}: instances() must return dicts of program inputs; item {k} is a "
                                f"{type(row).__name__}")
            key = str(row.get("id", k))
            if key in seen:     # results are kept, resumed and compared by id: each must name one instance
                raise UserError(f"{path}: instances() returned id {key!r} twice (items {seen[key]} and {k}): "
                                "each instance needs an id of its own")
            seen[key] = k
            out.append(Instance(key, {n: v for n, v in row.items() if n not in RESERVED},
                                str(row.get("subject", "")), row.get("gold")))
        return out

    def score(inst: Instance, state: Any) -> dict[str, float]:
        row = dict(inst.inputs, id=inst.id, gold=inst.gold, subject=inst.subject)
        return {k: float(v) for k, v in user_score(row, state).items()}

    return Workload(path.stem, (module.__doc__ or "").strip().split("\n")[0], module.program, instances,
                    score if callable(user_score) else None, max_shots=None, primary_metric=None)
