"""A run directory while its run executes: result parts written as instances finish, and the final files
merged from the parts (docs/outputs.md; its names: lmbatch/rundir/layout.py). It is claimed first
(lmbatch/rundir/place.py) and what an incomplete run there keeps is read (lmbatch/rundir/resume.py).

Every file is written to a temporary name, fsynced and renamed (lmbatch/cache.py), so a kill at any moment
leaves only whole parts. A run completes by writing instances.parquet and requests.parquet merged from the
parts, then summary.json (last: a run directory with it is complete); then the parts, run.json and the
marker go. A re-run of the same command (same fingerprint) with the same --run-id keeps the parts and
runs the other instances.
"""
from __future__ import annotations

import datetime as dt
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple

import pyarrow as pa
import pyarrow.parquet as pq

from lmbatch.cache import fsync_dir, write_json, write_table
from lmbatch.errors import UserError
from lmbatch.rundir.layout import (
    INSTANCES,
    MARKER,
    MARKER_TEXT,
    PARTS,
    REQUESTS,
    RUN_JSON,
    SUMMARY,
    part_file,
    part_name,
)
from lmbatch.rundir.place import Claim, RunLock, clean_up, clear, found, move_aside
from lmbatch.rundir.records import Attempt, FileRecord, PartRecord, RunRecord, Summary
from lmbatch.rundir.resume import Kept
from lmbatch.rundir.rows import (
    InstanceRow,
    RequestRow,
    in_order,
    instance_rows,
    instance_schema,
    request_schema,
    table,
    unnumbered,
)

# a hook for tests: called with the name of each file operation of a part and of the final write,
# before it (a test raises there to leave the directory as a kill at that moment would)
fault: Callable[[str], None] | None = None


def _at(step: str) -> None:
    if fault is not None:
        fault(step)


class Merged(NamedTuple):
    rows: list[InstanceRow]         # every instance's row (with its number and attempt)
    record: RunRecord               # run.json: the fingerprint, dtype, attempts and parts


class RunDir:
    """One run directory, from its claim to its completion."""

    def __init__(self, path: Path, fingerprint: dict[str, Any], with_tokens: bool, named: bool = True,
                 lock: RunLock | None = None, kept: Kept | None = None):
        """`lock`: this run's lock on `path`, held already (it goes with `release`); `kept`: what the directory
        keeps for this run (`resume.kept`; None: nothing, it is empty)."""
        self.path, self.fingerprint, self.with_tokens, self.lock = path, fingerprint, with_tokens, lock
        # how to resume it: the same command, with the run id it got if the command named none
        self.rerun = "re-run the same command" + ("" if named else f" with --run-id {path.name}")
        self.parts_dir = path / PARTS
        kept = kept or Kept()
        self.replace = kept.replace              # an existing directory is moved aside at the first write
        self.record = kept.record                # run.json, once this attempt has one
        self.saved = kept.saved                  # instance number -> id, of every whole part
        self.saved_now = 0                       # of those, written by this attempt
        self.total: int | None = None            # the task's instances, once loaded
        self.started = time.time()
        self.dtype: str | None = None
        self._materialized = False
        self._files: dict[str, FileRecord] = {}

    @classmethod
    def claimed(cls, claim: Claim, fingerprint: dict[str, Any], kept: Kept, with_tokens: bool,
                named: bool) -> RunDir:
        return cls(claim.path, fingerprint, with_tokens, named, claim.lock, kept)

    def release(self) -> None:
        """The end of this run's hold on its directory (of a run that wrote nothing, the folder goes if
        the run made it)."""
        if self.lock is not None:
            self.lock.release()

    @property
    def resuming(self) -> bool:
        return bool(self.saved)

    # ---- resume -----------------------------------------------------------------------------------
    def unsaved(self, ids: list[str]) -> list[int]:
        """The numbers of the task's instances (`ids`, in order) no part holds (all of them, unless resuming),
        after checking that the kept ones are the task's instances at their numbers."""
        self.check_instances(ids)
        return [k for k in range(len(ids)) if k not in self.saved]

    @property
    def unsaved_count(self) -> int:
        return (self.total or 0) - len(self.saved)

    def check_instances(self, ids: list[str]) -> None:
        """The kept instances are the task's instances at their numbers (the data did not change)."""
        self.total = len(ids)
        for number, iid in self.saved.items():
            if number >= len(ids) or ids[number] != iid:
                raise UserError(f"incomplete run {self.path} holds instance {iid} where the task now has "
                                f"{ids[number] if number < len(ids) else 'none'}: its data changed; pass --overwrite "
                                "to start it over")

    def check_dtype(self, dtype: str, overwrite: bool) -> bool:
        """Whether the kept instances stand (they ran in `dtype` too); False: --overwrite starts over."""
        self.dtype = dtype
        if self.record is not None and self.record.dtype not in (None, dtype):
            if not overwrite:
                raise UserError(f"incomplete run {self.path} ran in {self.record.dtype}, this attempt would run "
                                f"{dtype}: pass --dtype {self.record.dtype} to resume it, or --overwrite to start "
                                "over")
            self.record, self.saved, self.replace = None, {}, True
            return False
        return True

    # ---- writing ----------------------------------------------------------------------------------
    def _materialize(self) -> RunRecord:
        """The directory, its marker and this attempt's record in run.json, before the first part."""
        if self._materialized and self.record is not None:
            return self.record
        if self.replace and self.path.exists():
            there = found(self.path)
            if there.incomplete or not there.complete:      # an incomplete run: nothing a user kept
                clear(self.path)
            else:
                move_aside(self.path)
            self.replace = False
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / MARKER).write_text(MARKER_TEXT.format(name=self.path.name))
        if self.record is None:
            self.record = RunRecord(run_id=self.path.name, fingerprint=self.fingerprint, dtype=self.dtype)
        self.record.attempts.append(Attempt(dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")))
        write_json(self.path / RUN_JSON, self.record.to_json())       # before any part: what the parts are of
        self.parts_dir.mkdir(exist_ok=True)
        self._materialized = True
        return self.record

    def _attempt_so_far(self, record: RunRecord, execute_s: float) -> None:
        this = record.attempts[-1]
        this.seconds = round(time.time() - self.started, 3)
        this.instances = self.saved_now
        this.execute_s = round(execute_s, 3)

    def write_part(self, instances: list[InstanceRow], requests: list[RequestRow], execute_s: float = 0.0) -> None:
        """Keep finished instances (with their numbers) and their requests' rows; `execute_s`: the seconds
        this attempt has executed so far (its throughput counts them)."""
        if not instances:
            return
        try:
            record = self._materialize()
            attempt = len(record.attempts)
            number = len(record.parts) + 1
            while part_file(self.parts_dir, part_name(number), "instances").exists():     # never over a whole part
                number += 1
            name = part_name(number)
            for r in instances:
                r.attempt = attempt
            for q in requests:
                q.attempt = attempt
            f_req, f_inst = (part_file(self.parts_dir, name, kind) for kind in ("requests", "instances"))
            _at("part requests")
            write_table(f_req, table(requests, request_schema(self.with_tokens, part=True)))
            _at("part instances")
            write_table(f_inst, table(instances, instance_schema(part=True)))
            fsync_dir(self.parts_dir)
            for r in instances:
                self.saved[r.number] = r.id
            self.saved_now += len(instances)
            record.parts[name] = PartRecord(FileRecord.of(f_req, len(requests)), FileRecord.of(f_inst, len(instances)))
            self._attempt_so_far(record, execute_s)
            _at(RUN_JSON)
            write_json(self.path / RUN_JSON, record.to_json())
        except OSError as e:
            raise UserError(f"cannot write results to {self.path}: {e.strerror or e}; {len(self.saved)} of "
                            f"{self.total or '?'} instances are kept in whole parts: {self.rerun} to resume once the "
                            "disk is writable") from None

    def merge(self, execute_s: float) -> Merged:
        """Merge the parts into instances.parquet and requests.parquet: the instance rows with their number
        and attempt, and this run's record with every attempt (this one executed `execute_s`)."""
        try:
            record = self._materialize()
            names = sorted(record.parts)
            inst = pa.concat_tables([pq.read_table(part_file(self.parts_dir, n, "instances")) for n in names]
                                    or [instance_schema(part=True).empty_table()])
            # a part an older lmbatch wrote lacks the task column: null there
            reqs = pa.concat_tables([pq.read_table(part_file(self.parts_dir, n, "requests")) for n in names]
                                    or [request_schema(self.with_tokens, part=True).empty_table()],
                                    promote_options="default")
            inst, reqs = in_order(inst, reqs)
            _at(INSTANCES)
            write_table(self.path / INSTANCES, unnumbered(inst))
            _at(REQUESTS)
            write_table(self.path / REQUESTS, reqs)
            self._attempt_so_far(record, execute_s)
            self._files = {INSTANCES: FileRecord.of(self.path / INSTANCES, inst.num_rows),
                           REQUESTS: FileRecord.of(self.path / REQUESTS, reqs.num_rows)}
        except OSError as e:
            raise self._unwritable(e) from None
        return Merged(instance_rows(inst), record)

    def finish(self, summary: Summary) -> None:
        """Write summary.json (with the merged files' records): the run is complete; then remove what only
        an incomplete run needs."""
        try:
            summary.files = self._files
            _at(SUMMARY)
            write_json(self.path / SUMMARY, summary.to_json())      # the run is complete from here
            fsync_dir(self.path)
            _at("cleanup")
            clean_up(self.path)
        except OSError as e:
            raise self._unwritable(e) from None

    def _unwritable(self, e: OSError) -> UserError:
        return UserError(f"cannot write results to {self.path}: {e.strerror or e}; the finished instances are "
                         f"kept in whole parts: {self.rerun} once the disk is writable")
