"""Workload registry: the built-in programs by name, or a user's program file."""
from __future__ import annotations

import importlib
from pathlib import Path

from lmbatch.errors import UserError
from lmbatch.frontend.workload import Workload, load_file

BUILTIN = {  # name -> module in programs/ that defines WORKLOAD
    "mmlu": "mmlu",
    "hellaswag": "hellaswag",
    "tot-gsm8k": "tot_gsm8k",
    "json": "json_cities",
}


def workload_names() -> list[str]:
    return sorted(BUILTIN)


def get_workload(name: str) -> Workload:
    """A built-in workload by name, or a program file (a path ending in .py)."""
    if name.endswith(".py"):
        return load_file(Path(name))
    if name not in BUILTIN:
        raise UserError(f"unknown task {name!r}; known tasks: {', '.join(workload_names())}, or a program file "
                        "path/to/file.py")
    return importlib.import_module(f"lmbatch.programs.{BUILTIN[name]}").WORKLOAD
