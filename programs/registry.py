"""Workload registry, beside the programs it names: the built-in programs and suites by name, a
comma-separated list of them, or a user's program file. It imports each program where it is asked for (a
plain import, lazily: a run loads its own task's module alone), so the import graph shows what it finds."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable, NamedTuple

from lmbatch.errors import UserError
from lmbatch.frontend.suite import make_suite
from lmbatch.frontend.workload import Workload, load_file

if TYPE_CHECKING:
    from types import ModuleType


def _mmlu() -> Workload:
    from lmbatch.programs import mmlu
    return mmlu.WORKLOAD


def _hellaswag() -> Workload:
    from lmbatch.programs import hellaswag
    return hellaswag.WORKLOAD


def _tot_gsm8k() -> Workload:
    from lmbatch.programs import tot_gsm8k
    return tot_gsm8k.WORKLOAD


def _json() -> Workload:
    from lmbatch.programs import json_cities
    return json_cities.WORKLOAD


BUILTIN: dict[str, Callable[[], Workload]] = {  # name -> its program module's WORKLOAD
    "mmlu": _mmlu,
    "hellaswag": _hellaswag,
    "tot-gsm8k": _tot_gsm8k,
    "json": _json,
}


class Suite(NamedTuple):
    """A named suite: its tasks, with the shots a task is pinned at (None: the run's --shots)."""
    description: str
    tasks: tuple[tuple[str, int | None], ...]


def _olmes() -> ModuleType:
    from lmbatch.programs import olmes
    return olmes


def _olmes_suite(fmt: str) -> tuple[tuple[str, int | None], ...]:
    return tuple((name, None) for name in _olmes().task_names() if fmt in ("", name.rpartition(":")[2]))


SUITES = {
    "olmes": lambda: Suite("OLMES-v0.1: the nine OLMES tasks in both formats (rc, mc), and MMLU 5-shot",
                           _olmes_suite("") + (("mmlu", 5),)),
    "olmes:rc": lambda: Suite("the nine OLMES tasks, rc (the answer text scored)", _olmes_suite("rc")),
    "olmes:mc": lambda: Suite("the nine OLMES tasks, mc (the option's letter scored)", _olmes_suite("mc")),
}


def workload_names() -> list[str]:
    """The built-in tasks: lm-eval-style ones and programs, then the OLMES tasks."""
    return sorted(BUILTIN) + _olmes().task_names()


def _task(name: str) -> Workload:
    if name in BUILTIN:
        return BUILTIN[name]()
    olmes = _olmes()
    if name.removesuffix(olmes.SUFFIX) in olmes.task_names():
        return olmes.workload(name)
    raise UserError(f"unknown task {name!r}; known tasks: {', '.join(workload_names())}; suites: "
                    f"{', '.join(SUITES)}; or a program file path/to/file.py")


def _members(name: str) -> list[Workload]:
    """The tasks a name stands for: a task, or a suite's tasks (each pinned at its shots)."""
    if name not in SUITES:
        return [_task(name)]
    out = []
    for task, shots in SUITES[name]().tasks:
        w = _task(task)
        out.append(w if shots is None else replace(w, fixed_shots=shots))
    return out


def get_workload(name: str) -> Workload:
    """A built-in task, a suite (named, or a comma-separated list of tasks and suites), or a program file
    (a path ending in .py)."""
    if name.endswith(".py") and "," not in name:
        return load_file(Path(name))
    if "," not in name and name not in SUITES:
        return _task(name)
    parts = [p.strip() for p in name.split(",")]
    if not all(parts):
        raise UserError(f"task list {name!r} has an empty name: give tasks and suites separated by commas")
    if any(p.endswith(".py") for p in parts):
        raise UserError(f"task list {name!r}: a program file runs alone, not in a list of tasks")
    description = SUITES[name]().description if name in SUITES else f"the tasks {', '.join(parts)}"
    return make_suite(",".join(parts), description, [m for p in parts for m in _members(p)])
