"""Where one `lmbatch lm-eval` run spends its time, per phase and per thread: a sampling profiler
(every thread's stack every 5 ms, in this process) attributes each sample to the innermost frame that
names a phase. Overhead is one short Python loop per sample; nothing is patched.

    python benchmarks/profile_lm_eval.py -- --model_args pretrained=DIR --tasks mmlu_offline \
        --include_path TASKS --num_fewshot 5 [--cache_requests true] [--limit 1]

Prints a table: thread, phase, seconds (samples x interval), share of the thread's samples; and the
wall time of the command. Phases (innermost first wins):
"""
from __future__ import annotations

import collections
import sys
from pathlib import Path
from types import FrameType

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sample_stacks import StackSampler  # noqa: E402

# (code file ending, function name) -> phase; a name alone matches any file
PHASES: list[tuple[str, str, str]] = [
    ("lmbatch/lm_eval/backend.py", "loaded", "lmbatch: waits for the model"),
    ("lmbatch/lm_eval/tokens.py", "score_requests", "lmbatch: tokenize"),
    ("lmbatch/lm_eval/tokens.py", "cache_key", "lmbatch: cache key"),
    ("lmbatch/caches/workloads.py", "", "lmbatch: cache read/write"),
    ("lmbatch/lm_eval/backend.py", "loglikelihood", "lmbatch: loglikelihood (other)"),
    ("lmbatch/lm_eval/backend.py", "generate_until", "lmbatch: generate (host)"),
    ("scheduler/planner.py", "plan_requests", "lmbatch: plan"),
    ("lmbatch/engine/engine.py", "_stream", "lmbatch: execute"),
    ("lmbatch/run/loading.py", "_load", "lmbatch: model load (thread)"),
    ("lmbatch/lm_eval/backend.py", "__init__", "lmbatch: model setup"),
    ("lmbatch/lm_eval/index.py", "stored_index", "lmbatch: task index kept or built ahead"),
    ("lm_eval/api/task.py", "download", "lm-eval: datasets load"),
    ("lm_eval/api/task.py", "build_all_requests", "lm-eval: build requests"),
    ("lm_eval/api/task.py", "process_results", "lm-eval: process_results"),
    ("lm_eval/evaluator.py", "_process_results", "lm-eval: aggregate"),
    ("lm_eval/evaluator.py", "evaluate", "lm-eval: evaluate (other)"),
    ("lm_eval/tasks/__init__.py", "", "lm-eval: task index/load"),
    ("lm_eval/tasks/manager.py", "", "lm-eval: task index/load"),
    ("lm_eval/tasks/_index.py", "", "lm-eval: task index/load"),
    ("lm_eval/loggers/evaluation_tracker.py", "", "lm-eval: write results"),
    ("lm_eval/evaluator.py", "simple_evaluate", "lm-eval: simple_evaluate (other)"),
    ("<frozen importlib._bootstrap>", "_find_and_load", "imports"),
]
INTERVAL = 0.005


def _phase(frame: FrameType | None) -> str:
    while frame is not None:
        code = frame.f_code
        for path, name, phase in PHASES:
            if code.co_filename.endswith(path) and (not name or code.co_name == name):
                return phase
        frame = frame.f_back
    return "other"


def main() -> None:
    args = sys.argv[sys.argv.index("--") + 1:] if "--" in sys.argv else sys.argv[1:]
    counts: collections.Counter[tuple[str, str]] = collections.Counter()

    def sample(thread: str, frame: FrameType) -> None:
        if thread != "tqdm_monitor":
            counts[(thread, _phase(frame))] += 1

    with StackSampler(sample, INTERVAL) as sampler:
        from lmbatch.cache import keep_bytecode

        keep_bytecode()             # as the console script does, before anything is imported
        from lmbatch.lm_eval.engine import start_early
        from lmbatch.lm_eval.index import build_ahead

        build_ahead()               # as `lmbatch lm-eval` does, before lm-eval is imported
        start_early(args)
        from lmbatch.lm_eval.command import main as lm_eval_main

        lm_eval_main(args)
    wall, tick = sampler.wall, sampler.tick       # tick: seconds a sample stands for
    print(f"\nwall {wall:.1f} s ({sampler.ticks} samples, one per {tick * 1000:.1f} ms)\n")
    print(f"{'thread':<28} {'phase':<34} {'s':>7} {'of wall':>7}")
    for (thread, phase), n in sorted(counts.items(), key=lambda kv: (kv[0][0] != "MainThread", kv[0][0], -kv[1])):
        if n * tick >= 0.05:
            print(f"{thread[:28]:<28} {phase:<34} {n * tick:7.2f} {n * tick / wall:7.1%}")


if __name__ == "__main__":
    main()
