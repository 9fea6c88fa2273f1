"""CPU threads that hold on a busy machine: torch's intra-op threads sized, batch by batch, to the cores other
processes leave free (and one for a batch of few tokens), and OpenMP threads that sleep when they wait.

A forward pass is hundreds of ops; each op split over threads ends at a barrier that waits for every thread.
Where another process holds a core, the thread scheduled on it runs only when the kernel gives it a slice
(milliseconds), so every op of a decode step waits that long: on this project's 2-core CPU beside a 2-thread
job, tree of thought's decode took 13x longer with torch's two threads than with one. So:
- `cpu_environment` (before torch loads: OpenMP and MKL read it once) makes waiting threads sleep rather than
  spin (`OMP_WAIT_POLICY=PASSIVE`; `KMP_BLOCKTIME=0` for Intel's OpenMP), so idle threads leave the cores to
  whoever runs, and puts MKL in its strict reproducible mode (`MKL_CBWR=AUTO,STRICT`: a GEMM's bits do not
  depend on its threads); a user's own setting wins;
- `CpuThreads` gives each forward batch `free cores` threads (at least 1, at most the process's share), from
  /proc/stat's busy time less this process's own over the last SAMPLE_S, and a batch under SMALL_TOKENS
  tokens (a decode step of few rows) 1 unless every core the process may take is free (its ops are too small
  for a split to pay for one wait on a core another process holds);
- `--threads N` (`EngineSpec.threads`) fixes the count for users who know their machine.
The thread count changes no bit of a result here: MKL's strict mode gives a GEMM the same bits on any number of
threads (torch's CPU flash attention too, whose products are MKL's), and torch's reductions split over rows
(tests/unit/test_threads.py checks the model's logits). Without it, on an AVX2-only AMD EPYC (2026-11-29, MKL
2024.2), GEMMs of 5-11 rows and the flash kernel's attention of 1 or 3 queries a head changed in their last bits
between one thread and two; with it, none did, at the same speed (a 2,048 x 576 x 1,536 GEMM 26.1 ms against
25.0, one of 32 rows 448 us against 576)."""
from __future__ import annotations

import os
import time
from collections import Counter

WAIT_POLICY = {"OMP_WAIT_POLICY": "PASSIVE", "KMP_BLOCKTIME": "0"}
SAME_BITS = {"MKL_CBWR": "AUTO,STRICT"}     # MKL's conditional numerical reproducibility, strict: whatever the threads
SMALL_TOKENS = 16       # a batch of fewer tokens runs on one thread unless the process's every core is free
IDLE_MARGIN = 0.25      # cores others may use of those and still count as free (a machine's own background)
SAMPLE_S = 0.5          # the free cores are measured over at least this long


def cpu_environment() -> None:
    """OpenMP's threads sleep when they wait, and MKL's results do not depend on its threads (unless the user set
    the variables): call before torch loads."""
    for key, value in {**WAIT_POLICY, **SAME_BITS}.items():
        os.environ.setdefault(key, value)


def usable_cores() -> int:
    """The cores this process may run on (its affinity, where the system says)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _busy_s() -> float | None:
    """Seconds every CPU of the machine has been busy (/proc/stat), or None where there is no such file."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)       # idle and iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


class FreeCores:
    """The cores other processes leave free: all the machine's, less the CPU time others used (the machine's
    busy time less this process's own) over the last SAMPLE_S or more, per second. Where /proc/stat cannot be
    read, every core counts as free."""

    def __init__(self) -> None:
        self.cores = os.cpu_count() or 1
        self.free = float(self.cores)
        self._last = (time.monotonic(), _busy_s(), time.process_time())

    def get(self) -> float:
        now = time.monotonic()
        at, busy, own = self._last
        if busy is None or now - at < SAMPLE_S:
            return self.free
        busy_now, own_now = _busy_s(), time.process_time()
        if busy_now is not None:
            others = max(0.0, (busy_now - busy) - (own_now - own)) / (now - at)
            self.free = max(0.0, self.cores - others)
        self._last = (now, busy_now, own_now)
        return self.free


class CpuThreads:
    """Torch's intra-op threads on the CPU, set before each forward batch (`apply`) and kept for what follows it
    (a decode step's sampling): `fixed` where given, else the free cores (`FreeCores`), at most the process's
    own setting (`most`: torch's threads as the process set them: the cores, OMP_NUM_THREADS, a data-parallel
    worker's share; a change made by anyone else is taken as the new setting); a batch under SMALL_TOKENS
    tokens gets them all only where all are free, else 1. `restore` puts the process's setting back (the
    engine, at the end of each run: what runs between, and the score cache's key, see it unchanged). `used`
    counts the batches by their threads."""

    def __init__(self, fixed: int | None = None):
        self.fixed = fixed
        self.free = FreeCores()
        self.used: Counter[int] = Counter()
        self.most = 0               # the process's setting
        self._set = 0               # what `apply` set last (0: nothing since the last restore)

    def for_batch(self, tokens: int) -> int:
        if self.fixed is not None:
            return self.fixed
        free = self.free.get()
        if tokens < SMALL_TOKENS:       # all the process may take only where every one of them is free
            return self.most if free >= self.most - IDLE_MARGIN else 1
        return max(1, min(self.most, int(free + 0.5)))

    def apply(self, tokens: int) -> None:
        """Torch's threads for a forward batch of `tokens` tokens."""
        import torch

        now = torch.get_num_threads()
        if now != self._set:            # none set since the last restore, or another hand set them
            self.most = now
        n = self.for_batch(tokens)
        self.used[n] += 1
        if n != now:
            torch.set_num_threads(n)
        self._set = n

    def restore(self) -> None:
        """The process's own setting back, where `apply` changed it."""
        if self._set:
            import torch

            if torch.get_num_threads() == self._set != self.most:
                torch.set_num_threads(self.most)
            self._set = 0

    def describe(self) -> dict[str, object]:
        """What summary.json says of the policy and what it did."""
        return {"given": self.fixed, "most": self.fixed or self.most,
                "policy": "fixed (--threads)" if self.fixed is not None else
                          f"the cores other processes leave free; a batch under {SMALL_TOKENS} tokens 1 unless "
                          "all are",
                "wait_policy": os.environ.get("OMP_WAIT_POLICY", "unset"),
                "batches_by_threads": {str(k): v for k, v in sorted(self.used.items())}}
