"""The run's post-hoc optimum at the end of a data-parallel run whose workers ran programs whole
(lmbatch/run/spread.py): the command's tally absorbs the workers' and finishes, either sorting every executed
prompt and generation again or merging the workers' own sorted orders (`Tally.absorb` keeps them). A
tree-of-thought-shaped tally: 1,319 programs of 7 stages, two 60-token generations a stage after a shared
800-token head, dealt to 4 workers; random token ids.

    python benchmarks/bench_posthoc_merge.py        # prints each way's seconds and both optima (equal)
"""
from __future__ import annotations

import pickle
import random
import time

from lmbatch.frontend.tally import Tally


def worker_tallies(programs: int = 1319, workers: int = 4, seed: int = 0) -> list[Tally]:
    rng = random.Random(seed)
    head = [rng.randrange(1000, 50000) for _ in range(800)]
    tallies = [Tally() for _ in range(workers)]
    for q in range(programs):
        t = tallies[q * workers // programs]
        base = head + [rng.randrange(1000, 50000) for _ in range(100)]
        for _ in range(7):
            outs = []
            for _ in range(2):
                out = [rng.randrange(1000, 50000) for _ in range(60)]
                t._prompts.append(list(base))
                t._prompt_tasks.append("tot")
                t._generated.append((base + out, len(base)))
                t._generated_tasks.append("tot")
                outs.append(out)
            base = base + outs[0]
    for t in tallies:
        t.stats.prompt_tokens = sum(map(len, t._prompts))
        t.tasks["tot"] = t.stats
        t.batches = 2
        t.finish()          # on its worker
    return [pickle.loads(pickle.dumps(t)) for t in tallies]       # as they arrive


def main() -> None:
    tallies = worker_tallies()
    for way in ("sorted again", "merged"):
        total = Tally()
        for t in tallies:
            t = pickle.loads(pickle.dumps(t))
            if way == "sorted again":
                t.sorted = None
            total.absorb(t)
        t0 = time.perf_counter()
        total.finish()
        print(f"{way}: {time.perf_counter() - t0:.2f} s, unique {total.stats.unique_tokens}, "
              f"prompt tree optimum {total.prompt_tree_optimal_hit_rate:.6f}")


if __name__ == "__main__":
    main()
