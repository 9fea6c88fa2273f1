"""Wall time of a run by phase, from the moment its process started (what a user waits for)."""
from __future__ import annotations

import os
import time
from contextlib import contextmanager
from typing import Iterator


def process_age() -> float:
    """Seconds since this process started (Linux: from /proc; elsewhere 0, i.e. from now)."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


# a run's phases one after the other on its main line, from the process's start to its exit; the model's
# side (imports, cuda_init, weights, compile, graphs, tokenizer; load_background in all) runs beside them
MAIN_LINE = ("startup", "model_files", "data", "tokenize", "plan", "load", "execute", "write")


class Phases:
    """Seconds per named phase. `startup` is the time from the process's start to this object's
    (interpreter start, imports, option parsing); without `since_start`, it is a plain stopwatch."""

    def __init__(self, since_start: bool = True) -> None:
        self._t0 = time.perf_counter() - (process_age() if since_start else 0.0)
        self.seconds: dict[str, float] = {"startup": time.perf_counter() - self._t0} if since_start else {}

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - t)

    def total(self) -> dict[str, float]:
        """Every phase and `total`, the wall time from the process's start until now."""
        return {**self.seconds, "total": time.perf_counter() - self._t0}


def largest(times: dict[str, float], n: int = 3, phases: tuple[str, ...] = MAIN_LINE) -> str:
    """'execute 6.1s, load 2.0s, tokenize 1.5s': the n largest of `phases` (the main line's: the model's
    side overlaps them)."""
    parts = sorted(((v, k) for k, v in times.items() if k in phases), reverse=True)[:n]
    return ", ".join(f"{k} {v:.1f}s" for v, k in parts)
