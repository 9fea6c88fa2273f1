"""What `--deterministic` costs: the same `lmbatch run` command with and without it, fresh processes in
alternating order, execute time (model work) and wall; and whether the scores agree.

    python benchmarks/bench_deterministic.py --device cpu --args "mmlu --shots 5 --limit 2"      # embedded model
    python benchmarks/bench_deterministic.py --args "tot-gsm8k --limit 4" --device cpu
    python benchmarks/bench_deterministic.py --model DIR --args "mmlu --shots 5" --rounds 2      # GPU
"""
from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_fixed_costs import cli, timed  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--args", default="mmlu --shots 5 --limit 2", help="lmbatch run's arguments: the task and options")
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="bench-det-"))
    out.mkdir(parents=True, exist_ok=True)
    base = cli() + ["run", *shlex.split(args.args), "--device", args.device, "--quiet", "--overwrite",
                    "--out", str(out)] + (["--model", args.model] if args.model else [])
    got: dict[str, list[tuple[float, float]]] = {"default": [], "deterministic": []}
    summaries = {}
    for r in range(args.rounds):
        for mode in ("default", "deterministic") if r % 2 == 0 else ("deterministic", "default"):
            cmd = base + ["--run-id", mode] + (["--deterministic"] if mode == "deterministic" else [])
            wall = timed(cmd, out / f"{mode}-{r}.log")
            s = summaries[mode] = json.loads((out / mode / "summary.json").read_text())
            got[mode].append((s["time_s"]["execute"], wall))
            print(f"round {r} {mode}: execute {s['time_s']['execute']:.2f} s, wall {wall:.1f} s", flush=True)
    med = {m: (statistics.median(e for e, _ in v), statistics.median(w for _, w in v)) for m, v in got.items()}
    row = {"args": args.args, "device": summaries["default"]["device"], "rounds": args.rounds,
           "execute_s": {m: round(v[0], 3) for m, v in med.items()},
           "wall_s": {m: round(v[1], 2) for m, v in med.items()},
           "execute_ratio": round(med["deterministic"][0] / med["default"][0], 3),
           "wall_ratio": round(med["deterministic"][1] / med["default"][1], 3),
           "accuracy": {m: s.get("accuracy") for m, s in summaries.items()}}
    print(json.dumps(row))


if __name__ == "__main__":
    main()
