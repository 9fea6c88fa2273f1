"""The JSON files a run writes, as typed records (docs/outputs.md): run.json (`RunRecord`), the record of a
file a run vouches for (`FileRecord`), and summary.json (`Summary` and the records within it); the Parquet
tables' rows are rows.py's. Producers build these, readers get them back from `from_json`: a field renamed
here is a type error where it is used, not a KeyError in a user's `lmbatch report`.

Imports nothing beyond the standard library."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmbatch.rundir.codec import ABSENT, Absent, Record, RecordError, Score


def sha256(path: Path, spans: list[tuple[int, int]] | None = None) -> str:
    """SHA-256 of a file, or of its byte spans (start, length) in order."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for start, n in spans or [(0, -1)]:
            fh.seek(start)
            if n >= 0:
                h.update(fh.read(n))
                continue
            while block := fh.read(1 << 20):
                h.update(block)
    return h.hexdigest()


@dataclass
class FileRecord(Record):
    """What summary.json and run.json record of a file they vouch for: rows, size and SHA-256."""
    rows: int
    bytes: int
    sha256: str

    @classmethod
    def of(cls, path: Path, rows: int) -> FileRecord:
        return cls(rows, path.stat().st_size, sha256(path))


# ---- run.json ---------------------------------------------------------------------------------------------------

@dataclass
class Attempt(Record):
    """One attempt at a run: when it started, its seconds so far, the instances it kept, the seconds it
    executed (absent until its first part: an attempt killed before one has none)."""
    started: str
    seconds: float = 0.0
    instances: int = 0
    execute_s: float | Absent = ABSENT


@dataclass
class PartRecord(Record):
    """A part's two files, as run.json records them (the requests file is written first)."""
    requests: FileRecord
    instances: FileRecord


@dataclass(kw_only=True)
class RunRecord(Record):
    """run.json of an incomplete run: the fingerprint of what decides its results (run/identity.py), its
    dtype once known, each attempt, and each whole part by its name (NNNNNN)."""
    run_id: str = ""
    fingerprint: dict[str, Any]
    dtype: str | None = None
    attempts: list[Attempt] = field(default_factory=list)
    parts: dict[str, PartRecord] = field(default_factory=dict)


# ---- summary.json -----------------------------------------------------------------------------------------------
# Fields with a default are absent from the summaries of earlier versions (None there, or ABSENT where null
# says something else); `lmbatch report` reads those too.

@dataclass
class Attention(Record):
    """The attention backend that ran, and why it was chosen."""
    backend: str
    why: str


@dataclass(kw_only=True)
class Counts(Record):
    instances: int
    failed_instances: int | None = None     # its program or score raised (the error column)
    scored_instances: int | None = None     # the others: what the metrics are over
    calls: int | None = None                # calls .. truncated_calls: this attempt's
    requests: int | None = None
    executed_requests: int | None = None
    waves: int | None = None
    truncated_calls: int | None = None
    resumed_instances: int | None = None    # kept from earlier attempts


@dataclass(kw_only=True)
class TaskBlock(Record):
    """One task of the run (`tasks`, lmbatch/results/task_results.py): its counts, primary metric and those a
    comparison tests, its metrics with their standard errors, its tokens and hit rates."""
    n: int
    failed: int | None = None
    primary_metric: str | None = None
    compared_metrics: list[str] | None = None
    metrics: dict[str, Score | None]
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    computed_tokens: int | None = None
    hit_rate: float | None = None
    optimal_hit_rate: float | None = None


@dataclass
class Tokens(Record):
    prompt: int | None = None
    cached: int | None = None
    computed: int | None = None
    unique: int | None = None
    decode: int | None = None
    thinking: int | None = None             # of decode: thinking and its end marker


@dataclass
class Stage(Record):
    """A stage's calls, engine requests and tokens (`stages`, by how many waits came before)."""
    calls: int | None = None
    requests: int | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    computed_tokens: int | None = None
    decode_tokens: int | None = None


@dataclass(kw_only=True)
class Throughput(Record):
    programs_per_s: float
    prompt_tokens_per_s: float
    computed_tokens_per_s: float
    decode_tokens_per_s: float | None = None


@dataclass
class WorkerLoad(Record):
    """A data-parallel worker's seconds running chunks and waiting, tokens, chunks run and taken."""
    busy_s: float
    idle_s: float
    computed_tokens: int
    chunks: int
    chunks_taken: int


@dataclass(kw_only=True)
class DataParallel(Record):
    workers: int
    tensor_parallel: int | None = None
    why: str | None = None
    duplicated_tokens: int | None = None
    optimal_hit_rate: float | None = None
    workers_load: list[WorkerLoad] | Absent = ABSENT      # workers only


@dataclass(kw_only=True)
class Threads(Record):
    """A CPU engine's torch threads (lmbatch/engine/threads.py): the count given (--threads) or None, the most a
    batch may take, the policy, OpenMP's wait policy and how many forward batches ran on how many threads (a
    data-parallel run's summary has the first and the wait policy only: its workers keep theirs)."""
    given: int | None = None
    most: int | Absent = ABSENT
    policy: str | Absent = ABSENT
    wait_policy: str | None = None
    batches_by_threads: dict[str, int] | Absent = ABSENT


@dataclass(kw_only=True)
class Summary(Record):
    """summary.json (docs/outputs.md: what each field means), in the order it is written."""
    run_id: str
    task: str
    shots: int | None | Absent = ABSENT         # null: a suite whose tasks' differ
    created: str | None = None
    lmbatch_version: str | None = None
    git_commit: str | None = None
    model: str
    device: str
    dtype: str | None = None
    model_type: str | None = None
    model_runtime: str | None = None
    quantization: dict[str, Any] | None = None
    attention: Attention | None = None
    workload: str | None = None
    max_tokens_per_batch: int | None = None
    kv_cache_tokens: int | None = None
    threads: Threads | None = None               # CPU runs only (null on CUDA)
    options: dict[str, Any] | None = None        # every option by name (options.RunOptions.flat)
    counts: Counts
    accuracy: float | None
    accuracy_stderr: float | None | Absent = ABSENT
    metrics: dict[str, Score | None] | None = None
    metric_counts: dict[str, int] | None = None
    accuracy_by_subject: dict[str, Score] | None = None
    accuracy_by_subject_counts: dict[str, int] | None = None
    warnings: list[str] | None = None
    tasks: dict[str, TaskBlock] | None = None
    tokens: Tokens | None = None
    hit_rate: float
    optimal_hit_rate: float
    prompt_tree_optimal_hit_rate: float | None = None
    stages: dict[str, Stage] | None = None
    evicted_tokens: int | None = None
    forward_batches: int | None = None
    time_s: dict[str, float]                    # seconds by phase, "execute" among them
    throughput: Throughput
    attempts: list[Attempt] | None = None
    data_parallel: DataParallel | None = None
    deterministic: dict[str, Any] | None = None
    files: dict[str, FileRecord] | None = None  # the Parquet files it vouches for (set as the run completes)

    @classmethod
    def read(cls, data: Any) -> Summary:
        """`from_json`, and the phase every summary times: RecordError if it lacks it."""
        s = cls.from_json(data)
        if EXECUTE not in s.time_s:
            raise RecordError(f"time_s.{EXECUTE}")
        return s

    def option(self, name: str) -> Any:
        """The option `name` as the run had it; ABSENT where the summary does not record it."""
        return (self.options or {}).get(name, ABSENT)

    @property
    def prompt_shots(self) -> int | None:
        """The few-shot examples the prompts hold (null: a suite whose tasks' differ); summaries of earlier
        versions say only the --shots option."""
        if self.shots is not ABSENT:
            return self.shots
        given = self.option("shots")
        return None if given is ABSENT else given

    @property
    def execute_s(self) -> float:
        return self.time_s[EXECUTE]


EXECUTE = "execute"         # the phase of model work (lmbatch/timing.py's name), what throughput divides by


def names_a_run(data: Any) -> bool:
    """Whether parsed JSON is a run's summary by what every version wrote: its run_id and task (a summary
    otherwise damaged is still a run's: `--overwrite` may replace it)."""
    return isinstance(data, dict) and isinstance(data.get("run_id"), str) and isinstance(data.get("task"), str)
