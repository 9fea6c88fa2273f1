"""Command line: `lmbatch run`, `lmbatch tasks`, `lmbatch report`."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import List, Optional, Tuple

import typer

from lmbatch.errors import UserError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Offline batch evaluation of LM programs, executed in DFS order over a radix tree.")


def _fail(e: UserError) -> None:
    typer.echo(f"error: {e}", err=True)
    raise typer.Exit(2)


@app.command()
def run(
    task: str = typer.Argument(..., help="Task name (see `lmbatch tasks`) or a program file path/to/file.py."),
    shots: int = typer.Option(0, help="Few-shot examples per prompt."),
    model: Optional[str] = typer.Option(None, help="Local HF folder or hub id; default: the embedded "
                                                   "SmolLM2-135M-Instruct."),
    limit: Optional[int] = typer.Option(None, help="First N instances (per subject for mmlu, as lm-eval's --limit)."),
    subjects: Optional[List[str]] = typer.Option(None, "--subjects", help="Only these MMLU subjects (repeatable)."),
    device: str = typer.Option("auto", help="auto (CUDA when a GPU is visible, else CPU), cpu or cuda."),
    dtype: Optional[str] = typer.Option(None, help="float32 (CPU default), bfloat16 (CUDA default) or float16."),
    max_tokens_per_batch: Optional[int] = typer.Option(
        None, help="Token budget of one forward batch (default: 4096 on CPU; on CUDA up to 16384, fitted to the "
                   "model and free memory)."),
    kv_cache_tokens: Optional[int] = typer.Option(None, help="KV pool size in tokens (default: 4 GiB on CPU; on CUDA "
                                                             "half the free memory, at most 131072 tokens)."),
    schedule: str = typer.Option("dfs", help="dfs (radix-tree order), fcfs or random: the last two for ablations."),
    no_cache: bool = typer.Option(False, "--no-cache", help="Disable prefix caching (ablation)."),
    seed: int = typer.Option(0, help="Seed for shots drawing, sampling and --schedule random."),
    out: Path = typer.Option(Path("results"), help="Parent directory of run directories."),
    run_id: Optional[str] = typer.Option(None, help="Run directory name (default: task-shots-model-time)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing run directory."),
    truncate_left: bool = typer.Option(False, "--truncate-left", help="Drop the oldest tokens of prompts longer than "
                                                                      "the model's context."),
    save_token_ids: bool = typer.Option(False, "--save-token-ids",
                                        help="Store each request's token ids in requests.parquet."),
    quiet: bool = typer.Option(False, "--quiet", help="No progress bar or closing line."),
    no_jump_forward: bool = typer.Option(False, "--no-jump-forward",
                                         help="Decode grammar-forced text token by token (ablation)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Load, tokenize and plan only; print the plan's figures "
                                 "as JSON (no weights loaded, nothing written)."),
) -> None:
    """Run a task's every instance through the engine; write results/<run_id>/."""
    from lmbatch.runner import RunOptions
    from lmbatch.runner import run as do_run

    opts = RunOptions(task=task, shots=shots, model=model, limit=limit, subjects=subjects or None, device=device,
                      dtype=dtype, max_tokens_per_batch=max_tokens_per_batch, kv_cache_tokens=kv_cache_tokens,
                      schedule=schedule, no_cache=no_cache, seed=seed, out=out, run_id=run_id, overwrite=overwrite,
                      truncate_left=truncate_left, save_token_ids=save_token_ids, quiet=quiet,
                      jump_forward=not no_jump_forward, dry_run=dry_run)
    try:
        result = do_run(opts)
    except UserError as e:
        _fail(e)
    typer.echo(json.dumps(result, indent=2) if dry_run else str(result))


@app.command()
def tasks() -> None:
    """List the built-in tasks."""
    from lmbatch.frontend.registry import get_workload, workload_names

    for name in workload_names():
        typer.echo(f"{name:10s} {get_workload(name).description}")


@app.command()
def report(
    run_dirs: Optional[List[Path]] = typer.Argument(None, help="Run directories to tabulate."),
    fmt: str = typer.Option("table", "--format", help="table, markdown or json."),
    compare: Optional[Tuple[Path, Path]] = typer.Option(None, "--compare", metavar="BASE CAND",
                                                        help="Check CAND against BASE; exit 1 on regression."),
    max_slowdown: float = typer.Option(0.05, help="Allowed slowdown of CAND: base programs/s / cand programs/s - 1."),
    min_hit_ratio: float = typer.Option(0.99, help="Least achieved/optimal hit rate for CAND."),
    max_acc_drop: float = typer.Option(0.005, help="Largest accuracy drop of CAND vs BASE."),
) -> None:
    """Tabulate runs (achieved vs optimal hit rate, accuracy, throughput), or compare two for CI."""
    from lmbatch import report as rep

    try:
        if compare:
            base, cand = (rep.load_summary(p) for p in compare)
            ok, lines = rep.compare(base, cand, max_slowdown=max_slowdown, min_hit_ratio=min_hit_ratio,
                                    max_acc_drop=max_acc_drop)
            typer.echo("\n".join(lines))
            raise typer.Exit(0 if ok else 1)
        if not run_dirs:
            raise UserError("give one or more run directories, or --compare BASE CAND")
        typer.echo(rep.render(rep.report_rows([rep.load_summary(p) for p in run_dirs]), fmt))
    except UserError as e:
        _fail(e)


def main() -> None:
    """The console script. After a command has written and flushed everything, the process ends
    without tearing down the interpreter: freeing a full run's millions of token-id objects one by
    one took ~2.5 s on a GPU host, after the results were already on disk."""
    import os

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
