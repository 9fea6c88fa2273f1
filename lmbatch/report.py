"""Read run directories (docs/outputs.md), tabulate them and compare two runs for regressions."""

from __future__ import annotations

import json
from pathlib import Path, PurePosixPath
from typing import Any, Iterable

from lmbatch.errors import UserError

FORMATS = ("table", "markdown", "json")
COLUMNS = ("run_id", "task", "model", "device", "instances", "accuracy", "hit_rate",
           "optimal_hit_rate", "hit_ratio", "execute_s", "programs_per_s",
           "prompt_tokens_per_s", "computed_tokens_per_s")
# Decimals shown per float column in the table and markdown formats.
DECIMALS = {"accuracy": 4, "hit_rate": 4, "optimal_hit_rate": 4, "hit_ratio": 4, "execute_s": 2,
            "programs_per_s": 1, "prompt_tokens_per_s": 1, "computed_tokens_per_s": 1}
_EPS = 1e-9  # thresholds are inclusive: a value exactly at a limit (up to float noise) passes


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
    _check_files(Path(run_dir), data.get("files"))
    return data


def _check_files(run_dir: Path, files: Any) -> None:
    """The run's Parquet files are those its summary recorded (size and SHA-256): not truncated, not
    another run's. Summaries written before lmbatch recorded them have no "files"."""
    from lmbatch.outputs import file_record

    if not isinstance(files, dict):
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


def _get(summary: dict, dotted: str) -> Any:
    """summary['a']['b'] for 'a.b'; UserError naming the run and field when missing."""
    value: Any = summary
    for key in dotted.split("."):
        if not isinstance(value, dict) or key not in value:
            raise UserError(f"summary of run {summary.get('run_id', '?')} lacks field '{dotted}'")
        value = value[key]
    return value


def hit_ratio(summary: dict) -> float:
    """Achieved / optimal prefix-cache hit rate; 1.0 when the optimum is 0."""
    achieved, optimal = _get(summary, "hit_rate"), _get(summary, "optimal_hit_rate")
    return 1.0 if not optimal else achieved / optimal


def report_rows(summaries: Iterable[dict]) -> list[dict]:
    """One flat row (keys = COLUMNS) per run summary."""
    rows = []
    for s in summaries:
        rows.append({
            "run_id": _get(s, "run_id"),
            "task": _get(s, "task"),
            "model": PurePosixPath(str(_get(s, "model")).replace("\\", "/")).name,
            "device": _get(s, "device"),
            "instances": _get(s, "counts.instances"),
            "accuracy": _get(s, "accuracy"),
            "hit_rate": _get(s, "hit_rate"),
            "optimal_hit_rate": _get(s, "optimal_hit_rate"),
            "hit_ratio": hit_ratio(s),
            "execute_s": _get(s, "time_s.execute"),
            "programs_per_s": _get(s, "throughput.programs_per_s"),
            "prompt_tokens_per_s": _get(s, "throughput.prompt_tokens_per_s"),
            "computed_tokens_per_s": _get(s, "throughput.computed_tokens_per_s"),
        })
    return rows


def _cell(column: str, value: Any) -> str:
    """A value as displayed in table/markdown ('-' for None)."""
    if value is None:
        return "-"
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
    cells = [[_cell(c, r.get(c)) for c in COLUMNS] for r in rows]
    numeric = [c in DECIMALS or c == "instances" for c in COLUMNS]
    if fmt == "markdown":
        lines = ["| " + " | ".join(COLUMNS) + " |",
                 "|" + "|".join("---:" if n else "---" for n in numeric) + "|"]
        lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in cells]
        return "\n".join(lines)
    widths = [max(len(h), *(len(row[i]) for row in cells)) for i, h in enumerate(COLUMNS)]

    def line(values: list[str] | tuple[str, ...]) -> str:
        return "  ".join(v.rjust(w) if n else v.ljust(w)
                         for v, w, n in zip(values, widths, numeric)).rstrip()

    return "\n".join([line(COLUMNS), line(["-" * w for w in widths])] + [line(r) for r in cells])


def compare(base: dict, cand: dict, max_slowdown: float = 0.05, min_hit_ratio: float = 0.99,
            max_acc_drop: float = 0.005) -> tuple[bool, list[str]]:
    """Check candidate against base for speed, cache-hit and accuracy regressions: (ok, lines).

    Limits are inclusive (exactly at a threshold passes). UserError if the runs are not comparable.
    """
    b_task, c_task = _get(base, "task"), _get(cand, "task")
    b_n, c_n = _get(base, "counts.instances"), _get(cand, "counts.instances")
    if b_task != c_task or b_n != c_n:
        raise UserError(f"cannot compare: base ran {b_task} on {b_n} instances, "
                        f"candidate ran {c_task} on {c_n}")
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
