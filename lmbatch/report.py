"""Read run directories (docs/outputs.md), tabulate them and compare two runs for regressions."""

from __future__ import annotations

import json
import math
from pathlib import Path, PurePosixPath
from typing import Any, Iterable

from lmbatch.errors import UserError, first_line

FORMATS = ("table", "markdown", "json")
# a task's own metrics other than acc (HellaSwag's acc_norm, json's complete and valid) are columns too,
# after accuracy (`columns`)
COLUMNS = ("run_id", "task", "model", "shots", "dtype", "device", "instances", "failed", "accuracy", "hit_rate",
           "optimal_hit_rate", "hit_ratio", "execute_s", "programs_per_s",
           "prompt_tokens_per_s", "computed_tokens_per_s")
# Decimals shown per float column in the table and markdown formats (a metric's column: 4).
DECIMALS = {"accuracy": 4, "hit_rate": 4, "optimal_hit_rate": 4, "hit_ratio": 4, "execute_s": 2,
            "programs_per_s": 1, "prompt_tokens_per_s": 1, "computed_tokens_per_s": 1}
_EPS = 1e-9  # thresholds are inclusive: a value exactly at a limit (up to float noise) passes

# The fields report and compare read, and what each must be: a summary with another type (a hand-edited
# or foreign file) is one line naming the field, not a TypeError.
_NUMBER, _OPTIONAL_NUMBER, _INT, _STR, _OBJECT = "a number", "a number or null", "an integer", "a string", "an object"
FIELDS = {"run_id": _STR, "task": _STR, "model": _STR, "device": _STR, "dtype": _STR, "counts": _OBJECT,
          "counts.instances": _INT, "counts.failed_instances": _INT, "accuracy": _OPTIONAL_NUMBER,
          "metrics": _OBJECT, "hit_rate": _NUMBER, "optimal_hit_rate": _NUMBER, "time_s": _OBJECT,
          "time_s.execute": _NUMBER, "throughput": _OBJECT, "throughput.programs_per_s": _NUMBER,
          "throughput.prompt_tokens_per_s": _NUMBER, "throughput.computed_tokens_per_s": _NUMBER,
          "options": _OBJECT, "files": _OBJECT}
# the fields every summary has (the others are newer than some summaries)
REQUIRED = ("run_id", "task", "model", "device", "counts.instances", "accuracy", "hit_rate", "optimal_hit_rate",
            "time_s.execute", "throughput.programs_per_s", "throughput.prompt_tokens_per_s",
            "throughput.computed_tokens_per_s")
# What decides a run's workload (and so its accuracy and speed): --compare refuses runs that differ in any
# field both summaries have. The model is compared by its folder's name (the same model lives at other
# paths on other machines).
WORKLOAD = ("task", "model", "dtype", "counts.instances", "options.shots", "options.limit", "options.subjects",
            "options.seed", "options.apply_chat_template", "options.system_instruction",
            "options.fewshot_as_multiturn", "options.think_budget", "options.think_end", "options.truncate_left")


def load_summary(run_dir: Path) -> dict:
    """The parsed summary.json of a run directory; UserError if absent or unreadable."""
    path = Path(run_dir) / "summary.json"
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        if (Path(run_dir) / "INCOMPLETE").is_file():
            raise UserError(f"{run_dir} is an incomplete run (interrupted, or still running): re-run the same "
                            "lmbatch run command to resume it") from None
        raise UserError(f"{run_dir} is not an lmbatch run directory (no summary.json)") from None
    except UnicodeDecodeError as e:
        raise UserError(f"{path} is not an lmbatch summary (not UTF-8 text: {e.reason} at byte {e.start})") from None
    try:
        data = json.loads(text)
    except ValueError as e:
        raise UserError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise UserError(f"{path} is not an lmbatch summary (expected a JSON object)")
    for dotted in FIELDS:
        _typed(data, dotted, str(path))
    for dotted in REQUIRED:
        if not _has(data, dotted):
            raise UserError(f"{path} lacks field '{dotted}': not a summary lmbatch wrote")
    _metrics(data, str(path))
    _check_files(Path(run_dir), data.get("files"))
    return data


def _has(summary: dict, dotted: str) -> bool:
    value: Any = summary
    for key in dotted.split("."):
        if not isinstance(value, dict) or key not in value:
            return False
        value = value[key]
    return True


def _typed(summary: dict, dotted: str, where: str) -> Any:
    """summary's field `dotted` (None if absent), checked to be what FIELDS says it is."""
    value: Any = summary
    for key in dotted.split("."):
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    kind = FIELDS.get(dotted)
    number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = {_NUMBER: number, _OPTIONAL_NUMBER: value is None or number, _STR: isinstance(value, str),
          _INT: isinstance(value, int) and not isinstance(value, bool), _OBJECT: isinstance(value, dict),
          None: True}[kind]
    if not ok:
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        raise UserError(f"{where}: field '{dotted}' is {shown} ({type(value).__name__}), not {kind}: not a summary "
                        "lmbatch wrote")
    return value


def _check_files(run_dir: Path, files: Any) -> None:
    """The run's Parquet files are those its summary recorded (size and SHA-256): not truncated, not
    another run's. Summaries written before lmbatch recorded them have no "files": their Parquet files
    are read whole instead (a truncated one is found, another run's is not)."""
    from lmbatch.outputs import file_record

    if not isinstance(files, dict):
        _read_whole(run_dir)
        return
    for name, rec in files.items():
        f, want = run_dir / name, rec if isinstance(rec, dict) else {}
        if not f.is_file():
            raise UserError(f"{f} is missing: the run directory was altered")
        size = f.stat().st_size
        if size != want.get("bytes"):
            what = f"size {size} != {want.get('bytes')} bytes"
        elif file_record(f, 0)["sha256"] != want.get("sha256"):
            what = "same size, its checksum differs"
        else:
            continue
        raise UserError(f"{f} does not belong to this run's summary ({what}): the run directory was altered "
                        "or mixed with another run")


def _read_whole(run_dir: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    for name in ("instances.parquet", "requests.parquet"):
        f = run_dir / name
        if f.is_file():
            try:
                pq.read_table(f)
            except (OSError, ValueError, pa.ArrowException) as e:
                raise UserError(f"{f} is not a whole Parquet file ({first_line(e)}): the run directory was altered "
                                "(its summary, from an older lmbatch, records no checksums)") from None


def _get(summary: dict, dotted: str) -> Any:
    """summary['a']['b'] for 'a.b', of the type FIELDS says; UserError naming the run and field when
    missing or of another type."""
    value: Any = summary
    for key in dotted.split("."):
        if not isinstance(value, dict) or key not in value:
            raise UserError(f"summary of run {summary.get('run_id', '?')} lacks field '{dotted}'")
        value = value[key]
    return _typed(summary, dotted, f"summary of run {summary.get('run_id', '?')}")


def _optional(summary: dict, dotted: str) -> Any:
    """Like `_get`, None where the summary has no such field (one written by an older lmbatch)."""
    return _typed(summary, dotted, f"summary of run {summary.get('run_id', '?')}")


def hit_ratio(summary: dict) -> float:
    """Achieved / optimal prefix-cache hit rate; 1.0 when the optimum is 0."""
    achieved, optimal = _get(summary, "hit_rate"), _get(summary, "optimal_hit_rate")
    return 1.0 if not optimal else achieved / optimal


def _model_name(model: str) -> str:
    return PurePosixPath(model.replace("\\", "/")).name


def _metrics(s: dict, where: str = "") -> dict[str, Any]:
    """A run's own metrics other than acc (its accuracy column), each a column of its own: HellaSwag's
    acc_norm, json's complete and valid. A metric named like a column is shown as metric:NAME."""
    metrics = _optional(s, "metrics") or {}
    out = {}
    for name, value in sorted(metrics.items()):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise UserError(f"{where or 'summary of run ' + str(s.get('run_id', '?'))}: field 'metrics.{name}' is "
                            f"{value!r}, not a number: not a summary lmbatch wrote")
        if name == "acc":
            continue
        out[f"metric:{name}" if name in COLUMNS else name] = value
    return out


def report_rows(summaries: Iterable[dict]) -> list[dict]:
    """One flat row per run summary: COLUMNS, and the run's own metrics (`_metrics`) after accuracy."""
    rows = []
    for s in summaries:
        options = _optional(s, "options") or {}
        rows.append({
            "run_id": _get(s, "run_id"),
            "task": _get(s, "task"),
            "model": _model_name(_get(s, "model")),
            "shots": options.get("shots"),
            "dtype": _optional(s, "dtype"),
            "device": _get(s, "device"),
            "instances": _get(s, "counts.instances"),
            "failed": _optional(s, "counts.failed_instances"),
            "accuracy": _get(s, "accuracy"),
            **_metrics(s),
            "hit_rate": _get(s, "hit_rate"),
            "optimal_hit_rate": _get(s, "optimal_hit_rate"),
            "hit_ratio": hit_ratio(s),
            "execute_s": _get(s, "time_s.execute"),
            "programs_per_s": _get(s, "throughput.programs_per_s"),
            "prompt_tokens_per_s": _get(s, "throughput.prompt_tokens_per_s"),
            "computed_tokens_per_s": _get(s, "throughput.computed_tokens_per_s"),
        })
    return rows


def columns(rows: list[dict]) -> list[str]:
    """COLUMNS, with every metric column of the rows after accuracy (in order of first appearance)."""
    metrics = list(dict.fromkeys(k for r in rows for k in r if k not in COLUMNS))
    at = COLUMNS.index("accuracy") + 1
    return [*COLUMNS[:at], *metrics, *COLUMNS[at:]]


def _cell(column: str, value: Any) -> str:
    """A value as displayed in table/markdown ('-' for None)."""
    if value is None:
        return "-"
    if column not in COLUMNS and isinstance(value, float):      # a metric
        return f"{value:.4f}"
    if column in DECIMALS and isinstance(value, (int, float)) and not isinstance(value, bool):
        if column.endswith("_per_s") and 0 < abs(value) < 10:
            return f"{value:.3g}"       # a small run's rate: not "0.0"
        return f"{value:.{DECIMALS[column]}f}"
    return str(value)


def render(rows: list[dict], fmt: str) -> str:
    """rows as 'table' (aligned plain text), 'markdown' (GitHub table) or 'json'."""
    if fmt not in FORMATS:
        raise UserError(f"unknown format {fmt!r} (choose from {', '.join(FORMATS)})")
    if fmt == "json":
        return json.dumps(rows, indent=2)
    cols = columns(rows)
    cells = [[_cell(c, r.get(c)) for c in cols] for r in rows]
    numeric = [c in DECIMALS or c in ("shots", "instances", "failed") or c not in COLUMNS for c in cols]
    if fmt == "markdown":
        lines = ["| " + " | ".join(cols) + " |",
                 "|" + "|".join("---:" if n else "---" for n in numeric) + "|"]
        lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in cells]
        return "\n".join(lines)
    widths = [max(len(h), *(len(row[i]) for row in cells)) for i, h in enumerate(cols)]

    def line(values: list[str] | tuple[str, ...]) -> str:
        return "  ".join(v.rjust(w) if n else v.ljust(w)
                         for v, w, n in zip(values, widths, numeric)).rstrip()

    return "\n".join([line(cols), line(["-" * w for w in widths])] + [line(r) for r in cells])


def check_thresholds(max_slowdown: float, min_hit_ratio: float, max_acc_drop: float) -> None:
    """--max-slowdown is at least 0 (inf: speed unchecked); --min-hit-ratio and --max-acc-drop are
    fractions, 0 to 1. NaN is none of them."""
    for flag, value, top in (("--max-slowdown", max_slowdown, math.inf), ("--min-hit-ratio", min_hit_ratio, 1.0),
                             ("--max-acc-drop", max_acc_drop, 1.0)):
        if not 0 <= value <= top:       # NaN fails both
            within = "at least 0" if top == math.inf else "a fraction from 0 to 1"
            raise UserError(f"{flag} {value}: it must be {within}")


def _workload(summary: dict, dotted: str) -> Any:
    """A WORKLOAD field as compared: the model by its folder's name, subjects as a set; absent: None."""
    value: Any = summary
    for key in dotted.split("."):
        if not isinstance(value, dict) or key not in value:
            return _ABSENT
        value = value[key]
    if dotted == "model" and isinstance(value, str):
        return _model_name(value)
    if dotted == "options.subjects" and isinstance(value, list):
        return sorted(set(map(str, value)))
    return value


_ABSENT = object()


def workload_differences(base: dict, cand: dict) -> list[str]:
    """The WORKLOAD fields in which the two runs differ, each as 'name base vs candidate' (a field one of
    them lacks, written by an older lmbatch, is not compared)."""
    out = []
    for dotted in WORKLOAD:
        b, c = _workload(base, dotted), _workload(cand, dotted)
        if b is not _ABSENT and c is not _ABSENT and b != c:
            out.append(f"{dotted.removeprefix('options.').replace('counts.', '')} {b!r} vs {c!r}")
    return out


def compare(base: dict, cand: dict, max_slowdown: float = 0.05, min_hit_ratio: float = 0.99,
            max_acc_drop: float = 0.005) -> tuple[bool, list[str]]:
    """Check candidate against base for speed, cache-hit and accuracy regressions: (ok, lines).

    Limits are inclusive (exactly at a threshold passes). UserError if the thresholds are out of range or
    the runs are not comparable (they ran other workloads: `workload_differences`).
    """
    check_thresholds(max_slowdown, min_hit_ratio, max_acc_drop)
    _get(base, "task"), _get(cand, "task"), _get(base, "counts.instances"), _get(cand, "counts.instances")
    diff = workload_differences(base, cand)
    if diff:
        raise UserError(f"cannot compare: base and candidate ran different workloads (base vs candidate: "
                        f"{'; '.join(diff[:4])}{'; ...' if len(diff) > 4 else ''})")
    lines: list[str] = []

    def check(bad: bool, name: str, desc: str, why: str) -> None:
        lines.append(f"REGRESSION {name}: {desc} {why}" if bad else f"{name}: {desc} ok")

    b_speed, c_speed = _get(base, "throughput.programs_per_s"), _get(cand, "throughput.programs_per_s")
    # one measure, both ways: how much slower the candidate is (base/cand - 1), or how much faster
    slowdown = b_speed / c_speed - 1 if c_speed > 0 else (0.0 if b_speed <= 0 else float("inf"))
    rel = f"{slowdown:.1%} slower" if slowdown > 0 else f"{c_speed / b_speed - 1 if b_speed > 0 else 0.0:.1%} faster"
    check(slowdown > max_slowdown + _EPS, "speed",
          f"candidate {c_speed:.3g} programs/s vs base {b_speed:.3g}: {rel}",
          f"(more than the {max_slowdown:.1%} allowed)")

    ratio = hit_ratio(cand)
    check(ratio < min_hit_ratio - _EPS, "hit rate",
          f"candidate {_get(cand, 'hit_rate'):.4f} of optimal {_get(cand, 'optimal_hit_rate'):.4f} "
          f"(ratio {ratio:.4f}, base {hit_ratio(base):.4f})",
          f"is below the {min_hit_ratio:.4f} required")

    b_acc, c_acc = _get(base, "accuracy"), _get(cand, "accuracy")
    if b_acc is None or c_acc is None:
        lines.append("accuracy: not recorded in both runs, skipped")
    else:
        drop = b_acc - c_acc
        check(drop > max_acc_drop + _EPS, "accuracy",
              f"candidate {c_acc:.4f} vs base {b_acc:.4f} ({-drop:+.4f})",
              f"dropped by more than the {max_acc_drop:.4f} allowed")
    return not any(line.startswith("REGRESSION") for line in lines), lines
