"""Every `lmbatch run` option through the installed typer/click, as a user types it: each option is given a
value other than its default, and the RunOptions the command hands to the run must hold exactly those values.

Typer versions disagree on how an option is declared (0.27 named --dtype `--DTYPE` when its metavar was
"DTYPE"), so this is run on the oldest and the newest versions pyproject.toml allows (tools/smoke.sh).
Nothing runs: the run itself is replaced. Exit 0 when every option parses, 1 otherwise.
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

# a value other than the default for every `lmbatch run` option; a new option must be added here
VALUES: dict[str, Any] = {
    "task": "mmlu", "shots": 3, "model": "some/model-dir", "limit": 2, "subjects": ["anatomy", "virology"],
    "device": "cpu", "dtype": "float32", "threads": 3, "attention": "torch", "max_tokens_per_batch": 1024,
    "kv_cache_tokens": 5000, "data_parallel": "2", "ray_address": "localhost:6379", "tensor_parallel": "2",
    "schedule": "fcfs", "deterministic": True, "no_cache": True, "seed": 7, "out": Path("smoke-out"), "run_id": "smoke",
    "overwrite": True, "checkpoint_s": 2.5, "truncate_left": True, "save_token_ids": True, "quiet": True,
    "apply_chat_template": True, "system_instruction": "Be brief.", "fewshot_as_multiturn": True,
    "think_budget": 5, "think_end": "</t>", "jump_forward": False, "workload_cache": False, "dry_run": True,
}


def arguments(fields: list[dataclasses.Field]) -> list[str]:
    """The command line that sets every field to VALUES: options by their flag, a flag given where its value
    is not the default (a --no-... flag sets its field false)."""
    args = ["run"]
    for f in fields:
        value = VALUES[f.name]
        flag = f.metadata.get("flag") or "--" + f.name.replace("_", "-")
        if f.metadata.get("argument"):
            args.append(str(value))
        elif isinstance(value, bool):
            assert value != f.default, f.name
            args.append(flag)
        elif isinstance(value, list):
            for v in value:
                args += [flag, str(v)]
        else:
            args += [flag, str(value)]
    return args


def main() -> int:
    import lmbatch.run.run
    from lmbatch.cli import app
    from lmbatch.options import RunOptions, option_fields

    fields = [f for _, f in option_fields()]
    missing = {f.name for f in fields} - set(VALUES)
    if missing:
        print(f"smoke_cli: no test value for the option(s) {', '.join(sorted(missing))}: add them to VALUES")
        return 1
    got: list[RunOptions] = []

    def fake_run(o: RunOptions) -> dict:
        got.append(o)
        return {}

    setattr(lmbatch.run.run, "run", fake_run)     # lmbatch.cli imports it when the command runs
    args = arguments(fields)
    try:
        app(args=args, prog_name="lmbatch")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    if code or not got:
        print(f"smoke_cli: `lmbatch {' '.join(args)}` exited {code}")
        return 1
    flat = got[0].flat()
    wrong = [f"{f.name}: {flat[f.name]!r}, expected {VALUES[f.name]!r}" for f in fields
             if flat[f.name] != VALUES[f.name]]
    if wrong:
        print("smoke_cli: options parsed wrong:\n  " + "\n  ".join(wrong))
        return 1
    print(f"smoke_cli: all {len(fields)} options of `lmbatch run` parse")
    return 0


if __name__ == "__main__":
    sys.exit(main())
