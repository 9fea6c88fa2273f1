"""docs/usage.md's "Commands and options" against the CLI (issue 57): its `lmbatch run` synopsis and its option
table each name every option `lmbatch run` has and none it lacks, and the synopsis lists each choice option's
values as the command takes them."""
from __future__ import annotations

import re
from pathlib import Path

import typer.main

from lmbatch.cli import app
from lmbatch.engine.build import ATTENTION, DEVICES, DTYPES
from lmbatch.scheduler.planner import SCHEDULES

USAGE = Path(__file__).resolve().parents[2] / "docs" / "usage.md"
FLAG = r"--[a-z][a-z0-9-]*"


def _section() -> str:
    text = USAGE.read_text()
    start = text.index("## Commands and options")
    return text[start:text.index("\n## ", start + 1)]


def _synopsis() -> str:
    """The `lmbatch run ...` lines of the section's code block, up to the next command."""
    block = _section().split("```")[1]
    start = block.index("lmbatch run ")
    return block[start:block.index("\nlmbatch ", start)]


def _run_flags() -> set[str]:
    params = typer.main.get_command(app).commands["run"].params
    return {o for p in params if p.name != "help" for o in p.opts if o.startswith("--")}


def test_the_synopsis_names_every_option_of_lmbatch_run():
    documented = set(re.findall(FLAG, _synopsis()))
    assert documented == _run_flags(), (f"missing from docs/usage.md's synopsis: {sorted(_run_flags() - documented)}; "
                                        f"documented but not an option: {sorted(documented - _run_flags())}")


def test_the_option_table_names_every_option_of_lmbatch_run():
    rows = [ln for ln in _section().splitlines() if ln.startswith("| `")]
    documented = {flag for ln in rows for flag in re.findall(FLAG, ln.split("|")[1])}
    assert documented == _run_flags(), (f"missing from docs/usage.md's option table: "
                                        f"{sorted(_run_flags() - documented)}; documented but not an option: "
                                        f"{sorted(documented - _run_flags())}")


def test_the_synopsis_lists_each_choice_as_the_command_takes_it():
    synopsis = _synopsis()
    for flag, values in (("--device", DEVICES), ("--dtype", DTYPES), ("--attention", ATTENTION),
                         ("--schedule", SCHEDULES)):
        shown = re.search(rf"\[{flag} ([^]]+)\]", synopsis)
        assert shown is not None, flag
        assert shown.group(1).split("|") == list(values), (flag, shown.group(1), values)
