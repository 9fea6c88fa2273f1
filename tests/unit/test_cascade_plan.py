"""The shared levels of cascade decode attention, planned on the radix tree (engine/cascade.py): what the
kernel reads for a row (its levels' keys, each from the row the block names, then its own keys) is
exactly the row's keys, in order, whatever the sharing; rows share a level only where their keys are
the same slots."""
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from lmbatch.engine.cascade import MIN_KEYS, REPLAN_NEW, plan_levels, replan
from lmbatch.engine.radix_cache import RadixTree


class _Slots:
    def __init__(self):
        self.next = 0

    def take(self, n: int) -> np.ndarray:
        out = np.arange(self.next, self.next + n, dtype=np.int64)
        self.next += n
        return out


def _rows(prompts: list[list[int]], copies: list[int], own: list[int]):
    """Each prompt in the tree; row j: prompt j % len(prompts)'s slots then `own` fresh slots, as a
    decode step sees it (copies[j] rows of each prompt)."""
    tree, slots = RadixTree(lambda s: None), _Slots()
    for p in prompts:
        have, _ = tree.match_prefix(p)
        tree.insert(p, np.concatenate([have, slots.take(len(p) - len(have))]))
    ends, seqs = [], []
    for j, p in enumerate(prompts):
        for c in range(copies[j]):
            have, node = tree.match_prefix(p)
            assert len(have) == len(p)
            ends.append(node)
            seqs.append(np.concatenate([have, slots.take(own[(j + c) % len(own)])]))
    return ends, seqs


def _check(plan, ends, seqs, max_levels, shared=True):
    """Read every row as the kernels do, and compare with its keys (`shared`: every level held by 2+ rows,
    as a plan made anew; one made from the last step's may keep a level one row is left in)."""
    indptr = np.concatenate([[0], np.cumsum([len(s) for s in seqs])])
    flat = np.concatenate(seqs)
    table = plan.table(indptr)
    got: dict[int, dict[int, np.ndarray]] = {i: {} for i in range(len(seqs))}
    for b in range(plan.num_blocks):
        start, keys, level, count = table[b]
        assert keys >= MIN_KEYS
        for r in plan.rows[b, :count]:
            assert level not in got[r], "a row twice in one level"
            got[r][level] = flat[start:start + keys]
    for i, s in enumerate(seqs):
        levels = got[i]
        assert sorted(levels) == list(range(plan.levels[i])) and plan.levels[i] <= max_levels
        read = np.concatenate([levels[k] for k in range(plan.levels[i])] + [s[plan.skip[i]:]])
        assert np.array_equal(read, s), i
        assert plan.skip[i] < len(s), "a row's own keys hold at least its new token"
    for level_rows in _members(plan).values():
        assert len(level_rows) >= 2 or not shared, "a level is shared by two rows or more"


def _members(plan):
    out: dict[tuple[int, int, int], list[int]] = {}
    for b in range(plan.num_blocks):
        out.setdefault((int(plan.start[b]), int(plan.keys[b]), int(plan.level[b])), []).extend(
            plan.rows[b, :plan.count[b]].tolist())
    return out


def test_three_levels_and_a_row_alone():
    """A few-shot prefix (40 keys) under 9 rows, three middles (30) under 3 rows each, then per-row
    questions; a tenth row shares nothing: 2 levels for 9 rows, none for the tenth."""
    rng = np.random.default_rng(0)
    base = rng.integers(0, 50, 40).tolist()
    prompts = []
    for _ in range(3):
        mid = base + rng.integers(50, 100, 30).tolist()
        prompts += [mid + rng.integers(100, 150, 20 + j).tolist() for j in range(3)]
    prompts.append(rng.integers(150, 200, 25).tolist())
    ends, seqs = _rows(prompts, [1] * 10, [3])
    plan = plan_levels(ends, 8, 3, 100)
    assert plan is not None
    assert plan.skip.tolist() == [70] * 9 + [0] and plan.levels.tolist() == [2] * 9 + [0]
    _check(plan, ends, seqs, 3)
    # two samples of each prompt: a third level (each prompt's question), 2 rows each
    ends, seqs = _rows(prompts, [2] * 10, [1, 4])
    plan = plan_levels(ends, 8, 3, 100)
    assert plan.levels.tolist() == [3] * 18 + [1, 1]
    _check(plan, ends, seqs, 3)
    # blocks of 4 rows: the 18 rows under the few-shot prefix in 5 blocks, the lone prompt's 2 in one
    plan = plan_levels(ends, 4, 3, 100)
    assert sorted(plan.count[plan.level == 0].tolist()) == [2, 2, 4, 4, 4, 4]
    _check(plan, ends, seqs, 3)


def test_no_sharing_and_none_ends():
    ends, seqs = _rows([[1] * 30, [2] * 30], [1, 1], [2])
    assert plan_levels(ends, 8, 3, 100) is None
    assert plan_levels([None, None], 8, 3, 100) is None


@st.composite
def _forest(draw):
    """Prompts made by extending prefixes of earlier ones, over a small alphabet (chance sharing too)."""
    prompts: list[list[int]] = []
    for _ in range(draw(st.integers(1, 9))):
        head: list[int] = []
        if prompts and draw(st.booleans()):
            src = draw(st.sampled_from(prompts))
            head = src[:draw(st.integers(0, len(src)))]
        tail = draw(st.lists(st.integers(0, 3), min_size=1, max_size=40))
        prompts.append(head + tail)
    copies = draw(st.lists(st.integers(1, 3), min_size=len(prompts), max_size=len(prompts)))
    own = draw(st.lists(st.integers(1, 5), min_size=1, max_size=4))
    return prompts, copies, own


@settings(max_examples=150, deadline=None)
@given(_forest(), st.integers(1, 3), st.sampled_from([2, 3, 10, 64]), st.integers(1, 40))
def test_rows_read_as_planned_are_their_keys(case, max_levels, per_block, max_blocks):
    prompts, copies, own = case
    ends, seqs = _rows(prompts, copies, own)
    plan = plan_levels(ends, per_block, max_levels, max_blocks)
    if plan is None:
        return
    assert plan.num_blocks <= max_blocks
    assert (plan.count <= per_block).all() and (plan.count >= 1).all()
    _check(plan, ends, seqs, max_levels)


@st.composite
def _programs(draw):
    """Prompts as a batch of programs makes them: a few-shot prefix, questions under it, forks under each
    (lengths drawn around MIN_KEYS, so levels come and go), each prompt sampled 1-3 times."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    base = rng.integers(0, 1000, draw(st.integers(0, 3 * MIN_KEYS))).tolist()
    prompts = []
    for _ in range(draw(st.integers(1, 6))):
        mid = base + rng.integers(0, 1000, draw(st.integers(0, 2 * MIN_KEYS))).tolist()
        prompts += [mid + rng.integers(0, 1000, draw(st.integers(1, 2 * MIN_KEYS))).tolist()
                    for _ in range(draw(st.integers(1, 3)))]
    copies = draw(st.lists(st.integers(1, 3), min_size=len(prompts), max_size=len(prompts)))
    return prompts, copies, draw(st.lists(st.integers(1, 5), min_size=1, max_size=4))


@settings(max_examples=200, deadline=None)
@given(st.one_of(_forest(), _programs()), st.integers(1, 3), st.sampled_from([2, 3, 10, 64]), st.integers(1, 40),
       st.data())
def test_a_plan_made_from_the_last_steps_reads_every_row_as_its_keys(case, max_levels, per_block, max_blocks,
                                                                      data):
    """Rows leave and join between two steps: `replan` gives a row that ends where one of the last plan's
    rows did that row's levels, a new one none, and every row still reads exactly its keys; it declines
    (None) where more than REPLAN_NEW of the rows are new."""
    prompts, copies, own = case
    ends, seqs = _rows(prompts, copies, own)
    n = len(ends)
    before = data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=n, unique=True))
    last = plan_levels([ends[i] for i in before], per_block, max_levels, 10_000)
    if last is None:
        return
    # the step's rows: some of the last plan's and a few others (sometimes more than REPLAN_NEW), in any order
    kept = data.draw(st.lists(st.sampled_from(before), min_size=1, max_size=len(before), unique=True))
    others = [i for i in range(n) if i not in before]
    joined = data.draw(st.lists(st.sampled_from(others), max_size=len(kept) // 6 + 1, unique=True)) if others else []
    now = data.draw(st.permutations(kept + joined))
    step_ends, step_seqs = [ends[i] for i in now], [seqs[i] for i in now]
    plan = replan(step_ends, last, per_block, max_blocks)
    known = {id(ends[i]): k for k, i in enumerate(before)}
    new = sum(id(e) not in known for e in step_ends)
    if plan is None:
        assert new > REPLAN_NEW * len(now) or not any(last.levels[known[id(e)]] for e in step_ends
                                                       if id(e) in known) or max_blocks < 3 * len(now)
        return
    assert new <= REPLAN_NEW * len(now) and plan.num_blocks <= max_blocks
    assert (plan.count <= per_block).all() and (plan.count >= 1).all()
    for k, e in enumerate(step_ends):
        j = known.get(id(e))
        assert (plan.skip[k], plan.levels[k]) == ((last.skip[j], last.levels[j]) if j is not None else (0, 0))
    _check(plan, step_ends, step_seqs, max_levels, shared=False)
