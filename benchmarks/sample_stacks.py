"""Where a Python command spends its time, by function: every thread's stack sampled every 2 ms from a
thread of this process (nothing patched, no tracing overhead in the code measured), then the functions
that hold the most samples, self (innermost frame) and inclusive (anywhere on the stack), per thread.

    python benchmarks/sample_stacks.py [--within NAME] [--top 25] -- -m lmbatch.cli run tot-gsm8k ...
    python benchmarks/sample_stacks.py --within _stream -- benchmarks/bench_programs.py --workload ...

`--within NAME` keeps only samples with a frame of that function name on the stack (e.g. `_stream`:
the engine's execution). A sample stands for the wall time between two samples; a thread waiting in
C (a device sync, a lock) shows its waiting frame.
"""
from __future__ import annotations

import argparse
import collections
import os
import runpy
import sys
import threading
import time
from types import FrameType
from typing import Callable

INTERVAL = 0.002


def _label(frame: FrameType, line: bool = False) -> str:
    code = frame.f_code
    parts = code.co_filename.replace("\\", "/").split("/")
    return f"{'/'.join(parts[-2:])}:{code.co_name}" + (f":{frame.f_lineno}" if line else "")


class StackSampler:
    """Every other thread's innermost frame handed to `on_sample(thread name, frame)` every `interval`
    seconds, from a thread of this process, between entering and leaving the `with` block; then `wall`
    (seconds) and `ticks` (samples taken) say what one sample stands for (`tick`)."""

    def __init__(self, on_sample: Callable[[str, FrameType], None], interval: float = INTERVAL):
        self.on_sample, self.interval = on_sample, interval
        self.ticks, self.wall = 0, 0.0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sampler", daemon=True)

    def _run(self) -> None:
        me, names = threading.get_ident(), {}
        while not self._done.wait(self.interval):
            self.ticks += 1
            for t in threading.enumerate():
                names[t.ident or 0] = t.name
            for ident, frame in sys._current_frames().items():
                if ident != me:
                    self.on_sample(names.get(ident, str(ident)), frame)

    @property
    def tick(self) -> float:
        return self.wall / max(self.ticks, 1)

    def __enter__(self) -> StackSampler:
        self._start = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self._start
        self._done.set()
        self._thread.join()


def main() -> None:
    cut = sys.argv.index("--") if "--" in sys.argv else len(sys.argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--within", default=None, help="count only samples with a frame of this function name")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--lines", action="store_true", help="self time by line (the innermost frame's line)")
    ap.add_argument("--threads", default="MainThread", help="comma-separated thread names to report, or all")
    opts = ap.parse_args(sys.argv[1:cut])
    target = sys.argv[cut + 1:]
    if not target:
        raise SystemExit("usage: sample_stacks.py [options] -- SCRIPT.py ARGS | -m MODULE ARGS")
    self_n: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    incl_n: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    kept: collections.Counter[str] = collections.Counter()
    def sample(name: str, frame: FrameType) -> None:
        stack: list[FrameType] = []
        f: FrameType | None = frame
        while f is not None:
            stack.append(f)
            f = f.f_back
        if opts.within and not any(s.f_code.co_name == opts.within for s in stack):
            return
        kept[name] += 1
        self_n[name][_label(stack[0], opts.lines)] += 1
        for label in {_label(s) for s in stack}:
            incl_n[name][label] += 1

    code = 0
    real_exit = os._exit

    def exit_here(status: int) -> None:     # lmbatch's console script ends with os._exit: report first
        raise SystemExit(status)

    os._exit = exit_here        # type: ignore[assignment]
    with StackSampler(sample) as sampler:
        try:
            if target[0] == "-m":
                sys.argv = [target[1], *target[2:]]
                runpy.run_module(target[1], run_name="__main__", alter_sys=True)
            else:
                sys.argv = target
                sys.path.insert(0, str(__import__("pathlib").Path(target[0]).resolve().parent))
                runpy.run_path(target[0], run_name="__main__")
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    os._exit = real_exit
    tick = sampler.tick
    print(f"\n[sample_stacks] wall {sampler.wall:.1f} s, {sampler.ticks} samples (one per {tick * 1000:.1f} ms)"
          + (f", within {opts.within}" if opts.within else ""), file=sys.stderr)
    shown = [t for t in kept if opts.threads == "all" or t in opts.threads.split(",")]
    for thread in shown:
        print(f"\n[sample_stacks] thread {thread}: {kept[thread] * tick:.2f} s sampled", file=sys.stderr)
        for title, counter in (("self", self_n[thread]), ("inclusive", incl_n[thread])):
            print(f"  {title}:", file=sys.stderr)
            for label, n in counter.most_common(opts.top):
                print(f"    {n * tick:8.2f} s {n / kept[thread]:6.1%}  {label}", file=sys.stderr)
    sys.stderr.flush()
    os._exit(code)      # as the profiled command would have ended


if __name__ == "__main__":
    main()
