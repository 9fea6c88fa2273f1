"""Token-mask fill cost on this host: one by one vs xgrammar's batched (thread-pool) fill, for the
json workload's schema at states along real outputs, per tokenizer; and lmbatch's `fill_masks`
(xgrammar's fill and the UTF-8 part) in the engine's chunks of `AHEAD_ROWS` rows.

    python benchmarks/bench_masks.py                        # the embedded model's tokenizer
    python benchmarks/bench_masks.py --tokenizer .gpu/tok   # e.g. Llama 3.1's (128k vocabulary)
"""
from __future__ import annotations

import argparse
import time

from transformers import AutoTokenizer

PREFIXES = ['{"name":"Os', '{"name":"Oslo","country":"Nor', '{"name":"Oslo","country":"Norway","population":12',
            '{"name":"Oslo","country":"Norway","population":1,"founded":"10',
            '{"name":"Oslo","country":"Norway","population":1,"founded":"10","landmarks":["Op', '{"name":"']


def main() -> None:
    import xgrammar as xgr

    from lmbatch.engine.sampler import AHEAD_ROWS
    from lmbatch.grammar import GrammarCompiler, allocate_bitmask, fill_masks
    from lmbatch.model.embedded import embedded_model_dir
    from lmbatch.programs.json_cities import SCHEMA

    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer")
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    tok = AutoTokenizer.from_pretrained(args.tokenizer or str(embedded_model_dir()))
    gc = GrammarCompiler(tok, vocab_size=len(tok))
    matchers, constraints = [], []
    for k in range(256):
        c = gc.constraint(json_schema=SCHEMA)
        for t in tok.encode(PREFIXES[k % len(PREFIXES)], add_special_tokens=False):
            assert c.accept(t)
        matchers.append(c.matcher)
        constraints.append(c)
    bitmask = allocate_bitmask(256, gc.vocab_size)
    batch = xgr.BatchGrammarMatcher()
    for n in (4, 16, 32, 64, 256):
        ms = matchers[:n]
        best_seq = best_batch = best_ours = float("inf")
        for _ in range(args.repeat):
            t = time.perf_counter()
            for row, m in enumerate(ms):
                m.fill_next_token_bitmask(bitmask, row)
            best_seq = min(best_seq, time.perf_counter() - t)
            t = time.perf_counter()
            batch.batch_fill_next_token_bitmask(ms, bitmask)
            best_batch = min(best_batch, time.perf_counter() - t)
            t = time.perf_counter()
            for lo in range(0, n, AHEAD_ROWS):
                rows = list(range(lo, min(lo + AHEAD_ROWS, n)))
                fill_masks(constraints[lo:lo + len(rows)], bitmask, rows)
            best_ours = min(best_ours, time.perf_counter() - t)
        print(f"vocab {gc.vocab_size}, {n} rows: one by one {1e6 * best_seq:.0f} us "
              f"({1e6 * best_seq / n:.1f} per row), "
              f"batched {1e6 * best_batch:.0f} us, fill_masks by {AHEAD_ROWS} {1e6 * best_ours:.0f} us "
              f"({1e6 * best_ours / n:.1f} per row)")


if __name__ == "__main__":
    main()
