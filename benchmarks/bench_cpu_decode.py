"""CPU decode attention: the torch backend's batched decode against its loop over rows, side by side.

    python benchmarks/bench_cpu_decode.py [--prompts 2] [--samples 64] [--prefix 800] [--question 100] \
        [--new-tokens 32] [--rounds 3]

The shape of lm-eval's gsm8k_cot_self_consistency (`--limit 2`: 2 questions x 64 samples at temperature 0.2,
an 8-shot chain-of-thought prompt of ~800 tokens the questions share, then each question's own tokens), on the
embedded model (SmolLM2-135M, float32): the prompts are prefilled (untimed), then every sample decodes
`--new-tokens` tokens (`ignore_eos`); the decode steps' seconds are timed (`ModelRunner.decode`). Variants run
in alternating rounds in one process (the machine is shared: medians): `batched` (what runs now: one batched
attention a decode step, the shared prompt read once for all rows) and `loop` (the loop over rows it replaced:
`decode_rows` answering None). The samples' tokens are compared between variants (equal but for float32
rounding flipping a sampled token, counted).
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from typing import Any

import torch


def _requests(a: argparse.Namespace, vocab: int) -> list[Any]:
    from lmbatch.requests import GenerateRequest, SamplingParams

    rng = random.Random(0)
    shots = [rng.randrange(100, vocab) for _ in range(a.prefix)]
    out = []
    for p in range(a.prompts):
        prompt = shots + [rng.randrange(100, vocab) for _ in range(a.question)]
        out += [GenerateRequest(prompt, SamplingParams(max_new_tokens=a.new_tokens, temperature=0.2, seed=p * 1000 + k,
                                                       ignore_eos=True)) for k in range(a.samples)]
    return out


def _round(engine: Any, requests: list[Any], variant: str) -> tuple[float, int, list[list[int]]]:
    """(decode seconds, decode steps, tokens) of one run of the requests on a fresh cache."""
    import lmbatch.attention.torch_ref as ref

    runner = engine.model_runner
    spent = [0.0, 0]
    own = runner.decode

    def timed(rows: Any, pending: Any = None) -> Any:
        t = time.perf_counter()
        out = own(rows, pending)
        spent[0] += time.perf_counter() - t
        spent[1] += 1
        return out

    planner = ref.decode_rows
    runner.decode = timed
    if variant == "loop":
        ref.decode_rows = lambda b: None        # type: ignore[assignment]
    try:
        engine.tree.evict(engine.pool.num_slots)
        results, _ = engine.generate(requests)
    finally:
        ref.decode_rows = planner
        runner.decode = own
    return spent[0], int(spent[1]), [r.token_ids for r in results]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--prefix", type=int, default=800)
    ap.add_argument("--question", type=int, default=100)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    from lmbatch.engine import Engine
    from lmbatch.model.checkpoint import resolve_model

    engine = Engine.from_pretrained(resolve_model(None), device="cpu", dtype=torch.float32,
                                    kv_cache_tokens=a.prompts * (a.prefix + a.question) + 2 * a.prompts * a.samples
                                    * a.new_tokens + 8192, max_running=a.prompts * a.samples)
    requests = _requests(a, engine.cfg.vocab_size)
    times: dict[str, list[float]] = {"batched": [], "loop": []}
    tokens: dict[str, list[list[int]]] = {}
    steps = 0
    for _ in range(a.rounds):
        for variant in times:
            s, steps, tokens[variant] = _round(engine, requests, variant)
            times[variant].append(s)
            print(f"{variant}: decode {s:.2f} s over {steps} steps", flush=True)
    differ = sum(x != y for x, y in zip(tokens["batched"], tokens["loop"]))
    med = {k: statistics.median(v) for k, v in times.items()}
    print(json.dumps({"machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                      "rows": a.prompts * a.samples, "prompt_tokens": a.prefix + a.question, "steps": steps,
                      "decode_s": times, "median_s": med,
                      "median_step_ms": {k: 1e3 * v / steps for k, v in med.items()},
                      "speedup": med["loop"] / med["batched"], "samples_differing": differ}, indent=1))


if __name__ == "__main__":
    main()
