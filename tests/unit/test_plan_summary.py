"""`summarize` (a plan's figures from sorted prompts, in numpy) against brute force and `make_plan`.

Prompts are drawn over a tiny alphabet, from a small pool with extensions, truncations, exact
copies and the very same list again (a select's choices share their context's), so that shared
prefixes, prompts that are prefixes of others and duplicates are common.
"""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from lmbatch.scheduler.merge import merge_sorted
from lmbatch.scheduler.planner import make_plan, posthoc_figures, sorted_lcps, summarize

tokens = st.lists(st.integers(0, 2), min_size=1, max_size=6)
# ids that differ in one byte of four only (sort_key's big-endian bytes): an order or a common prefix taken
# from the bytes rather than the ids would differ here
wide_tokens = st.lists(st.sampled_from([0, 1, 255, 256, 257, 511, 65535, 65536, 65792, 2**24, 2**24 + 1, 2**31 - 1,
                                        2**32 - 1]), min_size=1, max_size=6)
# a long common run then a short tail: common prefixes across numpy's 64-position blocks
long_tokens = st.builds(lambda n, tail: [k % 2 for k in range(n)] + tail, st.integers(0, 200),
                        st.lists(st.integers(0, 2), max_size=4)).filter(bool)


@st.composite
def batches(draw, max_prompts: int = 14, long: bool = False, wide: bool = False):
    """Non-empty prompts: drawn from a pool, then copied, extended or cut (never to empty), or an earlier
    prompt's list itself."""
    seq = long_tokens if long else wide_tokens if wide else tokens
    pool = draw(st.lists(seq, min_size=1, max_size=4))
    prompts = []
    for _ in range(draw(st.integers(1, max_prompts))):
        picked = draw(st.sampled_from(pool + prompts))
        base = list(picked)
        how = draw(st.sampled_from(["copy", "same", "extend", "cut", "new"]))
        if how == "same":
            base = picked
        elif how == "extend":
            base += draw(seq)
        elif how == "cut":
            base = base[:draw(st.integers(1, len(base)))]
        elif how == "new":
            base = draw(seq)
        prompts.append(base)
    return prompts


def prefixes(prompts) -> set[tuple[int, ...]]:
    return {tuple(p[:k]) for p in prompts for k in range(1, len(p) + 1)}


def executed_requests(prompts, mergeable) -> list[int]:
    """A mergeable request whose prompt equals an earlier mergeable request's is served by it."""
    seen, out = set(), []
    for i, p in enumerate(prompts):
        if mergeable[i]:
            if tuple(p) in seen:
                continue
            seen.add(tuple(p))
        out.append(i)
    return out


def lcp(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@settings(max_examples=400, deadline=None)
@given(st.data())
def test_summary_matches_brute_force_and_plan(data):
    prompts = data.draw(st.one_of(batches(), batches(max_prompts=8, long=True)))
    n = len(prompts)
    mergeable = data.draw(st.one_of(st.none(), st.lists(st.booleans(), min_size=n, max_size=n)))
    rows = data.draw(st.one_of(st.none(), st.lists(st.integers(0, 9), min_size=n, max_size=n)))
    flags = mergeable if mergeable is not None else [False] * n
    weights = rows if rows is not None else [1] * n

    s = summarize(prompts, mergeable, rows)
    plan = make_plan(prompts, mergeable=mergeable)
    distinct = prefixes(prompts)
    executed = executed_requests(prompts, flags)

    assert s.requests == n
    assert s.unique_tokens == len(distinct) == plan.unique_tokens
    assert s.attended_keys == sum(len(p) for p in distinct)
    assert sorted(plan.order) == executed
    assert s.executed == len(executed) == len(plan.order)
    assert s.prompt_tokens == sum(len(prompts[i]) for i in executed) == plan.prompt_tokens
    assert s.logit_rows == sum(weights[i] for i in executed) == sum(weights[i] for i in plan.order)
    assert s.optimal_hit_rate == plan.optimal_hit_rate
    assert plan.summary(weights) == s          # the same figures from the plan's own tree
    # every request is served by exactly one executed request with an equal prompt
    served = sorted(m for ms in plan.members.values() for m in ms)
    assert served == list(range(n))
    for j, ms in plan.members.items():
        assert ms[0] == j and all(prompts[m] == prompts[j] for m in ms)


@settings(max_examples=300, deadline=None)
@given(st.one_of(batches(max_prompts=20), batches(max_prompts=8, long=True), batches(max_prompts=20, wide=True)))
def test_sorted_lcps_brute_force(prompts):
    order, lcps = sorted_lcps(prompts)
    assert order == sorted(range(len(prompts)), key=lambda i: (prompts[i], i))
    expect = [0] + [lcp(prompts[a], prompts[b]) for a, b in zip(order, order[1:])]
    assert lcps.tolist() == expect


@settings(max_examples=300, deadline=None)
@given(st.one_of(batches(max_prompts=20), batches(max_prompts=8, long=True)), st.data())
def test_merging_parts_sorted_on_their_own_sorts_the_whole(prompts, data):
    """Prompts dealt to parts (data-parallel workers), each sorted on its own: the merge is the whole's sorted
    order (equal prompts in any order among themselves) with its common prefixes, and the post-hoc
    optimum from it is the one from sorting everything."""
    k = data.draw(st.integers(1, 8))
    where = data.draw(st.lists(st.integers(0, k - 1), min_size=len(prompts), max_size=len(prompts)))
    parts = []
    for part in range(k):
        mine = [i for i in range(len(prompts)) if where[i] == part]
        order, lcps = sorted_lcps([prompts[i] for i in mine])
        parts.append(([mine[j] for j in order], lcps))
    order, lcps = merge_sorted(prompts, parts)
    want_order, want_lcps = sorted_lcps(prompts)
    assert sorted(order) == list(range(len(prompts)))
    assert [prompts[i] for i in order] == [prompts[i] for i in want_order]
    assert lcps.tolist() == want_lcps.tolist()
    cut = data.draw(st.integers(0, len(prompts)))      # the rest as generations of the first prompts
    generated = [(prompts[i], data.draw(st.integers(0, len(prompts[i])))) for i in range(cut, len(prompts))]
    plain = prompts[:cut]
    if plain:
        assert posthoc_figures(plain, generated, (order, lcps)) == posthoc_figures(plain, generated)


def test_sorted_lcps_of_one_list_at_several_places():
    """A list object at several places is sorted once and placed at each, among equal prompts of other
    objects by index; the common prefixes cross the comparison's slice edges (64, 192, 448)."""
    base = [i % 3 for i in range(500)]
    a, b = base[:300] + [1], base[:300] + [1]
    prompts = [a, base[:64] + [9], b, a, base[:192] + [0], a, base[:448], base[:447] + [2], b]
    order, lcps = sorted_lcps(prompts)
    assert order == sorted(range(len(prompts)), key=lambda i: (prompts[i], i))
    assert lcps.tolist() == [0] + [lcp(prompts[i], prompts[j]) for i, j in zip(order, order[1:])]


def test_sorted_lcps_long_shared_prefixes():
    """Common prefixes across the numpy blocks' edges (64 positions a block), duplicates and a
    prompt that is a prefix of the next."""
    base = [i % 3 for i in range(300)]
    prompts = [base[:64], base[:65], base[:128] + [5], base[:128] + [4], base, base, base[:63] + [7],
               base[:200], base[:1], [9] * 70]
    order, lcps = sorted_lcps(prompts)
    expect = [0] + [lcp(prompts[a], prompts[b]) for a, b in zip(order, order[1:])]
    assert lcps.tolist() == expect
    s = summarize(prompts, [True] * len(prompts))
    assert s.unique_tokens == len(prefixes(prompts)) == make_plan(prompts).unique_tokens
    assert s.executed == len(prompts) - 1   # the second `base` merges into the first


def test_an_empty_batch_plans_to_zeros():
    assert summarize([]) == (0, 0, 0, 0, 0, 0)
    assert summarize([]).optimal_hit_rate == 0.0
