"""Property tests for data parallelism's plan (scheduler/partition.py): every request in exactly one
part (one chunk), groups kept whole and pinned ones where they were, the duplicated tokens exactly the
shared prefixes of the boundaries, parts balanced, each part's computed tokens those of its own tree,
and chunks in sorted order with the common prefixes their worker plans from."""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmbatch.scheduler.partition import DECODE_COST, Batch, chunk_batch, partition
from lmbatch.scheduler.planner import make_plan, sorted_lcps, summarize

prompts_st = st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=12), min_size=0, max_size=40)


def brute_unique(prompts) -> int:
    """Distinct non-empty prefixes: the tree's computed tokens, counted without any tree."""
    return len({tuple(p[:k]) for p in prompts for k in range(1, len(p) + 1)})


@settings(max_examples=300, deadline=None)
@given(prompts_st, st.integers(1, 5))
def test_parts_cover_and_count(prompts, n):
    part = partition(prompts, n)
    assert len(part.parts) == n
    assert sorted(i for p in part.parts for i in p) == list(range(len(prompts)))
    assert part.unique_tokens == brute_unique(prompts)
    assert part.part_unique_tokens == [brute_unique([prompts[i] for i in p]) for p in part.parts]
    assert part.prompt_tokens == sum(map(len, prompts))
    # contiguous in sorted order: a part repeats only the prefix its first request shares with the
    # request before it in the whole batch's sorted order
    order, lcps = sorted_lcps(prompts)
    rank = {i: k for k, i in enumerate(order)}
    firsts = [min(rank[i] for i in p) for p in part.parts if p]
    for p in part.parts:
        ranks = sorted(rank[i] for i in p)
        assert ranks == list(range(ranks[0], ranks[0] + len(ranks))) if ranks else True
    assert part.duplicated_tokens == sum(int(lcps[k]) for k in firsts)
    assert part.hit_rate <= part.optimal_hit_rate + 1e-12
    if n == 1:
        assert part.duplicated_tokens == 0 and part.parts == [list(range(len(prompts)))]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=30), min_size=1, max_size=80), st.integers(2, 4))
def test_parts_balanced(prompts, n):
    """Each part's share of the tree's edges is at most an even share plus what each of its two cuts
    may trade for a shorter duplicated prefix: one request's edge (a request is not split) and one
    prompt's length."""
    part = partition(prompts, n)
    order, lcps = sorted_lcps(prompts)
    new = {i: len(prompts[i]) - int(lcps[k]) for k, i in enumerate(order)}
    total = sum(new.values())
    share = total / n
    for p in part.parts:
        assert sum(new[i] for i in p) <= share + 2 * (max(new.values()) + max(map(len, prompts))) + 1


@settings(max_examples=200, deadline=None)
@given(prompts_st, st.integers(1, 4), st.integers(1, 6), st.randoms(use_true_random=False))
def test_groups_whole_and_pinned(prompts, n, ngroups, rnd):
    groups = [rnd.randrange(ngroups) for _ in prompts]
    pinned = {g: rnd.randrange(n) for g in range(ngroups) if rnd.random() < 0.3}
    part = partition(prompts, n, groups=groups, pinned=pinned)
    where = {i: k for k, p in enumerate(part.parts) for i in p}
    assert sorted(where) == list(range(len(prompts)))
    for g in set(groups):
        assert len({where[i] for i in range(len(prompts)) if groups[i] == g}) == 1
    for g, k in pinned.items():
        assert all(where[i] == k for i in range(len(prompts)) if groups[i] == g)


@settings(max_examples=100, deadline=None)
@given(prompts_st, st.integers(1, 4), st.randoms(use_true_random=False))
def test_mergeable_counts(prompts, n, rnd):
    """Equal mergeable prompts execute once per part holding them: the parts' prompt tokens are the
    whole batch's when no two equal ones are split."""
    prompts = prompts + [list(p) for p in prompts if rnd.random() < 0.5]       # duplicates
    flags = [rnd.random() < 0.7 for _ in prompts]
    groups = [tuple(p) for p in prompts]        # equal prompts in one group: one part
    part = partition(prompts, n, groups=groups, mergeable=flags)
    whole = make_plan([list(p) for p in prompts], mergeable=flags)
    assert part.prompt_tokens == whole.prompt_tokens and part.unique_tokens == whole.unique_tokens
    parts_prompt = sum(summarize([prompts[i] for i in p], [flags[i] for i in p]).prompt_tokens for p in part.parts)
    assert parts_prompt == whole.prompt_tokens


def test_cuts_between_subtrees():
    """Two few-shot prefixes of 100 tokens with 50 questions each: two parts split at the subjects,
    duplicating nothing, rather than half-way through either."""
    rnd = random.Random(0)
    prompts = []
    for subject in (1, 2):
        head = [subject] * 100
        prompts += [head + [rnd.randrange(10, 50) for _ in range(rnd.randrange(5, 9))] for _ in range(50)]
    rnd.shuffle(prompts)
    part = partition(prompts, 2)
    assert part.duplicated_tokens == 0
    assert {tuple(sorted({prompts[i][0] for i in p})) for p in part.parts} == {(1,), (2,)}
    assert part.hit_rate == part.optimal_hit_rate


def test_many_parts_and_bad_n():
    prompts = [[1, 2, k] for k in range(3)]
    part = partition(prompts, 8)
    assert sum(1 for p in part.parts if p) == 3 and part.duplicated_tokens == 2 * 2
    with pytest.raises(ValueError):
        partition(prompts, 0)


def _chunk_checks(prompts, cut, n, groups=None, pinned=None, per_worker=1):
    """Every request in exactly one chunk, in sorted order with its true common prefixes; groups whole,
    pinned ones in their worker's pinned chunk; at most `per_worker` free chunks a worker; the optima of
    any set of chunks those of their requests' own tree."""
    order, _ = sorted_lcps(prompts)
    rank = {i: k for k, i in enumerate(order)}
    seen = [i for ch in cut.chunks for i in ch.requests]
    assert sorted(seen) == list(range(len(prompts)))
    for ch in cut.chunks:
        assert [rank[i] for i in ch.requests] == sorted(rank[i] for i in ch.requests)
        want = [0] + [next((k for k, (a, b) in enumerate(zip(prompts[x], prompts[y])) if a != b),
                           min(len(prompts[x]), len(prompts[y]))) for x, y in zip(ch.requests, ch.requests[1:])]
        assert ch.lcps == want
        assert 0 <= ch.home < n
    where = {i: c for c, ch in enumerate(cut.chunks) for i in ch.requests}
    if groups is not None:
        for g in set(groups):
            assert len({where[i] for i in range(len(prompts)) if groups[i] == g}) == 1
        for g, k in (pinned or {}).items():
            chunks = {where[i] for i in range(len(prompts)) if groups[i] == g}
            assert all(cut.chunks[c].pinned and cut.chunks[c].home == k for c in chunks)
    for k in range(n):
        assert sum(1 for ch in cut.chunks if ch.home == k and not ch.pinned) <= per_worker
    assert cut.unique_of(range(len(cut.chunks))) == cut.unique_tokens == brute_unique(prompts)
    for c, ch in enumerate(cut.chunks):
        assert cut.unique_of([c]) == brute_unique([prompts[i] for i in ch.requests])


@settings(max_examples=300, deadline=None)
@given(prompts_st, st.integers(1, 4), st.integers(1, 6), st.integers(1, 6), st.randoms(use_true_random=False))
def test_chunks_cover_in_sorted_order(prompts, n, per_worker, ngroups, rnd):
    groups = [rnd.randrange(ngroups) for _ in prompts]
    pinned = {g: rnd.randrange(n) for g in range(ngroups) if rnd.random() < 0.3}
    cut = chunk_batch(Batch(prompts, groups), n, per_worker, pinned=pinned)
    _chunk_checks(prompts, cut, n, groups, pinned, per_worker)
    pair = rnd.sample(range(len(cut.chunks)), min(2, len(cut.chunks)))
    assert cut.unique_of(pair) == brute_unique([prompts[i] for c in pair for i in cut.chunks[c].requests])


@settings(max_examples=100, deadline=None)
@given(prompts_st, st.integers(1, 4), st.integers(1, 8))
def test_chunks_from_a_plan_need_no_sort(prompts, n, per_worker):
    """Cut from a plan's own sorted order and common prefixes: the chunks of a cut that sorts again."""
    plan = make_plan([list(p) for p in prompts])
    a = chunk_batch(Batch(prompts), n, per_worker, presorted=(plan.dfs, plan.lcps))
    b = chunk_batch(Batch(prompts), n, per_worker)
    assert a.chunks == b.chunks and a.unique_tokens == b.unique_tokens == plan.unique_tokens


def test_a_share_falls_in_chunks():
    """Many equal programs: a worker's share in chunks, a small one first (the worker's start), then each
    about FALLING times the one before, the last small (what an idle worker takes at the end), and their
    costs adding up to the share."""
    rnd = random.Random(1)
    prompts = [[rnd.randrange(1000) for _ in range(20)] for _ in range(4000)]
    cut = chunk_batch(Batch(prompts), 2, 8)
    for k in range(2):
        costs = [ch.cost for ch in cut.chunks if ch.home == k]
        assert len(costs) == 8
        assert costs[0] < 0.06 * sum(costs) and abs(costs[0] - costs[-1]) < 0.3 * costs[-1]
        assert all(0.6 < b / a < 0.9 for a, b in zip(costs[1:], costs[2:])), costs
        assert costs[-1] < 0.06 * sum(costs)
    assert sum(ch.cost for ch in cut.chunks) == cut.unique_tokens


def test_generation_weighs_its_new_tokens():
    """Two groups of equal prompts, one generating 100 tokens a request: the generating requests are
    spread so that each worker's cost, new tokens counted at DECODE_COST, is about half."""
    prompts = [[1, k] for k in range(10)] + [[2, k] for k in range(10)]
    extra = [0.0] * 10 + [100 * DECODE_COST] * 10
    cut = chunk_batch(Batch(prompts, extra=extra), 2)
    costs = sorted(ch.cost for ch in cut.chunks)
    assert len(costs) == 2 and costs[1] - costs[0] <= 2 * (100 * DECODE_COST + 2)
