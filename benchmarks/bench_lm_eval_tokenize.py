"""lm-eval's loglikelihood requests to token ids, as `lmbatch lm-eval` makes them (`PairTokenizer.score_requests`):
from each text's end, each distinct segment once (where the tokenizer's cut rule holds), against the whole
texts encoded in batches; alternating, with the ids of both compared for every pair.

    python benchmarks/bench_lm_eval_tokenize.py [--tasks mmlu_offline] [--shots 5] [--model DIR] [--rounds 2]

The pairs are lm-eval's own (`build_all_requests` of the offline tasks `lmbatch lm-eval-tasks` writes), built
once and kept in --pairs (building all of MMLU's takes minutes on a small CPU); the model's tokenizer
(default: the embedded model's) is loaded by transformers, as lm-eval's HF backend loads it.
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import tempfile
import time
from pathlib import Path


def lm_eval_pairs(tasks: list[str], shots: int) -> list[tuple[str, str]]:
    """Every loglikelihood request's (context, continuation) of the tasks, as lm-eval builds them."""
    from lm_eval.tasks import TaskManager, get_task_dict

    from lmbatch.lm_eval.offline import write_offline_tasks
    from lmbatch.lm_eval.patches import cache_templates

    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    cache_templates()       # as `lmbatch lm-eval` builds them (the same prompts, each template compiled once)
    pairs: list[tuple[str, str]] = []

    def walk(node: dict) -> None:
        for value in node.values():
            if isinstance(value, dict):
                walk(value)
            elif hasattr(value, "build_all_requests"):
                value.set_config(key="num_fewshot", value=shots)
                value.build_all_requests(limit=None, rank=0, world_size=1)
                pairs.extend(tuple(i.args) for i in value.instances if i.request_type == "loglikelihood")

    with tempfile.TemporaryDirectory(prefix="lm-eval-tasks-") as folder:
        write_offline_tasks(Path(folder))
        walk(get_task_dict(tasks, TaskManager(include_path=folder)))
    return pairs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", default="mmlu_offline")
    ap.add_argument("--shots", type=int, default=5)
    ap.add_argument("--model", help="a model folder (default: the embedded model)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--pairs", default="/tmp/lm-eval-pairs.pkl", help="where the built pairs are kept")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from lmbatch.lm_eval.tokens import PairTokenizer
    from lmbatch.model.embedded import embedded_model_dir

    kept = Path(args.pairs)
    key = (args.tasks, args.shots)
    stored = pickle.loads(kept.read_bytes()) if kept.is_file() else None
    if stored is None or stored[0] != key:
        t = time.perf_counter()
        stored = (key, lm_eval_pairs(args.tasks.split(","), args.shots))
        kept.write_bytes(pickle.dumps(stored))
        print(f"built {len(stored[1])} pairs in {time.perf_counter() - t:.1f} s", flush=True)
    pairs = stored[1]
    tokenizer = AutoTokenizer.from_pretrained(args.model or str(embedded_model_dir()))
    seconds: dict[str, list[float]] = {"segments": [], "whole texts": []}
    ids: dict[str, list] = {}
    for k in range(args.rounds):
        for mode in (list(seconds) if k % 2 == 0 else list(seconds)[::-1]):
            tokens = PairTokenizer(tokenizer, None, None, 1 << 20)
            if mode == "whole texts":
                tokens._by_segments = lambda: None   # type: ignore[method-assign]
            elif tokens._by_segments() is None:
                raise SystemExit("this tokenizer's cut rule does not hold: both modes encode whole texts")
            t = time.perf_counter()
            ids[mode] = tokens.score_requests(pairs)
            seconds[mode].append(time.perf_counter() - t)
            print(f"round {k} {mode}: {seconds[mode][-1]:.2f} s", flush=True)
    same = ids["segments"] == ids["whole texts"]
    print(json.dumps({"tasks": args.tasks, "pairs": len(pairs), "same_ids": same, "cpus": os.cpu_count(),
                      "median_s": {m: round(statistics.median(v), 2) for m, v in seconds.items()}}))
    if not same:
        raise SystemExit("the two modes gave different ids")


if __name__ == "__main__":
    main()
