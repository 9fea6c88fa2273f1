"""A run's host side alone: `lmbatch run` with an engine that answers at once (random tokens of each
generation's full length, random scores), so the main line's tokenizing, planning and the programs'
own work are all that is timed. Tree of thought's phases between waves can be measured on any machine.

    python benchmarks/bench_host.py -- tot-gsm8k [--limit N]          # the embedded model (or --model DIR)
    python benchmarks/bench_host.py --profile OUT.prof -- tot-gsm8k

The model's weights are loaded but never run; only its tokenizer and vocabulary matter. Prints summary.json's
phases (`tokenize`, `plan`; `execute` here is the programs' and the interpreter's work on results) and the
seconds Python's cycle collector took, by generation (`gc_s`: the passes that walk what the run holds).
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import json
import random
import sys
import tempfile
import time
from pathlib import Path


def instant_stream(self, requests, **args):
    """Engine.stream's contract (one last handover) with made-up results, after the real planning."""
    from lmbatch.engine.protocol import Handover
    from lmbatch.engine.state import RunState
    from lmbatch.requests import GenerateRequest
    from lmbatch.scheduler.planner import plan_requests

    t0 = time.perf_counter()
    plan = args.get("plan") or plan_requests(requests, args.get("schedule", "dfs"), args.get("seed", 0))
    state = RunState(requests, plan, args.get("progress"))
    t1 = time.perf_counter()
    rng = random.Random(len(requests))
    for j in plan.order:
        for m in plan.members[j]:
            r, res = requests[m], state.results[m]
            res.prompt_tokens = r.prompt_len
            if isinstance(r, GenerateRequest):
                res.token_ids = [rng.randrange(100, self.cfg.vocab_size) for _ in range(r.params.max_new_tokens)]
                res.finish_reason, res.decode_tokens = "length", r.params.max_new_tokens
                res.text = self.sampler.tokenizer.decode(res.token_ids)
            else:
                res.logprob, res.num_tokens = -5 * rng.random(), len(r.continuation)
        state.done(j)
    state.stats.plan_s, state.stats.execute_s = t1 - t0, time.perf_counter() - t1
    yield Handover(list(range(len(requests))), state.results, state.stats, True)


class CollectorClock:
    """A `gc.callbacks` entry: seconds and passes of the cycle collector, by generation."""

    def __init__(self) -> None:
        self.seconds, self.passes, self._t = [0.0, 0.0, 0.0], [0, 0, 0], 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t = time.perf_counter()
        else:
            self.seconds[info["generation"]] += time.perf_counter() - self._t
            self.passes[info["generation"]] += 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: the embedded model")
    ap.add_argument("--profile", default=None, help="write the main thread's cProfile here")
    ap.add_argument("args", nargs="+", help="lmbatch run's task and options")
    a = ap.parse_args()
    from lmbatch.cli import app
    from lmbatch.engine.engine import Engine

    Engine.stream = instant_stream          # type: ignore[method-assign]
    out = Path(tempfile.mkdtemp(prefix="bench-host-"))
    argv = ["run", *a.args, "--device", "cpu", "--out", str(out), "--run-id", "r", "--quiet"]
    argv += ["--model", a.model] if a.model else []
    collector = CollectorClock()
    gc.callbacks.append(collector)
    prof = cProfile.Profile() if a.profile else None
    if prof:
        prof.enable()
    try:
        app(argv, standalone_mode=False)
    finally:
        if prof:
            prof.disable()
            prof.dump_stats(a.profile)
    s = json.loads((out / "r" / "summary.json").read_text())
    gc.callbacks.remove(collector)
    print(json.dumps({"args": a.args, "time_s": {k: round(v, 2) for k, v in s["time_s"].items()},
                      "gc_s": [round(t, 2) for t in collector.seconds], "gc_passes": collector.passes,
                      "counts": s["counts"], "optimal_hit_rate": s["optimal_hit_rate"]}))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
