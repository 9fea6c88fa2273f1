"""Print pip constraints pinning the CLI-facing dependencies to the lower bounds pyproject.toml declares
(`typer>=0.15.4` -> `typer==0.15.4`), for tools/smoke.sh --oldest. Exit 1 when one of them has no lower bound:
a range is declared true only where its oldest end is tested. Needs Python 3.11 (tomllib), as CI has."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import tomllib

# the libraries whose oldest declared versions the smoke runs on (the CLI, tokenizing, outputs)
CLI_FACING = ("typer", "click", "transformers", "tokenizers", "pyarrow", "numpy")


def lower_bounds(pyproject: Path) -> dict[str, str]:
    deps = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]["dependencies"]
    found = {}
    for dep in deps:
        m = re.match(r"^([A-Za-z0-9_.-]+)\s*(\[[^]]*\])?\s*(.*)$", dep)
        if m and m.group(1).lower() in CLI_FACING:
            low = re.search(r">=\s*([0-9][^,;\s]*)", m.group(3))
            if low:
                found[m.group(1).lower()] = low.group(1)
    return found


def main() -> int:
    pyproject = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent / "pyproject.toml"
    found = lower_bounds(pyproject)
    missing = [name for name in CLI_FACING if name not in found]
    if missing:
        print(f"lower_bounds: {', '.join(missing)} declare no lower bound (>=) in {pyproject}", file=sys.stderr)
        return 1
    for name in CLI_FACING:
        print(f"{name}=={found[name]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
