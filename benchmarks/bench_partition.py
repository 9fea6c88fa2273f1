"""Data parallelism at scale, simulated on the host (no model): how long cutting a batch's radix tree
into N parts takes and how much memory it needs, how balanced the parts are (the slowest worker
sets the wall time: its computed tokens over the mean), how many tokens the cut duplicates, and what
merging every worker's results back into request order costs (`dispatch.Gather`).

Workload: `--programs` MMLU-like programs, `--subjects` few-shot heads of `--head` tokens each, a
question of 30 to 90 tokens after its head, four one-token choices (four score requests with one
prompt: merged, as in MMLU); token ids drawn from a 50k vocabulary.

    python benchmarks/bench_partition.py --programs 1000000 --workers 2,8,100
"""
from __future__ import annotations

import argparse
import gc
import random
import resource
import time
import tracemalloc

from lmbatch.engine.dispatch import Gather
from lmbatch.engine.parallel import CHUNKS
from lmbatch.engine.worker import Part
from lmbatch.requests import ScoreRequest, ScoreResult, TokenCounts
from lmbatch.scheduler.partition import Batch, chunk_batch, partition


def workload(programs: int, subjects: int, head: int, seed: int = 0):
    rng = random.Random(seed)
    heads = [[rng.randrange(50_000) for _ in range(head)] for _ in range(subjects)]
    prompts, groups = [], []
    for p in range(programs):
        q = heads[p % subjects] + [rng.randrange(50_000) for _ in range(rng.randint(30, 90))]
        for _ in range(4):          # the choices' prompts are the context: equal, merged when executed
            prompts.append(q)
            groups.append(p)
    return prompts, groups


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--programs", type=int, default=100_000)
    ap.add_argument("--subjects", type=int, default=1000)
    ap.add_argument("--head", type=int, default=500)
    ap.add_argument("--workers", default="2,8,100")
    args = ap.parse_args()
    t = time.perf_counter()
    prompts, groups = workload(args.programs, args.subjects, args.head)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{args.programs:,} programs, {len(prompts):,} requests, {sum(map(len, prompts)) // 4:,} prompt tokens "
          f"executed; built in {time.perf_counter() - t:.1f} s, process peak {rss0:.0f} MiB")
    flags = [True] * len(prompts)
    print("| workers | cut (s) | cut's peak memory (MiB) | slowest / mean part | duplicated tokens | "
          "hit rate / one device | merge (s) |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for n in map(int, args.workers.split(",")):
        gc.collect()
        t = time.perf_counter()
        part = partition(prompts, n, groups=groups, mergeable=flags)
        cut = time.perf_counter() - t
        tracemalloc.start()         # again, for its memory (tracing slows it down)
        partition(prompts, n, groups=groups, mergeable=flags)
        peak = tracemalloc.get_traced_memory()[1] / 2**20
        tracemalloc.stop()
        per = [u for u, p in zip(part.part_unique_tokens, part.parts) if p]
        slow = max(per) / (sum(per) / n)
        # merge: each chunk's results reported (here: in one message each, as a chunk's end does)
        requests = [ScoreRequest(prompts[i], [1]) for i in range(len(prompts))]
        chunks = chunk_batch(Batch(prompts, groups, flags), n, CHUNKS)
        gather = Gather(requests, chunks, None, n)
        t = time.perf_counter()
        for c, ch in enumerate(chunks.chunks):
            gather.part(Part(c, [(i, ScoreResult()) for i in range(len(ch.requests))], {}, TokenCounts()))
        merge = time.perf_counter() - t
        print(f"| {n} | {cut:.2f} | {peak:.0f} | {slow:.3f} | {part.duplicated_tokens:,} | "
              f"{part.hit_rate:.5f} / {part.optimal_hit_rate:.5f} | {merge:.2f} |", flush=True)


if __name__ == "__main__":
    main()
