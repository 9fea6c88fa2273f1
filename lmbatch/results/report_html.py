"""`lmbatch report --html FILE`: the report as one self-contained static HTML file, its plots inline SVG written
here (no script, no stylesheet or image from elsewhere, nothing fetched: it opens offline, mailed or archived)."""
from __future__ import annotations

import html
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from lmbatch.cache import atomic_write
from lmbatch.errors import UserError
from lmbatch.results.compare import Comparison, TaskDelta
from lmbatch.results.runs import Run
from lmbatch.results.table import cells, report_rows
from lmbatch.timing import MAIN_LINE

Z95 = 1.959963984540054     # error bars: mean ± Z95 standard errors, a 95% confidence interval
SERIES = ("#4269d0", "#efb118", "#ff725c", "#6cc5b0", "#3ca951", "#ff8ab7", "#a463f2", "#97bbf5", "#9c6b4e",
          "#9498a0")
PHASES = dict(zip((*MAIN_LINE, "other"), ("#9498a0", "#97bbf5", "#6cc5b0", "#3ca951", "#a463f2", "#efb118",
                                          "#4269d0", "#ff8ab7", "#dddddd")))
REGRESSION, NEUTRAL = "#d03c3c", "#8a8f98"
LABEL_W, PLOT_W, TEXT_W, BAR_H, GAP, TOP = 230, 400, 150, 13, 9, 30
WIDTH = LABEL_W + PLOT_W + TEXT_W


def esc(text: object) -> str:
    return html.escape(str(text), quote=True)


@dataclass
class Bar:
    """One bar of a horizontal bar chart, in plot units."""
    value: float | None
    err: float = 0.0                # half-width of its error bar
    back: float | None = None       # a lighter bar behind it (prompt tokens behind the computed ones)
    tick: float | None = None       # a mark across it (the optimal hit rate)
    text: str = ""                  # shown right of the plot
    tip: str = ""                   # shown on hover (an SVG <title>)


class Svg:
    """An SVG drawing, element by element; every text is escaped."""

    def __init__(self, height: float, label: str):
        self.height, self.label = height, label
        self.parts: list[str] = []

    def rect(self, box: tuple[float, float, float, float], fill: str, tip: str = "", opacity: float = 1.0) -> None:
        """A rectangle at `box` (x, y, width, height)."""
        x, y, w, h = box
        title = f"<title>{esc(tip)}</title>" if tip else ""
        self.parts.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{max(w, 0.0):.1f}" height="{h:.1f}" fill="{fill}"'
                          f'{f" fill-opacity={chr(34)}{opacity}{chr(34)}" if opacity < 1 else ""}>{title}</rect>')

    def line(self, x1: float, y1: float, x2: float, y2: float, stroke: str = "#222", width: float = 1.0) -> None:
        self.parts.append(f'<line x1="{x1:.1f}" y1="{y1:.1f}" x2="{x2:.1f}" y2="{y2:.1f}" stroke="{stroke}" '
                          f'stroke-width="{width}"/>')

    def text(self, x: float, y: float, text: str, anchor: str = "start", size: int = 11, fill: str = "#222") -> None:
        self.parts.append(f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}" '
                          f'fill="{fill}">{esc(text)}</text>')

    def legend(self, entries: Sequence[tuple[str, str]]) -> None:
        """Colored squares and their names along the top."""
        x = 4.0
        for color, name in entries:
            self.rect((x, 6, 10, 10), color)
            self.text(x + 14, 15, name)
            x += 24 + 6.5 * len(name)

    def render(self) -> str:
        return (f'<svg viewBox="0 0 {WIDTH} {self.height:.0f}" width="{WIDTH}" height="{self.height:.0f}" '
                f'role="img" aria-label="{esc(self.label)}" font-family="sans-serif">'
                f'<title>{esc(self.label)}</title>{"".join(self.parts)}</svg>')


def nice(x: float) -> float:
    """The least of 1, 2, 2.5, 5 times a power of ten that is at least x (an axis' end)."""
    if not x > 0 or not math.isfinite(x):
        return 1.0
    power = 10.0 ** math.floor(math.log10(x))
    return next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= x * (1 - 1e-12))


def _axis(svg: Svg, rows: tuple[float, float], span: tuple[float, float], fmt: Callable[[float], str],
          intervals: int = 5) -> None:
    """Gridlines from rows' top to bottom, and their values from span's lo to hi."""
    (top, bottom), (lo, hi) = rows, span
    for i in range(intervals + 1):
        v = lo + (hi - lo) * i / intervals
        x = LABEL_W + PLOT_W * (v - lo) / (hi - lo)
        svg.line(x, top, x, bottom, "#e3e3e3")
        svg.text(x, bottom + 12, fmt(v), "middle", 10, "#555")


def hbars(label: str, groups: Sequence[tuple[str, Sequence[Bar]]], series: Sequence[str], top: float,
          fmt: Callable[[float], str], notes: Sequence[tuple[str, str]] = ()) -> str:
    """A horizontal bar chart: per group (a task) a bar per series (a run), 0 to `top`."""
    top = nice(top)
    height = TOP + sum(len(bars) * BAR_H + GAP for _, bars in groups) + 20
    svg = Svg(max(height, TOP + 40), label)
    svg.legend([*((SERIES[i % len(SERIES)], s) for i, s in enumerate(series)), *notes])
    _axis(svg, (TOP - 4, height - 18), (0.0, top), fmt)
    scale = PLOT_W / top
    y = float(TOP)
    for name, bars in groups:
        svg.text(LABEL_W - 6, y + len(bars) * BAR_H / 2 + 4, name, "end")
        for i, bar in enumerate(bars):
            color = SERIES[i % len(SERIES)]
            if bar.back is not None:
                svg.rect((LABEL_W, y + 1, bar.back * scale, BAR_H - 2), color, bar.tip, 0.3)
            if bar.value is not None:
                svg.rect((LABEL_W, y + 1, bar.value * scale, BAR_H - 2), color, bar.tip)
            if bar.err and bar.value is not None:
                lo, hi = LABEL_W + (bar.value - bar.err) * scale, LABEL_W + (bar.value + bar.err) * scale
                svg.line(max(lo, LABEL_W), y + BAR_H / 2, min(hi, LABEL_W + PLOT_W), y + BAR_H / 2)
                for x in (lo, hi):
                    if LABEL_W <= x <= LABEL_W + PLOT_W:
                        svg.line(x, y + 3, x, y + BAR_H - 3)
            if bar.tick is not None:
                svg.line(LABEL_W + bar.tick * scale, y, LABEL_W + bar.tick * scale, y + BAR_H, "#000", 2)
            svg.text(LABEL_W + PLOT_W + 6, y + BAR_H - 3, bar.text, size=10)
            y += BAR_H
        y += GAP
    if not groups:
        svg.text(LABEL_W, TOP + 14, "nothing recorded")
    return svg.render()


def _categories(runs: Sequence[Run]) -> list[tuple[str, str]]:
    """Every (task, metric) a run decides on, in order of first appearance."""
    return list(dict.fromkeys((t.name, m) for r in runs for t in r.tasks.values() for m in t.decisive()))


def scores_chart(runs: Sequence[Run]) -> str:
    """Each task's decisive metrics, a bar per run, with 95% confidence intervals."""
    groups = []
    top = 1.0
    for task, metric in _categories(runs):
        bars = []
        for r in runs:
            t = r.tasks.get(task)
            v, se = (t.metrics.get(metric), t.stderr.get(metric)) if t else (None, None)
            err = Z95 * se if se is not None else 0.0
            text = "-" if v is None else f"{v:.4f}" + (f" ± {se:.4f}" if se is not None else "")
            bars.append(Bar(v, err, text=text, tip=f"{r.run_id}: {task} {metric} {text}"))
            top = max(top, v or 0.0)         # scores up to 1 on 0 to 1, their intervals cut there
        groups.append((f"{task} {metric}", bars))
    return hbars("scores per task", groups, [r.run_id for r in runs], top, lambda v: f"{v:g}")


def hit_rate_chart(runs: Sequence[Run]) -> str:
    """Achieved hit rate per task and run (bars), the optimum a black mark."""
    groups = []
    for task in dict.fromkeys(t for r in runs for t in r.tasks):
        bars = []
        for r in runs:
            t = r.tasks.get(task)
            got, best = (t.hit_rate, t.optimal_hit_rate) if t else (None, None)
            text = f"{'-' if got is None else f'{got:.4f}'} of {'-' if best is None else f'{best:.4f}'}"
            bars.append(Bar(got, tick=best, text=text, tip=f"{r.run_id}: {task} hit rate {text} optimal"))
        groups.append((task, bars))
    return hbars("achieved vs optimal hit rate per task", groups, [r.run_id for r in runs], 1.0,
                 lambda v: f"{v:g}", notes=[("#000", "| optimal")])


def _count(n: float) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:.0f}"


def tokens_chart(runs: Sequence[Run]) -> str:
    """Tokens computed (dark) of the prompt tokens (light) per task and run."""
    groups, top = [], 1.0
    for task in dict.fromkeys(t for r in runs for t in r.tasks):
        bars = []
        for r in runs:
            t = r.tasks.get(task)
            prompt, computed = (t.prompt_tokens, t.computed_tokens) if t else (None, None)
            share = f" ({computed / prompt:.1%})" if prompt and computed is not None else ""
            text = f"{_count(computed or 0)} of {_count(prompt or 0)}{share}" if prompt is not None else "-"
            bars.append(Bar(computed, back=prompt, text=text, tip=f"{r.run_id}: {task} computed {text} prompt tokens"))
            top = max(top, prompt or 0, computed or 0)
        groups.append((task, bars))
    return hbars("tokens computed of prompt tokens per task", groups, [r.run_id for r in runs], top, _count,
                 notes=[("#bbbbbb", "prompt tokens (light), computed (dark)")])


def time_chart(runs: Sequence[Run]) -> str:
    """Where each run's wall time went: its main line's phases stacked (the model's loading on its own
    thread overlaps them and is not stacked)."""
    totals = [_phases(r) for r in runs]
    top = nice(max([sum(s for _, s in p) for p in totals] + [0.0]))
    height = TOP + len(runs) * (BAR_H + GAP) + 20
    svg = Svg(height, "where the time went")
    svg.legend([(PHASES[k], k) for k in PHASES if any(k == name for p in totals for name, _ in p)])
    _axis(svg, (TOP - 4, height - 18), (0.0, top), lambda v: f"{v:g}s")
    y = float(TOP)
    for r, phases in zip(runs, totals):
        svg.text(LABEL_W - 6, y + BAR_H - 3, r.run_id, "end")
        x = float(LABEL_W)
        for name, seconds in phases:
            w = PLOT_W * seconds / top
            svg.rect((x, y, w, BAR_H), PHASES[name], f"{r.run_id}: {name} {seconds:.2f}s")
            x += w
        svg.text(LABEL_W + PLOT_W + 6, y + BAR_H - 3, f"{sum(s for _, s in phases):.2f}s", size=10)
        y += BAR_H + GAP
    return svg.render()


def _phases(run: Run) -> list[tuple[str, float]]:
    """A run's main-line phases in order, and what of its total they leave ('other')."""
    times = run.summary.time_s
    out = [(k, float(times[k])) for k in MAIN_LINE if times.get(k, 0.0) > 0]
    total = times.get("total")
    if total is not None and total > sum(s for _, s in out):
        out.append(("other", total - sum(s for _, s in out)))
    return out


def delta_chart(deltas: Sequence[TaskDelta]) -> str:
    """Candidate minus base per task, with the paired difference's 95% interval; regressions in red."""
    half = nice(max([abs(d.paired.delta) + Z95 * (d.paired.delta_stderr or 0) for d in deltas] + [0.01]))
    height = TOP + len(deltas) * (BAR_H + GAP) + 20
    svg = Svg(height, "candidate minus base per task")
    svg.legend([(REGRESSION, "regression"), (NEUTRAL, "no regression")])
    _axis(svg, (TOP - 4, height - 18), (-half, half), lambda v: f"{v:+g}" if v else "0", intervals=4)
    mid, scale = LABEL_W + PLOT_W / 2, PLOT_W / (2 * half)
    svg.line(mid, TOP - 4, mid, height - 18, "#444")
    y = float(TOP)
    for d in deltas:
        p, color = d.paired, REGRESSION if d.regression else NEUTRAL
        svg.text(LABEL_W - 6, y + BAR_H - 3, f"{d.task} {d.metric}", "end")
        svg.rect((min(mid, mid + p.delta * scale), y, abs(p.delta) * scale, BAR_H), color,
                 f"{d.task} {d.metric}: {p.delta:+.4f}, {p.test} p={p.p:.3g}")
        if p.delta_stderr:
            lo, hi = mid + (p.delta - Z95 * p.delta_stderr) * scale, mid + (p.delta + Z95 * p.delta_stderr) * scale
            svg.line(lo, y + BAR_H / 2, hi, y + BAR_H / 2)
        svg.text(LABEL_W + PLOT_W + 6, y + BAR_H - 3, f"{p.delta:+.4f} p={p.p:.3g}", size=10,
                 fill=REGRESSION if d.regression else "#222")
        y += BAR_H + GAP
    if not deltas:
        svg.text(LABEL_W, TOP + 14, "no task compared")
    return svg.render()


# Nothing wider than the window (1280 px and less): a wide table scrolls in its own box, the compare lines wrap,
# plots shrink to the page's width.
CSS = """body{font-family:sans-serif;margin:24px;color:#222;max-width:1200px}
.scroll{max-width:100%;overflow-x:auto;margin:8px 0 20px}
table{border-collapse:collapse;font-size:12px}
th,td{border:1px solid #ddd;padding:3px 6px;text-align:right;white-space:nowrap}
th{background:#f4f4f4}td.l,th.l{text-align:left}
figure{margin:10px 0 26px;max-width:100%;overflow-x:auto}figcaption{font-size:13px;color:#444;margin-bottom:4px}
svg{max-width:100%;height:auto}
pre{background:#f7f7f7;padding:8px;font-size:12px;white-space:pre-wrap;overflow-wrap:anywhere}
.bad{color:#d03c3c;font-weight:bold}"""


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], left: int = 1) -> str:
    """An HTML table; its first `left` columns aligned left (names), the others right (numbers)."""
    def row(values: Sequence[str], tag: str) -> str:
        return "<tr>" + "".join(f'<{tag}{" class=l" if i < left else ""}>{esc(v)}</{tag}>'
                                for i, v in enumerate(values)) + "</tr>"
    return '<div class="scroll"><table>' + row(header, "th") + "".join(row(r, "td") for r in rows) + "</table></div>"


def _figure(caption: str, svg: str) -> str:
    return f"<figure><figcaption>{esc(caption)}</figcaption>{svg}</figure>"


def _task_table(runs: Sequence[Run]) -> str:
    """Every metric of every task of every run, with its standard error."""
    rows = []
    for r in runs:
        for t in r.tasks.values():
            for m, v in sorted(t.metrics.items()):
                se = t.stderr.get(m)
                rows.append([r.run_id, t.name, m + (" (primary)" if m == t.primary_metric else ""),
                             "-" if v is None else f"{v:.4f}", "-" if se is None else f"{se:.4f}", str(t.n),
                             "-" if t.failed is None else str(t.failed)])
    return _table(["run", "task", "metric", "score", "stderr", "instances", "failed"], rows, 3)


def _delta_table(comparison: Comparison) -> str:
    rows = [[d.task, d.metric, "-" if d.paired.base is None else f"{d.paired.base:.4f}",
             "-" if d.paired.cand is None else f"{d.paired.cand:.4f}", f"{d.paired.delta:+.4f}", str(d.paired.n),
             f"{d.paired.worse} / {d.paired.better}", d.paired.test, f"{d.paired.p:.3g}", f"{d.p_holm:.3g}",
             f"REGRESSION: {d.why}" if d.regression else "ok"] for d in comparison.deltas]
    return _table(["task", "metric", "base", "candidate", "delta", "paired", "worse / better", "test", "p",
                   "p (Holm)", "verdict"], rows, 2)


def render_html(runs: Sequence[Run], comparison: Comparison | None = None) -> str:
    """The report page: the runs' table, per-task scores, hit rates, tokens and time as inline SVG, and with a
    comparison its checks and per-task deltas."""
    cols, shown = cells(report_rows(runs))
    parts = [f"<h1>lmbatch report: {esc(', '.join(r.run_id for r in runs))}</h1>", "<h2>Runs</h2>",
             _table(cols, shown, 3)]
    if comparison is not None:
        base, cand = runs[0].run_id, runs[1].run_id
        lines = "".join(f'<span class="bad">{esc(x)}</span>\n' if x.startswith("REGRESSION") else f"{esc(x)}\n"
                        for x in comparison.lines)
        parts += [f"<h2>Candidate {esc(cand)} against base {esc(base)}: "
                  f"{'ok' if comparison.ok else 'REGRESSION'}</h2>", f"<pre>{lines}</pre>",
                  _figure("Candidate minus base per task over the instances both scored, with the paired "
                          "difference's 95% interval; red: a regression (a significant drop, or one beyond "
                          "--max-acc-drop)", delta_chart(comparison.deltas)), _delta_table(comparison)]
    parts += ["<h2>Scores per task</h2>",
              _figure("Each task's primary metric (every metric of a task without one), a bar per run, with 95% "
                      "confidence intervals (± 1.96 standard errors of the mean)", scores_chart(runs)),
              _task_table(runs), "<h2>Prefix cache</h2>",
              _figure("Achieved hit rate per task (bars) and its optimum (black mark)", hit_rate_chart(runs)),
              _figure("Prompt tokens computed (dark) of all prompt tokens (light) per task", tokens_chart(runs)),
              "<h2>Time</h2>",
              _figure("Where each run's wall time went, phase by phase (summary.json time_s; the model's loading "
                      "on its own thread overlaps data and tokenize)", time_chart(runs))]
    return ('<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>lmbatch report</title>'
            f"<style>{CSS}</style></head><body>{''.join(parts)}</body></html>\n")


def _is_html(path: Path) -> bool:
    """Whether a file's first bytes are an HTML page's (`<!DOCTYPE html` or `<html`, after blanks and a BOM)."""
    try:
        with open(path, "rb") as f:
            start = f.read(512)
    except OSError:
        return False
    return start.lstrip(b"\xef\xbb\xbf \t\r\n").lower().startswith((b"<!doctype html", b"<html"))


def check_target(path: Path, runs: Sequence[Path]) -> None:
    """--html FILE may replace an earlier report, nothing else: not a file in a run directory it reads (a run's
    summary.json, say), nor any existing file that is not an HTML page. UserError otherwise."""
    if not path.exists():
        return
    target = path.resolve()
    for run in runs:
        folder = Path(run).resolve()
        folder = folder.parent if folder.is_file() else folder      # a run given as its summary.json
        if target.parent == folder:
            raise UserError(f"--html {path}: it is a file of run {run} (which this report reads): it would be "
                            "written over; name another file")
    if not _is_html(path):
        raise UserError(f"--html {path}: it exists and is not an HTML page: it would be written over; name "
                        "another file (or remove it)")


def write_html(path: Path, runs: Sequence[Run], comparison: Comparison | None = None) -> None:
    """The report page written to `path` atomically: a temporary file beside it, synced, renamed over it."""
    text = render_html(runs, comparison)
    try:
        atomic_write(path, text, sync=True)
    except OSError as e:
        raise UserError(f"--html {path}: cannot write it ({e.strerror or e})") from None
