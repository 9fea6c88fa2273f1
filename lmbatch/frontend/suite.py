"""A suite: several built-in tasks as one workload, so that one run loads the model once and executes
every task's requests as one batch over one radix tree (prefixes the tasks share are computed once).

The suite's instances are its tasks' instances, task after task, each naming its task
(`Instance.task`); the interpreter runs each with its task's program, and the run scores it with its
task's score (`Workload.task_of`). Everything downstream (the workload cache, the plan, data-parallel
parts, resume, the run directory) sees one workload; summary.json splits the results by task again.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from lmbatch.errors import UserError
from lmbatch.frontend.workload import Instance, LoadArgs, Workload


def _instances(members: list[Workload], args: LoadArgs) -> list[Instance]:
    """Each task's instances with its own shots (a pinned task's), --subjects only for a task that takes
    them, and --limit for each task."""
    out: list[Instance] = []
    for m in members:
        sub = replace(args, shots=m.shots(args.shots), subjects=args.subjects if m.subjects is not None else None)
        for inst in m.instances(sub):
            inst.task = m.name
            out.append(inst)
    return out


def _data_files(members: list[Workload]) -> list[Path]:
    return [f for m in members if m.data_files is not None for f in m.data_files()]


def _no_program(*args: object, **kwargs: object) -> None:
    raise TypeError("a suite's instances run their own task's program (Workload.programs)")


def make_suite(name: str, description: str, members: list[Workload]) -> Workload:
    """One workload of `members` (built-in tasks, each once)."""
    seen = [m.name for m in members]
    twice = sorted({n for n in seen if seen.count(n) > 1})
    if twice:
        raise UserError(f"suite {name!r} names {twice[0]!r} twice: each task runs once")
    if any(m.data_files is None or m.tasks is not None for m in members):
        raise UserError(f"suite {name!r}: a suite holds built-in tasks (not program files, not suites)")
    shots = {m.fixed_shots for m in members}
    subjects = next((m.subjects for m in members if m.subjects is not None), None)
    return Workload(name, description, _no_program, lambda args: _instances(members, args), max_shots=None,
                    subjects=subjects, chat=all(m.chat for m in members), generates=any(m.generates for m in members),
                    data_files=lambda: _data_files(members), fixed_shots=shots.pop() if len(shots) == 1 else None,
                    tasks={m.name: m for m in members})
