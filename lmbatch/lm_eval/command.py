"""`lmbatch lm-eval ARGS`: lm-eval's own command line run with `--model lmbatch` (unless another model is named),
its inputs checked first (checks.py), lm-eval patched (patches.py), then lmbatch's figures written beside
lm-eval's results (`lmbatch_*.json` in --output_path) and said in a closing line."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from lmbatch.lm_eval.backend import INSTANCES
from lmbatch.lm_eval.checks import (
    check_run,
    one_device,
)
from lmbatch.lm_eval.index import building, index_built_once
from lmbatch.lm_eval.patches import cache_templates, env_info_ahead, tasks_name_their_data


def main(args: list[str]) -> int:
    """`lmbatch lm-eval ARGS`: lm-eval's own command line with `--model lmbatch` (unless another model
    is named), then lmbatch's figures beside lm-eval's results (`lmbatch_*.json` in --output_path)
    and in a closing line. What can be checked before lm-eval starts is (`check_run`): a bad input is a
    UserError of one line, not lm-eval's traceback."""
    from lm_eval._cli import HarnessCLI
    from lm_eval.utils import setup_logging

    start = time.perf_counter()
    args = _command_line(args)
    sys.argv = ["lm-eval", *args]
    cli = HarnessCLI()
    ns = cli.parse_args()
    with index_built_once() as checked, tasks_name_their_data():
        if getattr(ns, "command", None) == "run":
            if building():      # lm-eval's index is being built elsewhere: imports the run needs meanwhile
                _import_for_run()
            if ns.model == "lmbatch":
                one_device(ns)
            if check_run(ns):
                from lmbatch.lm_eval.engine import tasks_generate

                tasks_generate()
        checked()
        setup_logging()
        cache_templates()
        with env_info_ahead(getattr(ns, "command", None) == "run"):
            cli.execute(ns)
    if not INSTANCES:
        return 0
    report = INSTANCES[-1].report()
    report["time_s"]["total"] = time.perf_counter() - start
    out = _output_dir(args)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        path = out / time.strftime("lmbatch_%Y%m%dT%H%M%S.json")
        path.write_text(json.dumps(report, indent=2) + "\n")
    kept, t = report["scores_from_cache"], report["time_s"]
    ran = "" if kept == report["requests"] else \
        (f"  hit rate {report['hit_rate']:.4f} (optimum {report['optimal_hit_rate']:.4f})  computed "
         f"{report['tokens']['computed']:,} of {report['tokens']['prompt']:,} prompt tokens")
    print(f"lmbatch: {report['requests']} requests" + (f", {kept} scores from the score cache (score_cache=false "
          f"computes them)" if kept else "") + f"{ran}  wall {t['total']:.1f}s (model load {t['load_background']:.1f} "
          f"in the background, waited {t.get('load_waited', 0.0):.1f}; execute {t.get('execute', 0.0):.1f})",
          file=sys.stderr)
    return 0


def _import_for_run() -> None:
    """What a run imports anyway (lm-eval's evaluator, tasks and its HF tokenizer classes)."""
    import lm_eval.api.task  # noqa: F401
    import lm_eval.evaluator  # noqa: F401
    from transformers import AutoTokenizer  # noqa: F401


def _command_line(args: list[str]) -> list[str]:
    """lm-eval's arguments for `lmbatch lm-eval ARGS`: its `run` unless another command is named (`ls`,
    `validate`), and for `run`, `--model lmbatch` unless another model is named."""
    command, rest = (args[0], args[1:]) if args and args[0] in ("run", "ls", "validate") else ("run", args)
    if command == "run" and not any(a in ("--model", "-M") or a.startswith("--model=") for a in rest):
        rest = ["--model", "lmbatch", *rest]
    return [command, *rest]


def _output_dir(args: list[str]) -> Path | None:
    for i, a in enumerate(args):
        value = a.split("=", 1)[1] if a.startswith("--output_path=") else (
            args[i + 1] if a in ("--output_path", "-o") and i + 1 < len(args) else None)
        if value:
            path = Path(value)
            return path.parent if path.suffix == ".json" else path
    return None
