"""A run directory while its run executes: result parts written as instances finish, the resume of an
incomplete run, and the final files merged from the parts (docs/outputs.md).

    RUN/.lock                             held (flock) by the run writing it (lmbatch/rundir/place.py)
    RUN/INCOMPLETE                        this marker, while the run is not complete
    RUN/run.json                          fingerprint, dtype, attempts, and each part's size and checksum
    RUN/parts/NNNNNN.requests.parquet     the requests of the part's instances (written first)
    RUN/parts/NNNNNN.instances.parquet    finished instances (its rename commits the part)

Every file is written to a temporary name, fsynced and renamed, so a kill at any moment leaves only
whole parts. A run completes by writing instances.parquet and requests.parquet merged from the parts,
then summary.json (last: a run directory with it is complete); then the parts, run.json and the
marker go. A re-run of the same command (same fingerprint) with the same --run-id keeps the parts and
runs the other instances.
"""
from __future__ import annotations

import datetime as dt
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple, cast

import pyarrow as pa
import pyarrow.parquet as pq

from lmbatch.cache import atomic_write
from lmbatch.errors import UserError, first_line
from lmbatch.frontend.workload import Instance, Workload
from lmbatch.model.identity import model_identity
from lmbatch.model.quantization import declared
from lmbatch.options import RunOptions, deciding
from lmbatch.rundir.layout import INSTANCE_SCHEMA, clean_stale, file_record, request_schema, sha256
from lmbatch.rundir.place import MARKER, RunLock, clear, found, move_aside, refuse_foreign, run_path

MARKER_TEXT = ("This run is incomplete: its finished instances are in parts/. Re-run the same lmbatch run command "
               "with --run-id {name} to resume it.\n")

# a hook for tests: called with the name of each file operation of a part and of the final write,
# before it (a test raises there to leave the directory as a kill at that moment would)
fault: Callable[[str], None] | None = None


def _at(step: str) -> None:
    if fault is not None:
        fault(step)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_table(path: Path, rows: list[dict], schema: pa.Schema) -> None:
    atomic_write(path, lambda tmp: pq.write_table(pa.Table.from_pylist(rows, schema=schema), tmp), sync=True)


def _write_json(path: Path, data: dict) -> None:
    atomic_write(path, json.dumps(data, indent=2) + "\n", sync=True)


INSTANCE_PART_SCHEMA = INSTANCE_SCHEMA.append(pa.field("attempt", pa.int32())).append(pa.field("number", pa.int64()))


def _request_part_schema(with_tokens: bool) -> pa.Schema:
    return request_schema(with_tokens).append(pa.field("attempt", pa.int32()))


def _differences(old: dict, new: dict, prefix: str = "") -> list[str]:
    keys = sorted(set(old) | set(new))
    out = []
    for k in keys:
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _differences(a, b, f"{prefix}{k}.")
        elif a != b:
            out.append(f"{prefix}{k}")
    return out


def fingerprint(o: RunOptions, w: Workload, model_dir: Path) -> dict[str, Any]:
    """What decides a run's results (a resumed run must have the same): the task and its options
    (`options.deciding`), jump-forward decoding, deterministic mode, whether requests keep their token ids,
    the model's files (each by its content: model/identity.py) and, for a quantized checkpoint, its format
    (model/quantization.py), lmbatch's version. The dtype is checked once
    the device is known."""
    import lmbatch

    fp: dict[str, Any] = {"task": w.name, **deciding(o.workload), "jump_forward": o.engine.jump_forward,
                          "save_token_ids": o.output.save_token_ids, "lmbatch_version": lmbatch.__version__,
                          "model": model_identity(model_dir)}
    if (quantization := declared(model_dir)) is not None:     # said apart, where a resume finds it differs
        fp["quantization"] = quantization
    if o.engine.deterministic:          # a resume may not mix its bits with another attempt's numerics
        fp["deterministic"] = True
    if o.workload.task.endswith(".py"):
        fp["program"] = sha256(Path(o.workload.task))
    return fp


def default_run_id(w: Workload, shots: int, model_dir: Path) -> str:
    """task-Kshot-MODEL-TIME, one folder name whatever the task's and the model folder's names hold."""
    def safe(text: str, n: int) -> str:
        return "".join(c if c.isalnum() or c in "-_.+" else "_" for c in text)[:n].lstrip(".") or "_"
    return f"{safe(w.name, 60)}-{w.shots(shots)}shot-{safe(model_dir.name, 80)}-{dt.datetime.now():%Y%m%d-%H%M%S}"


def for_run(o: RunOptions, w: Workload, model_dir: Path) -> RunDir:
    """The run's directory, `--out`/`--run-id` (default: task-shots-model-time), inside --out and locked
    for this run, then checked: a complete run needs --overwrite, an incomplete one with the same
    fingerprint is resumed, a folder that is no run directory is never replaced."""
    path = run_path(Path(o.output.out), o.output.run_id or default_run_id(w, o.workload.shots, model_dir))
    lock = RunLock(path).acquire()
    try:
        return RunDir(path, fingerprint(o, w, model_dir), o.output.overwrite, o.output.save_token_ids,
                      named=o.output.run_id is not None, lock=lock)
    except BaseException:
        lock.release()
        raise


class Merged(NamedTuple):
    rows: list[dict[str, Any]]      # every instance's row (with its number and attempt)
    record: dict[str, Any]          # run.json: the fingerprint, dtype, attempts and parts


def read_parts(run: Path, parts: dict[str, Any]) -> dict[int, str]:
    """Check every part of an incomplete run against run.json's records (`parts`, completed here for a
    part written whole but not recorded: killed between the two writes) and read which instances they
    hold (number -> id). Leftovers of a kill (temporary files; a requests file whose instances file never
    came) are removed."""
    parts_dir = run / "parts"
    parts_dir.mkdir(exist_ok=True)
    for f in parts_dir.glob(".*.tmp"):
        f.unlink()
    names = {f.name.split(".")[0] for f in parts_dir.glob("*.instances.parquet")}
    for f in parts_dir.glob("*.requests.parquet"):
        if f.name.split(".")[0] not in names and f.name.split(".")[0] not in parts:
            f.unlink()
    saved: dict[int, str] = {}
    for name in sorted(set(parts) | names):
        files = {kind: parts_dir / f"{name}.{kind}.parquet" for kind in ("requests", "instances")}
        for kind, f in files.items():
            _check_part(run, f, parts.get(name, {}).get(kind))
        if name not in parts:
            parts[name] = {kind: file_record(f, pq.ParquetFile(f).metadata.num_rows) for kind, f in files.items()}
        table = pq.read_table(files["instances"], columns=["number", "id"])
        for number, iid in zip(table.column("number").to_pylist(), table.column("id").to_pylist()):
            if number in saved:
                raise _damaged(run, files["instances"], f"instance {iid} is in two parts")
            saved[number] = iid
    return saved


def _damaged(run: Path, f: Path, what: str) -> UserError:
    return UserError(f"run {run} cannot resume: part {f.relative_to(run)} {what}; delete that part's two files to "
                     "run its instances again, or pass --overwrite to start the run over")


def _check_part(run: Path, f: Path, rec: dict | None) -> None:
    if not f.is_file():
        raise _damaged(run, f, "is missing")
    if rec is not None:
        size = f.stat().st_size
        if size != rec.get("bytes") or sha256(f) != rec.get("sha256"):
            raise _damaged(run, f, f"is damaged ({size} bytes, checksum differs from run.json)")
        return
    try:
        pq.read_table(f)
    except (OSError, pa.ArrowException) as e:
        raise _damaged(run, f, f"is unreadable ({first_line(e)})") from None


def open_incomplete(path: Path, fingerprint: dict[str, Any], overwrite: bool) -> dict[str, Any] | None:
    """run.json of the incomplete run at `path`, to resume (its fingerprint is this run's); None where it is
    replaced instead (--overwrite, or it kept nothing); UserError where it can be neither."""
    if (path / "summary.json").is_file():     # killed while removing what it needed no more
        clean_up(path)
        if not overwrite:
            raise UserError(f"output directory {path} exists; pass --overwrite to replace it or --run-id to name "
                            "another")
        return None
    if not (path / "run.json").exists() and not list(path.glob("parts/*.instances.parquet")):
        return None         # killed before its first part: nothing kept
    try:
        record = json.loads((path / "run.json").read_text(encoding="utf-8"))
        theirs = record["fingerprint"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        if overwrite:
            return None
        raise UserError(f"incomplete run {path} has no readable run.json ({type(e).__name__}): pass --overwrite to "
                        "start it over") from None
    diff = _differences(theirs, fingerprint)
    if diff and not overwrite:
        raise UserError(f"incomplete run {path} was started with other settings ({', '.join(diff[:4])}"
                        f"{', ...' if len(diff) > 4 else ''} differ): re-run its own command to resume it, pass "
                        "--overwrite to start it over, or --run-id to name another")
    return None if diff else record


def clean_up(path: Path) -> None:
    """What a complete run no longer needs: its parts, run.json, the marker, and the run it replaced."""
    shutil.rmtree(path / "parts", ignore_errors=True)
    (path / "run.json").unlink(missing_ok=True)
    (path / MARKER).unlink(missing_ok=True)
    for old in path.parent.glob(f".{path.name}.old-*"):
        shutil.rmtree(old, ignore_errors=True)


class RunDir:
    """One run directory, from the check of its name before any work to its completion."""

    def __init__(self, path: Path, fingerprint: dict[str, Any], overwrite: bool, with_tokens: bool,
                 named: bool = True, lock: RunLock | None = None):
        """`lock`: this run's lock on `path`, held already (it goes with `release`)."""
        self.path, self.fingerprint, self.with_tokens, self.lock = path, fingerprint, with_tokens, lock
        # how to resume it: the same command, with the run id it got if the command named none
        self.rerun = "re-run the same command" + ("" if named else f" with --run-id {path.name}")
        self.parts_dir = path / "parts"
        self.replace = False                 # an existing directory is moved aside at the first write
        self.record: dict[str, Any] | None = None    # run.json, once this attempt has one
        self.saved: dict[int, str] = {}      # instance number -> id, of every whole part
        self.saved_now = 0                   # of those, written by this attempt
        self.total: int | None = None        # the task's instances, once loaded
        self.started = time.time()
        self.dtype: str | None = None
        self._materialized = False
        clean_stale(path)
        there = found(path)
        refuse_foreign(path, there, overwrite)
        if there.empty:                      # an empty folder holds nothing to lose
            return
        if there.incomplete:
            self.record = open_incomplete(path, fingerprint, overwrite)
            self.replace = self.record is None
            if self.record is not None:
                self.saved = read_parts(path, self.record.setdefault("parts", {}))
        elif overwrite:
            self.replace = True
        else:
            raise UserError(f"output directory {path} exists; pass --overwrite to replace it or --run-id to name "
                            "another")
        refuse_foreign(path, there, overwrite, replacing=self.replace)

    def release(self) -> None:
        """The end of this run's hold on its directory (of a run that wrote nothing, the folder goes if
        the run made it)."""
        if self.lock is not None:
            self.lock.release()

    @property
    def resuming(self) -> bool:
        return bool(self.saved)

    # ---- resume -----------------------------------------------------------------------------------
    def unsaved(self, instances: list[Instance]) -> list[int]:
        """The numbers of the task's instances no part holds (all of them, unless resuming), after checking
        that the kept ones are the task's instances at their numbers."""
        self.check_instances([inst.id for inst in instances])
        return [k for k in range(len(instances)) if k not in self.saved]

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
        if self.record is not None and self.record.get("dtype") not in (None, dtype):
            if not overwrite:
                raise UserError(f"incomplete run {self.path} ran in {self.record['dtype']}, this attempt would run "
                                f"{dtype}: pass --dtype {self.record['dtype']} to resume it, or --overwrite to start "
                                "over")
            self.record, self.saved, self.replace = None, {}, True
            return False
        return True

    # ---- writing ----------------------------------------------------------------------------------
    def _materialize(self) -> dict[str, Any]:
        """The directory, its marker and this attempt's record in run.json, before the first part."""
        if self._materialized:
            return cast(dict, self.record)
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
            self.record = {"run_id": self.path.name, "fingerprint": self.fingerprint,
                           "dtype": self.dtype, "attempts": [], "parts": {}}
        self.record["attempts"].append({"started": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                                        "seconds": 0.0, "instances": 0})
        _write_json(self.path / "run.json", self.record)       # before any part: what the parts are of
        self.parts_dir.mkdir(exist_ok=True)
        self._materialized = True
        return self.record

    def write_part(self, instances: list[dict], requests: list[dict], execute_s: float = 0.0) -> None:
        """Keep finished instances (rows of INSTANCE_SCHEMA with "number") and their requests' rows;
        `execute_s`: the seconds this attempt has executed so far (its throughput counts them)."""
        if not instances:
            return
        try:
            record = self._materialize()
            attempt = len(record["attempts"])
            name = f"{len(record['parts']) + 1:06d}"
            while (self.parts_dir / f"{name}.instances.parquet").exists():      # never over a whole part
                name = f"{int(name) + 1:06d}"
            for r in instances:
                r["attempt"] = attempt
            for r in requests:
                r["attempt"] = attempt
            f_req = self.parts_dir / f"{name}.requests.parquet"
            f_inst = self.parts_dir / f"{name}.instances.parquet"
            _at("part requests")
            _write_table(f_req, requests, _request_part_schema(self.with_tokens))
            _at("part instances")
            _write_table(f_inst, instances, INSTANCE_PART_SCHEMA)
            _fsync_dir(self.parts_dir)
            for r in instances:
                self.saved[r["number"]] = r["id"]
            self.saved_now += len(instances)
            record["parts"][name] = {"requests": file_record(f_req, len(requests)),
                                     "instances": file_record(f_inst, len(instances))}
            this = record["attempts"][-1]
            this["seconds"] = round(time.time() - self.started, 3)
            this["instances"] = self.saved_now
            this["execute_s"] = round(execute_s, 3)
            _at("run.json")
            _write_json(self.path / "run.json", record)
        except OSError as e:
            raise UserError(f"cannot write results to {self.path}: {e.strerror or e}; {len(self.saved)} of "
                            f"{self.total or '?'} instances are kept in whole parts: {self.rerun} to resume once the "
                            "disk is writable") from None

    def merge(self, execute_s: float) -> Merged:
        """Merge the parts into instances.parquet and requests.parquet: the instance rows with their number
        and attempt, and this run's record with every attempt (this one executed `execute_s`)."""
        try:
            record = self._materialize()
            names = sorted(record["parts"])
            inst = pa.concat_tables([pq.read_table(self.parts_dir / f"{n}.instances.parquet") for n in names]
                                    or [INSTANCE_PART_SCHEMA.empty_table()])
            inst = inst.sort_by("number")
            # a part an older lmbatch wrote lacks the task column: null there
            reqs = pa.concat_tables([pq.read_table(self.parts_dir / f"{n}.requests.parquet") for n in names]
                                    or [_request_part_schema(self.with_tokens).empty_table()],
                                    promote_options="default")
            reqs = reqs.sort_by([("attempt", "ascending"), ("order", "ascending")])
            rows = inst.to_pylist()
            final_inst = inst.drop_columns(["number"])
            _at("instances.parquet")
            atomic_write(self.path / "instances.parquet", lambda tmp: pq.write_table(final_inst, tmp), sync=True)
            _at("requests.parquet")
            atomic_write(self.path / "requests.parquet", lambda tmp: pq.write_table(reqs, tmp), sync=True)
            this = record["attempts"][-1]
            this["seconds"] = round(time.time() - self.started, 3)
            this["instances"] = self.saved_now
            this["execute_s"] = round(execute_s, 3)
            self._files = {"instances.parquet": file_record(self.path / "instances.parquet", inst.num_rows),
                           "requests.parquet": file_record(self.path / "requests.parquet", reqs.num_rows)}
        except OSError as e:
            raise self._unwritable(e) from None
        for r in rows:
            r["metrics"] = dict(r["metrics"])       # a Parquet map reads back as pairs
        return Merged(rows, record)

    def finish(self, summary: dict[str, Any]) -> None:
        """Write summary.json (with the merged files' records): the run is complete; then remove what only
        an incomplete run needs."""
        try:
            summary["files"] = self._files
            _at("summary.json")
            _write_json(self.path / "summary.json", summary)      # the run is complete from here
            _fsync_dir(self.path)
            _at("cleanup")
            clean_up(self.path)
        except OSError as e:
            raise self._unwritable(e) from None

    def _unwritable(self, e: OSError) -> UserError:
        return UserError(f"cannot write results to {self.path}: {e.strerror or e}; the finished instances are "
                         f"kept in whole parts: {self.rerun} once the disk is writable")
