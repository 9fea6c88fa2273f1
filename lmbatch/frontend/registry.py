"""Workload registry: the built-in programs and suites by name, a comma-separated list of them, or a
user's program file."""
from __future__ import annotations

import importlib
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple

from lmbatch.errors import UserError
from lmbatch.frontend.suite import make_suite
from lmbatch.frontend.workload import Workload, load_file

BUILTIN = {  # name -> module in programs/ that defines WORKLOAD
    "mmlu": "mmlu",
    "hellaswag": "hellaswag",
    "tot-gsm8k": "tot_gsm8k",
    "json": "json_cities",
}


class Suite(NamedTuple):
    """A named suite: its tasks, with the shots a task is pinned at (None: the run's --shots)."""
    description: str
    tasks: tuple[tuple[str, int | None], ...]


def _olmes() -> Any:
    return importlib.import_module("lmbatch.programs.olmes")


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
        return importlib.import_module(f"lmbatch.programs.{BUILTIN[name]}").WORKLOAD
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
