"""Data parallelism's chunks as they cross to a worker and as workers take them (engine/worker.py,
engine/parallel.py), without processes: a chunk's message rebuilds its requests exactly and plans them
as sorting would; the dispatch runs every chunk once, a pinned one on its worker, and leaves no worker
idle while a chunk it may take waits."""
from __future__ import annotations

import heapq
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from lmbatch.engine.dispatch import AHEAD, Dispatch
from lmbatch.engine.worker import _Prepare, chunk_message
from lmbatch.requests import GenerateRequest, SamplingParams, ScoreRequest
from lmbatch.scheduler.partition import Batch, Chunk, chunk_batch
from lmbatch.scheduler.planner import plan_requests

tokens = st.lists(st.integers(0, 4), min_size=0, max_size=10)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(tokens, tokens, st.booleans()), min_size=1, max_size=40), st.integers(1, 3),
       st.integers(1, 5), st.randoms(use_true_random=False))
def test_a_chunk_crosses_whole_and_plans_as_sorting_would(specs, n, per_worker, rnd):
    requests = []
    for context, rest, generates in specs:
        if generates:
            requests.append(GenerateRequest(context + rest + [9], SamplingParams(max_new_tokens=rnd.randrange(1, 9),
                                                                                 seed=rnd.randrange(5))))
        else:       # choices after one context: equal prompts (merged) and prompts that extend others
            requests.append(ScoreRequest(context + [7], rest + [rnd.randrange(3)]))
    cut = chunk_batch(Batch([r.prompt for r in requests]), n, per_worker)
    prepare = _Prepare(engine=None)      # type: ignore[arg-type]  no grammar: no engine needed
    for c, ch in enumerate(cut.chunks):
        msg = chunk_message(requests, ch, c, "dfs", 3)
        job = prepare(msg)
        assert job.chunk == c and job.seed == 3
        assert job.requests == [requests[i] for i in ch.requests]
        # the edges cross, not every prompt whole
        assert sum(map(len, msg.tails)) <= sum(len(requests[i].prompt) for i in ch.requests) + len(ch.requests)
        want = plan_requests(job.requests)
        assert (job.plan.order, job.plan.members) == (want.order, want.members)
        assert (job.plan.unique_tokens, job.plan.prompt_tokens) == (want.unique_tokens, want.prompt_tokens)


def _simulate(chunks: list[Chunk], n: int, speed: list[float]) -> tuple[dict[int, int], list[float]]:
    """Workers running what the dispatch gives them, each chunk taking cost / speed: where each chunk
    ran, and when each worker ended. Checks, as each worker runs out, that no chunk it may take waits."""
    d = Dispatch(chunks, n)
    held = [list(cs) for cs in d.start()]
    ran: dict[int, int] = {}
    events = [(chunks[held[k][0]].cost / speed[k], k) for k in range(n) if held[k]]
    heapq.heapify(events)
    end = [0.0] * n
    while events:
        t, k = heapq.heappop(events)
        c = held[k].pop(0)
        assert c not in ran
        ran[c] = k
        d.done(k, c)
        held[k] += d.take(k)
        assert len(held[k]) <= AHEAD
        if held[k]:
            heapq.heappush(events, (t + chunks[held[k][0]].cost / speed[k], k))
        else:
            end[k] = t
            waiting = [c for q in d.queues for c in q if not chunks[c].pinned or chunks[c].home == k]
            assert not waiting, (k, waiting)
    return ran, end


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 5), st.lists(st.tuples(st.integers(1, 100), st.integers(0, 4), st.booleans()), max_size=40),
       st.lists(st.floats(0.2, 5.0), min_size=5, max_size=5))
def test_every_chunk_runs_once_and_pinned_ones_at_home(n, specs, speed):
    pinned = sorted(((home % n, cost) for cost, home, pin in specs if pin), key=lambda x: x[0])
    chunks = [Chunk([], [], float(cost), home, True) for home, cost in pinned] + \
        [Chunk([], [], float(cost), home % n, False) for cost, home, pin in specs if not pin]
    ran, end = _simulate(chunks, n, speed[:n])
    assert sorted(ran) == list(range(len(chunks)))
    assert all(ran[c] == ch.home for c, ch in enumerate(chunks) if ch.pinned)


def test_idle_workers_take_the_last_chunks():
    """One worker twice as fast as the other, each given half of 16 equal chunks: the fast one ends its
    own and takes from the other's end, and they end within one chunk of each other."""
    chunks = [Chunk([], [], 10.0, k // 8, False) for k in range(16)]
    ran, end = _simulate(chunks, 2, [2.0, 1.0])
    taken = [c for c, k in ran.items() if k != chunks[c].home]
    assert taken and all(ran[c] == 0 and c >= 8 for c in taken)
    assert abs(end[0] - end[1]) <= 10.0
    assert sorted(taken, reverse=True) == [15 - j for j in range(len(taken))]     # from the end, back


def test_no_chunk_is_taken_before_every_worker_has_its_own():
    """A worker with nothing of its own waits rather than taking another's only chunk at the start."""
    chunks = [Chunk([], [], 5.0, 1, False)]
    d = Dispatch(chunks, 2)
    assert d.start() == [[], [0]]
    rnd = random.Random(0)
    chunks = [Chunk([], [], float(rnd.randrange(1, 9)), k % 3, False) for k in range(9)]
    first = Dispatch(chunks, 3).start()
    assert all(chunks[c].home == k for k, cs in enumerate(first) for c in cs)
