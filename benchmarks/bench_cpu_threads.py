"""A decode-heavy job on the CPU, idle and beside a competing CPU job: today's thread policy against this one.

    python benchmarks/bench_cpu_threads.py --base /path/to/python-of-the-old-lmbatch [--rounds 3] \
        [--job "tot-gsm8k --limit 1"] [--competitor-threads 2]

Each variant is an interpreter whose `lmbatch` runs the job (`python -m lmbatch.cli run JOB --device cpu`, in a
fresh process, the workload cache warm): `--base` (e.g. a venv whose lmbatch is main before issue 57: torch's
default threads, OpenMP's default wait policy) and `new` (this interpreter's lmbatch). Each runs idle and
`busy`: beside a competing process doing float32 matmuls in a loop on `--competitor-threads` torch threads
(started before the job, stopped after it). A round runs every (variant, condition) once, in alternating order;
the figures are medians over the rounds of summary.json's `time_s.execute` (and the job's wall). The machine may
be shared: each run also records the cores other processes kept busy meanwhile (/proc/stat's busy time less
the job's and the competitor's own), so a noisy round can be told apart.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

COMPETITOR = """
import torch
torch.set_num_threads({threads})
a = torch.randn(1024, 1024)
while True:
    a = torch.tanh(a @ a)
"""


def _busy_s() -> float:
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def _children_s() -> float:
    t = os.times()
    return t.children_user + t.children_system


def run_job(python: str, job: list[str], out: Path, busy: int) -> dict[str, float]:
    """One run of the job: execute and wall seconds, and the cores others kept busy meanwhile."""
    competitor = None
    if busy:
        competitor = subprocess.Popen([python, "-c", COMPETITOR.format(threads=busy)], cwd=out)
        time.sleep(3.0)                 # its torch loaded and its threads spinning
    run_id = f"r{time.monotonic_ns()}"
    t0, b0, c0 = time.monotonic(), _busy_s(), _children_s()
    try:
        subprocess.run([python, "-m", "lmbatch.cli", "run", *job, "--device", "cpu", "--out", str(out),
                        "--run-id", run_id, "--quiet"], cwd=out, check=True, timeout=3600)
    finally:
        wall, busy_s = time.monotonic() - t0, _busy_s() - b0
        if competitor is not None:
            competitor.kill()
            competitor.wait()
    job_cpu = _children_s() - c0        # the job's and the competitor's CPU time (both waited for)
    summary = json.loads((out / run_id / "summary.json").read_text())
    return {"execute_s": summary["time_s"]["execute"], "wall_s": wall,
            "others_cores": max(0.0, busy_s - job_cpu) / wall, "threads": summary.get("threads")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="python whose lmbatch is today's (the policy before)")
    ap.add_argument("--job", default="tot-gsm8k --limit 1")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--competitor-threads", type=int, default=2)
    a = ap.parse_args()
    job = shlex.split(a.job)
    variants = {"base": a.base, "new": sys.executable}
    out = Path(tempfile.mkdtemp(prefix="bench-cpu-threads-"))
    for python in variants.values():        # the workload cached, the model converted: not timed
        subprocess.run([python, "-m", "lmbatch.cli", "run", *job, "--device", "cpu", "--out", str(out), "--dry-run"],
                       cwd=out, check=True, capture_output=True)
    runs: dict[str, list[dict[str, float]]] = {}
    cases = [(v, c) for v in variants for c in ("idle", "busy")]
    for r in range(a.rounds):
        for v, c in (cases if r % 2 == 0 else cases[::-1]):
            got = run_job(variants[v], job, out, a.competitor_threads if c == "busy" else 0)
            runs.setdefault(f"{v}/{c}", []).append(got)
            print(f"round {r + 1} {v}/{c}: execute {got['execute_s']:.1f} s, wall {got['wall_s']:.1f} s, "
                  f"others' cores {got['others_cores']:.2f}", flush=True)
    med = {k: {m: statistics.median(x[m] for x in v) for m in ("execute_s", "wall_s", "others_cores")}
           for k, v in runs.items()}
    print(json.dumps({"date": dt.date.today().isoformat(), "machine": platform.processor() or platform.machine(),
                      "cores": os.cpu_count(), "job": f"lmbatch run {a.job} --device cpu",
                      "competitor": f"{a.competitor_threads}-thread float32 matmul loop", "rounds": a.rounds,
                      "median": med, "busy_over_idle": {v: med[f"{v}/busy"]["execute_s"] / med[f"{v}/idle"]["execute_s"]
                                                        for v in variants},
                      "runs": runs}, indent=1, default=str))


if __name__ == "__main__":
    main()
