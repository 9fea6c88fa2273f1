"""Sorted orders of parts of a set of sequences merged into the whole's (`merge_sorted`): the post-hoc
optimum of a run whose data-parallel workers each sorted the prompts they executed (lmbatch/frontend/tally.py)
takes the merge instead of sorting every prompt again.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from lmbatch.scheduler.planner import common_prefix


def merge_sorted(seqs: Sequence[Sequence[int]], parts: Sequence[tuple[Sequence[int], np.ndarray]]
                 ) -> tuple[list[int], np.ndarray]:
    """`sorted_lcps(seqs)` from the sorted orders of parts of them (each part: indices into `seqs` in sorted
    order, and each one's common prefix with the one before it in the part, as `sorted_lcps` gives them;
    together every index once): a merge of the parts' heads that knows each head's common prefix with the
    last one taken (data-parallel workers' executed prompts, each worker's sorted already). A head sharing
    more with it comes first, so tokens are compared only past equal common prefixes: sequences of one long
    shared head cost no compare of it. Equal sequences of several parts come in the parts' order."""
    order: list[int] = []
    lcps = np.zeros(len(seqs), dtype=np.int64)
    pos = [0] * len(parts)
    shared = [0] * len(parts)       # each head's common prefix with the last one taken (0 before the first)
    live = [k for k, (part, _) in enumerate(parts) if len(part)]
    while live:
        best = live[0]
        top = seqs[parts[best][0][pos[best]]]
        for k in live[1:]:
            if shared[k] != shared[best]:
                if shared[k] > shared[best]:        # it follows the last one taken further: it is the smaller
                    best, top = k, seqs[parts[k][0][pos[k]]]
                continue
            head = seqs[parts[k][0][pos[k]]]
            m = common_prefix(top, head, start=shared[k])
            if m < len(top) and (m == len(head) or head[m] < top[m]):
                best, top = k, head
        lcps[len(order)] = shared[best]
        for k in live:
            if k != best:
                head = seqs[parts[k][0][pos[k]]]
                shared[k] = common_prefix(top, head, start=shared[k]) if shared[k] == shared[best] \
                    else min(shared[k], shared[best])
        order.append(parts[best][0][pos[best]])
        pos[best] += 1
        if pos[best] < len(parts[best][0]):
            shared[best] = int(parts[best][1][pos[best]])
        else:
            live.remove(best)
    return order, lcps
