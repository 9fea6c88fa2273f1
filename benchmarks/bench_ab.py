"""Is a change within noise end to end? Two versions of lmbatch, each a FRESH process per run, in
alternating order, on one machine: the working tree ("new") and a git revision ("base").

Each version is laid out as setuptools installs it (lmbatch/ with programs/, kernels/, scheduler/
mapped into the namespace) under OUT/, and runs as `python -m lmbatch.cli` from OUT with that folder
first on PYTHONPATH: an editable install of this checkout, or this folder as the current directory,
would shadow it.

    # H100: MMLU 5-shot, Qwen2.5-1.5B shape (benchmarks/bench_e2e.py builds such a folder)
    python benchmarks/bench_ab.py --base 3431fe4 --rounds 3 -- mmlu --shots 5 --model /tmp/models/Q15

Prints every run's wall time and phases, each version's median, and new / base.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAPPED = ("programs", "kernels", "scheduler")   # [tool.setuptools.package-dir]


def lay_out(src: Path, dest: Path) -> None:
    shutil.rmtree(dest, ignore_errors=True)
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(src / "lmbatch", dest / "lmbatch", ignore=ignore)
    for name in MAPPED:
        shutil.copytree(src / name, dest / "lmbatch" / name, ignore=ignore)


def checkout(rev: str, dest: Path) -> None:
    data = subprocess.run(["git", "-C", str(ROOT), "archive", rev], capture_output=True, check=True).stdout
    shutil.rmtree(dest, ignore_errors=True)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(dest, filter="data")


def one_run(version: str, out: Path, args: list[str]) -> tuple[float, dict]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(out / version), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "lmbatch.cli", "run", *args, "--out", str(out / "runs"), "--run-id", version,
           "--overwrite", "--quiet"]
    t = time.perf_counter()
    p = subprocess.run(cmd, env=env, cwd=out, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if p.returncode:
        raise SystemExit(f"error: {version} failed (exit {p.returncode}):\n{p.stderr[-3000:]}")
    return wall, json.loads((out / "runs" / version / "summary.json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="git revision to compare the working tree with")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("/tmp/lmbatch-ab"))
    ap.add_argument("run_args", nargs=argparse.REMAINDER, help="-- then the arguments of `lmbatch run`")
    a = ap.parse_args()
    run_args = a.run_args[1:] if a.run_args[:1] == ["--"] else a.run_args
    out = a.out.resolve()
    checkout(a.base, out / "src-base")
    lay_out(out / "src-base", out / "base")
    lay_out(ROOT, out / "new")
    walls: dict[str, list[float]] = {"new": [], "base": []}
    for r in range(a.rounds):
        for version in (["new", "base"] if r % 2 == 0 else ["base", "new"]):
            wall, s = one_run(version, out, run_args)
            walls[version].append(wall)
            phases = ", ".join(f"{k} {v:.1f}" for k, v in s["time_s"].items())
            print(f"round {r} {version}: wall {wall:.1f} s, accuracy {s.get('accuracy')}, "
                  f"hit rate {s.get('hit_rate'):.4f}; {phases}", flush=True)
    for version, w in walls.items():
        print(f"{version}: median {statistics.median(w):.1f} s of {[round(x, 1) for x in w]}")
    print(f"new / base (medians): {statistics.median(walls['new']) / statistics.median(walls['base']):.3f}")


if __name__ == "__main__":
    main()
