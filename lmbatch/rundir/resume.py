"""Resuming an incomplete run: its run.json read and held to this run's fingerprint (the same command, the
same model files), each part checked against run.json's record of it, and which instances the parts keep
(docs/outputs.md). A run that is replaced instead (`--overwrite`, or other settings) keeps nothing."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from lmbatch.errors import UserError, first_line
from lmbatch.rundir.codec import RecordError
from lmbatch.rundir.layout import PART_KINDS, PARTS, RUN_JSON, SUMMARY, part_file, part_files, temporaries
from lmbatch.rundir.place import Claim, clean_up, refuse_foreign
from lmbatch.rundir.records import FileRecord, PartRecord, RunRecord, sha256
from lmbatch.rundir.rows import numbered


@dataclass
class Kept:
    """What a run directory keeps for this run: run.json and the instances of its whole parts (number -> id)
    where it resumes; `replace`: the run there is replaced at the first write."""
    record: RunRecord | None = None
    saved: dict[int, str] = field(default_factory=dict)
    replace: bool = False


def kept(claim: Claim, fingerprint: dict[str, Any], overwrite: bool) -> Kept:
    """What the claimed directory keeps for a run of `fingerprint`: nothing (empty), an incomplete run of the
    same fingerprint's parts, or nothing and the run there replaced (`--overwrite`)."""
    path, there = claim.path, claim.there
    if there.empty:                      # an empty folder holds nothing to lose
        return Kept()
    out = Kept(replace=True)             # a complete run: claim let it through with --overwrite only
    if there.incomplete:
        out.record = open_incomplete(path, fingerprint, overwrite)
        out.replace = out.record is None
        if out.record is not None:
            out.saved = read_parts(path, out.record.parts)
    refuse_foreign(path, there, overwrite, replacing=out.replace)
    return out


def _differences(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    keys = sorted(set(old) | set(new))
    out = []
    for k in keys:
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _differences(a, b, f"{prefix}{k}.")
        elif a != b:
            out.append(f"{prefix}{k}")
    return out


def open_incomplete(path: Path, fingerprint: dict[str, Any], overwrite: bool) -> RunRecord | None:
    """run.json of the incomplete run at `path`, to resume (its fingerprint is this run's); None where it is
    replaced instead (--overwrite, or it kept nothing); UserError where it can be neither."""
    if (path / SUMMARY).is_file():     # killed while removing what it needed no more
        clean_up(path)
        if not overwrite:
            raise UserError(f"output directory {path} exists; pass --overwrite to replace it or --run-id to name "
                            "another")
        return None
    if not (path / RUN_JSON).exists() and not part_files(path / PARTS, "instances"):
        return None         # killed before its first part: nothing kept
    try:
        record = RunRecord.from_json(json.loads((path / RUN_JSON).read_text(encoding="utf-8")))
    except (OSError, ValueError) as e:
        if overwrite:
            return None
        what = e.line("") if isinstance(e, RecordError) else type(e).__name__
        raise UserError(f"incomplete run {path} has no readable {RUN_JSON} ({what}): pass --overwrite to "
                        "start it over") from None
    diff = _differences(record.fingerprint, fingerprint)
    if diff and not overwrite:
        raise UserError(f"incomplete run {path} was started with other settings ({', '.join(diff[:4])}"
                        f"{', ...' if len(diff) > 4 else ''} differ): re-run its own command to resume it, pass "
                        "--overwrite to start it over, or --run-id to name another")
    return None if diff else record


def read_parts(run: Path, parts: dict[str, PartRecord]) -> dict[int, str]:
    """Check every part of an incomplete run against run.json's records (`parts`, completed here for a
    part written whole but not recorded: killed between the two writes) and read which instances they
    hold (number -> id). Leftovers of a kill (temporary files; a requests file whose instances file never
    came) are removed."""
    parts_dir = run / PARTS
    parts_dir.mkdir(exist_ok=True)
    for f in temporaries(parts_dir):
        f.unlink()
    names = set(part_files(parts_dir, "instances"))
    for name, f in part_files(parts_dir, "requests").items():
        if name not in names and name not in parts:
            f.unlink()
    saved: dict[int, str] = {}
    for name in sorted(set(parts) | names):
        files = {kind: part_file(parts_dir, name, kind) for kind in PART_KINDS}
        recorded = parts.get(name)
        _check_part(run, files["requests"], None if recorded is None else recorded.requests)
        _check_part(run, files["instances"], None if recorded is None else recorded.instances)
        if recorded is None:
            parts[name] = PartRecord(*(FileRecord.of(files[k], pq.ParquetFile(files[k]).metadata.num_rows)
                                       for k in PART_KINDS))
        for number, iid in numbered(files["instances"]):
            if number in saved:
                raise _damaged(run, files["instances"], f"instance {iid} is in two parts")
            saved[number] = iid
    return saved


def _damaged(run: Path, f: Path, what: str) -> UserError:
    return UserError(f"run {run} cannot resume: part {f.relative_to(run)} {what}; delete that part's two files to "
                     "run its instances again, or pass --overwrite to start the run over")


def _check_part(run: Path, f: Path, rec: FileRecord | None) -> None:
    if not f.is_file():
        raise _damaged(run, f, "is missing")
    if rec is not None:
        size = f.stat().st_size
        if size != rec.bytes or sha256(f) != rec.sha256:
            raise _damaged(run, f, f"is damaged ({size} bytes, checksum differs from {RUN_JSON})")
        return
    try:
        pq.read_table(f)
    except (OSError, pa.ArrowException) as e:
        raise _damaged(run, f, f"is unreadable ({first_line(e)})") from None
