"""Type-check the package as it is installed: `python tools/typecheck.py` (the README's test command runs it).

setuptools' package-dir puts programs/, kernels/ and scheduler/ into the lmbatch namespace
(lmbatch.programs, ...), a mapping mypy cannot follow from the source tree. So this builds that
namespace out of symlinks in .typecheck/ (git-ignored) and runs mypy on it with pyproject.toml's
settings: `from lmbatch.scheduler.planner import plan_requests` is checked against planner.py,
not taken as Any. Extra arguments go to mypy.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAPPED = ("programs", "kernels", "scheduler")   # [tool.setuptools.package-dir] in pyproject.toml


def build_tree() -> Path:
    tree = ROOT / ".typecheck"
    shutil.rmtree(tree, ignore_errors=True)
    pkg = tree / "lmbatch"
    pkg.mkdir(parents=True)
    for entry in (ROOT / "lmbatch").iterdir():
        if entry.name != "__pycache__":
            (pkg / entry.name).symlink_to(entry)
    for name in MAPPED:
        (pkg / name).symlink_to(ROOT / name)
    return tree


def main() -> int:
    tree = build_tree()
    cmd = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
           "--cache-dir", str(ROOT / ".mypy_cache"), "lmbatch", *sys.argv[1:]]
    return subprocess.call(cmd, cwd=tree)


if __name__ == "__main__":
    sys.exit(main())
