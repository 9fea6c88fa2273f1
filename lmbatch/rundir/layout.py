"""Every name of a run directory (docs/outputs.md), defined once: its files while it runs and once complete,
its parts' names, what a killed write or a killed `--overwrite` leaves beside it.

    RUN/.lock                             held (flock) by the run writing it (lmbatch/rundir/place.py)
    RUN/INCOMPLETE                        this marker, while the run is not complete
    RUN/run.json                          fingerprint, dtype, attempts, and each part's size and checksum
    RUN/parts/NNNNNN.requests.parquet     the requests of the part's instances (written first)
    RUN/parts/NNNNNN.instances.parquet    finished instances (its rename commits the part)
    RUN/instances.parquet, requests.parquet, summary.json     a complete run's (summary.json last)
    .RUN.old-PID                          beside it: the complete run a running `--overwrite` replaces
"""
from __future__ import annotations

from pathlib import Path

LOCK = ".lock"
MARKER = "INCOMPLETE"
RUN_JSON = "run.json"
PARTS = "parts"
SUMMARY = "summary.json"
INSTANCES = "instances.parquet"
REQUESTS = "requests.parquet"
# what a run directory holds while it runs and once complete; `.NAME.PID.tmp` files (`cache.temporary_name`)
# are a killed write's (`is_temporary`)
RUN_FILES = (SUMMARY, INSTANCES, REQUESTS, MARKER, RUN_JSON, PARTS, LOCK)
MARKER_TEXT = ("This run is incomplete: its finished instances are in parts/. Re-run the same lmbatch run command "
               "with --run-id {name} to resume it.\n")
PART_KINDS = ("requests", "instances")      # a part's two files, in the order they are written


def is_temporary(name: str) -> bool:
    """Whether a file name is a write's temporary one (`.NAME.PID.tmp`, lmbatch.cache.temporary_name)."""
    return name.startswith(".") and name.endswith(".tmp")


def temporaries(folder: Path) -> list[Path]:
    return sorted(folder.glob(".*.tmp"))


def part_name(number: int) -> str:
    return f"{number:06d}"


def part_file(parts: Path, name: str, kind: str) -> Path:
    """`parts/NNNNNN.KIND.parquet`, KIND one of PART_KINDS."""
    return parts / f"{name}.{kind}.parquet"


def part_files(parts: Path, kind: str) -> dict[str, Path]:
    """The parts' files of one kind there are, by part name."""
    return {f.name.split(".")[0]: f for f in sorted(parts.glob(f"*.{kind}.parquet"))}


def aside(path: Path, pid: int) -> Path:
    """Where process `pid` keeps the complete run it replaces (`--overwrite`) until its own completes."""
    return path.parent / f".{path.name}.old-{pid}"


def asides(path: Path) -> list[tuple[Path, int | None]]:
    """Every run kept aside beside `path`, with the process that keeps it (None: not a process id)."""
    out = []
    for p in sorted(path.parent.glob(f".{path.name}.old-*")):
        pid = p.name.rsplit("-", 1)[-1]
        out.append((p, int(pid) if pid.isdigit() else None))
    return out
