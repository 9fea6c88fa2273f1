"""Which queued calls form the next wave.

Every queued select joins (it leaves nothing in the cache); so do the generation calls of programs
already under way. Programs not yet started join while the estimated cache footprint of all
started, unfinished programs stays within the wave's token budget, so that a program's KV is still
cached when its next stage comes. Generation calls go by longest cached prefix, then in radix-tree
(sorted) order ("dfs"), shuffled ("random"), or as queued ("fcfs")."""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Sequence

from lmbatch.frontend.calls import gen_ids, new_tokens
from lmbatch.frontend.dsl import Gen, Pending, Select
from lmbatch.frontend.runs import ProgramRun


@dataclass(frozen=True)
class WaveBudget:
    """What bounds a wave: the live cache footprint it may reach, and what a finished program took; `force`:
    an empty wave takes one program not started whatever the footprint (a wave must; calls that join a
    running one need not)."""
    wave_tokens: int
    max_final_footprint: int        # largest cache footprint of a finished program (0: none yet)
    force: bool = True


def pick_wave(ready: list[Pending], runs: Sequence[ProgramRun], match_lens: Callable[[list[list[int]]], list[int]],
              budget: WaveBudget, schedule: str, seed: int) -> tuple[list[Pending], list[Pending]]:
    """(the wave, the calls left queued) from prepared calls. `match_lens` gives the cached prefix
    of each of several prompts; `seed` shuffles the "random" schedule."""
    wave = [p for p in ready if isinstance(p.op, Select)]
    gens = [p for p in ready if isinstance(p.op, Gen)]
    matched = dict(zip(map(id, gens), match_lens([gen_ids(p) for p in gens])))
    if schedule == "dfs":      # longest cached prefix first, then radix-tree (sorted) order
        gens.sort(key=lambda p: (-matched[id(p)], gen_ids(p)))
    elif schedule == "random":
        random.Random(seed).shuffle(gens)
    wave += [p for p in gens if p.owner.started]
    left = _admit([p for p in gens if not p.owner.started], wave, runs, matched, budget)
    return wave, left


def _admit(fresh: list[Pending], wave: list[Pending], runs: Sequence[ProgramRun], matched: dict[int, int],
           budget: WaveBudget) -> list[Pending]:
    """Append to `wave` the calls of programs not yet started while the budget allows (at least one
    program when the wave is empty and the budget says `force`); returns the calls left out."""
    if not fresh:
        return []
    active = [r for r in runs if r.started and not r.finished]
    live = sum(r.footprint for r in active)
    grown = budget.max_final_footprint or 4 * max((r.footprint for r in active), default=0)
    admitted: set[int] = set()
    left: list[Pending] = []
    for p in fresh:
        if p.owner.index not in admitted:
            cost = max(grown, len(gen_ids(p)) - matched[id(p)] + new_tokens(p))
            if (wave or admitted or not budget.force) and live + cost > budget.wave_tokens:
                left.append(p)
                continue
            admitted.add(p.owner.index)
            live += cost
        wave.append(p)
    return left
