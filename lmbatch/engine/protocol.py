"""What the layers above ask of an engine, whichever runs the batch: `Engine` (one model in this
process) or `ParallelEngine` (engines in worker processes). Both implement `BatchEngine`.

A batch's results stream back as `Handover`s the caller pulls from `stream`: whenever the caller's
`handover_due()` says so (between prefill batches and between decode steps) the engine runs what it
has queued and hands over the requests whose results became final since the last handover (an engine
of worker processes hands them over as they arrive, marking the ones that were due); the last
handover holds the rest. `run` is `stream` drained, for callers that want everything at once.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Hashable, Iterator, NamedTuple, Protocol, Sequence, TypedDict, Union

from lmbatch.requests import GenerateRequest, GenerateResult, RunStats, ScoreRequest, ScoreResult

if TYPE_CHECKING:
    import torch
    from typing_extensions import Unpack  # typing's from Python 3.11

    from lmbatch.model.config import ModelConfig
    from lmbatch.scheduler.planner import Plan

Request = Union[ScoreRequest, GenerateRequest]
Result = Union[ScoreResult, GenerateResult]
# (request index, the run's counts so far): a request is done; index -1: a decode step's tokens (`decoding_tokens`)
Progress = Callable[[int, RunStats], None]


class StreamArgs(TypedDict, total=False):
    """How `BatchEngine.stream` executes a batch, each key optional: `schedule` and `seed` order the plan
    made from the requests ("dfs", 0) unless `plan` was made ahead (one engine uses it; several cut its
    sorted order); `progress(i, stats)` is called as request i is done; `handover_due()` is asked
    between batches and decode steps; `groups`: requests of one group run on one engine (a program's
    calls); `feed(idle)`: requests that join the running batch (an open stream: only an engine whose
    `open_stream` is True takes it; `idle`: it has nothing left to run, and ends if none join)."""
    schedule: str
    seed: int
    plan: Plan | None
    progress: Progress | None
    handover_due: Callable[[], bool] | None
    groups: Sequence[Hashable] | None
    feed: Callable[[bool], Sequence[Request]] | None


class Handover(NamedTuple):
    """Requests whose results became final since the last handover (each handed over once), every
    result so far (indexed like the requests) and the run's counts so far. The `last` handover holds
    the requests not handed over before, in execution order, and the run's final counts and timings.
    A handover the caller's `handover_due()` did not ask for (`due` False) comes from an engine to which
    handing over costs nothing (its workers' results arrive as they finish): the caller may take the
    results then, and keeps its own pace for what it does at the due ones."""
    final: list[int]
    results: Sequence[Result]
    stats: RunStats
    last: bool
    due: bool = True


def drain(handovers: Iterator[Handover]) -> tuple[list[Result], RunStats]:
    """Every result of a stream and its final counts (what `run` returns)."""
    last = None
    for last in handovers:
        pass
    if last is None:
        raise ValueError("an engine's stream ended without a handover")
    return list(last.results), last.stats


def remaining(stats: RunStats, handed: bytearray) -> list[int]:
    """The requests not handed over yet, in execution order (each executed request, then those it served)."""
    return [m for j in stats.order for m in stats.members[j] if not handed[m]]


class BatchEngine(Protocol):
    """An engine as the interpreter, the run layer and the lm-eval backend use it."""
    cfg: ModelConfig
    data_parallel: int          # engines behind this one
    tensor_parallel: int        # devices each engine's model is split over
    open_stream: bool           # whether `stream` takes `feed` (requests joining while it runs)

    @property
    def device(self) -> torch.device: ...

    @property
    def kv_slots(self) -> int:
        """Tokens one request may take (the smallest pool of the engines behind this one)."""
        ...

    def match_lens(self, seqs: list[list[int]]) -> list[int]:
        """Tokens of each sequence whose KV some engine's cache holds now."""
        ...

    def stream(self, requests: Sequence[Request], **args: Unpack[StreamArgs]) -> Iterator[Handover]:
        """Execute every request as `args` say (`StreamArgs`)."""
        ...

    def run(self, requests: Sequence[Request], *, schedule: str = "dfs", seed: int = 0,
            progress: Progress | None = None) -> tuple[list[Result], RunStats]:
        """Every result, in the order of `requests`, and the run's counts."""
        ...

    def optimal_unique_tokens(self) -> int | None:
        """The fewest prompt tokens the engines behind this one had to compute over every run so far,
        each over what it executed (None for one engine: the run's own optimum is that)."""
        ...

    def load_report(self) -> list[dict[str, float | int]]:
        """Each engine's seconds busy and idle, tokens computed and chunks run (none for one engine)."""
        ...

    def close(self) -> None:
        """End what the engine started (worker processes)."""
        ...
