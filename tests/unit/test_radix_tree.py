"""Property tests for the radix prefix cache (lmbatch/engine/radix_cache.py) against a naive trie model.

The model is a dict {token prefix (tuple) -> slot id of its last token}: the set of cached prefixes
(always prefix-closed) and the KV slot of every cached position. Next to it the model keeps, per
prefix, the time of the last operation whose path covered it (for LRU checks), and the list of held
locks (sequence, node) as an executor would hold them for in-flight requests.
"""
from __future__ import annotations

import heapq

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from lmbatch.attention.kv_pool import KVPool
from lmbatch.engine.radix_cache import Node, RadixTree

POOL_SLOTS = 64
MACHINE_SLOTS = 24  # small, so that inserts regularly run the pool dry and have to evict
MAX_KEY = 8  # longest sequence, hence longest edge
seqs = st.lists(st.integers(0, 3), min_size=1, max_size=MAX_KEY).map(tuple)


def make_pool(n: int = POOL_SLOTS) -> KVPool:
    return KVPool(n, 1, 1, 1, torch.float32, "cpu")


def walk(tree: RadixTree) -> list[tuple[Node, tuple[int, ...]]]:
    """Every non-root node with the full token prefix ending at its last token; checks structure."""
    out, stack = [], [(tree.root, ())]
    assert tree.root.key == [] and len(tree.root.value) == 0 and tree.root.parent is None
    while stack:
        node, prefix = stack.pop()
        for tok, child in node.children.items():
            assert len(child.key) > 0, "non-root node with an empty key"
            assert child.key[0] == tok, f"child {child.key} stored under token {tok}"
            assert len(child.key) == len(child.value)
            assert child.value.dtype == np.int64
            assert child.parent is node
            assert child.lock_ref >= 0
            full = prefix + tuple(child.key)
            out.append((child, full))
            stack.append((child, full))
    return out


def tree_contents(tree: RadixTree) -> dict[tuple[int, ...], int]:
    """The tree flattened into the model's form: prefix -> slot."""
    content = {}
    for node, full in walk(tree):
        start = len(full) - len(node.key)
        for i, slot in enumerate(node.value.tolist()):
            p = full[: start + i + 1]
            assert p not in content
            content[p] = slot
    return content


def attached(tree: RadixTree, node: Node) -> bool:
    while node is not tree.root:
        if node.parent is None or node.parent.children.get(node.key[0]) is not node:
            return False
        node = node.parent
    return True


class RadixTreeMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.pool = make_pool(MACHINE_SLOTS)
        self.freed_log: list[np.ndarray] = []

        def free_slots(slots: np.ndarray) -> None:
            self.freed_log.append(slots.copy())
            self.pool.free(slots)

        self.tree = RadixTree(free_slots)
        self.model: dict[tuple[int, ...], int] = {}
        self.access: dict[tuple[int, ...], int] = {}
        self.clock = 0
        self.held: list[tuple[tuple[int, ...], Node]] = []  # locks we hold: (sequence, end node)

    # ---- model helpers -------------------------------------------------------------------------
    def locked_prefixes(self) -> set[tuple[int, ...]]:
        return {seq[:i] for seq, _ in self.held for i in range(1, len(seq) + 1)}

    def model_match_len(self, seq) -> int:
        m = 0
        while m < len(seq) and seq[: m + 1] in self.model:
            m += 1
        return m

    def touch(self, seq, upto: int) -> None:
        self.clock += 1
        for i in range(1, upto + 1):
            self.access[seq[:i]] = self.clock

    def checked_match(self, seq):
        slots, node = self.tree.match_prefix(list(seq))
        m = self.model_match_len(seq)
        assert len(slots) == m, f"match_prefix({seq}) matched {len(slots)}, model says {m}"
        assert slots.tolist() == [self.model[seq[: i + 1]] for i in range(m)]
        # the returned node ends exactly at the match
        if m == 0:
            assert node is self.tree.root
        else:
            assert attached(self.tree, node)
            assert tuple(node.key) == seq[m - len(node.key): m]
            path, n = [], node
            while n is not self.tree.root:
                path = n.key + path
                n = n.parent
            assert tuple(path) == seq[:m]
        self.touch(seq, m)
        return slots, node

    def replay_lru_evict(self, n: int, locked) -> set[tuple[int, ...]]:
        """Prefixes that LRU eviction of n tokens should remove. Node boundaries come from the tree
        (they depend on split history), everything else (access times, locks) from the model: a
        node's time is the access time of its deepest position, unique among candidate leaves."""
        nodes = walk(self.tree)
        deepest = {id(node): full for node, full in nodes}
        kids = {id(node): len(node.children) for node, _ in nodes}
        heap = [(self.access[full], id(node), node) for node, full in nodes
                if not node.children and full not in locked]
        heapq.heapify(heap)
        removed, freed = set(), 0
        while freed < n and heap:
            _, _, node = heapq.heappop(heap)
            full = deepest[id(node)]
            removed |= {full[:i] for i in range(len(full) - len(node.key) + 1, len(full) + 1)}
            freed += len(node.key)
            parent = node.parent
            if parent is not self.tree.root:
                kids[id(parent)] -= 1
                if kids[id(parent)] == 0 and deepest[id(parent)] not in locked:
                    heapq.heappush(heap, (self.access[deepest[id(parent)]], id(parent), parent))
        return removed

    def checked_evict(self, n: int) -> int:
        before = dict(self.model)
        ev_before = self.tree.evictable_size
        locked = self.locked_prefixes()
        maximal = [p for p in before if not any((p + (t,)) in before for t in range(4))]
        unlocked_leaves = [p for p in maximal if p not in locked]
        n_logged = len(self.freed_log)
        expected_removed = self.replay_lru_evict(n, locked)

        freed = self.tree.evict(n)

        after = tree_contents(self.tree)
        removed = set(before) - set(after)
        assert set(after) <= set(before), "evict added prefixes"
        assert all(after[p] == before[p] for p in after), "evict changed surviving slots"
        assert freed == len(removed)
        freed_slots = sorted(np.concatenate(self.freed_log[n_logged:]).tolist()) if freed else []
        assert freed_slots == sorted(before[p] for p in removed)
        # only unlocked leaves go: nothing locked removed, and what remains is still prefix-closed
        assert not (removed & locked), "evict removed a locked prefix"
        assert all(p[:-1] in after for p in after if len(p) > 1)
        # amount: at least min(n, evictable), never more than evictable, stops once n is reached
        assert freed <= ev_before
        assert freed >= min(n, ev_before)
        if n <= 0:
            assert freed == 0
        else:
            assert freed < n + MAX_KEY
        if freed < n:
            assert self.tree.evictable_size == 0
        # LRU: a removed unlocked leaf was accessed before every unlocked leaf that survived
        gone = [self.access[p] for p in unlocked_leaves if p in removed]
        kept = [self.access[p] for p in unlocked_leaves if p in after]
        if gone and kept:
            assert max(gone) < min(kept), "eviction did not follow LRU order"
        # and exactly: replaying LRU eviction on the old node boundaries, with the model's access
        # times, removes the same prefixes
        assert removed == expected_removed, "eviction removed other prefixes than LRU order says"
        # locked sequences are intact, still attached, with the same slots
        for seq, node in self.held:
            assert attached(self.tree, node)
            assert all(after[seq[:i]] == before[seq[:i]] for i in range(1, len(seq) + 1))
        self.model = after
        for p in removed:
            del self.access[p]
        return freed

    # ---- rules ---------------------------------------------------------------------------------
    @rule(seq=seqs, keep_lock=st.booleans())
    def insert(self, seq, keep_lock):
        """As an executor would: match, lock the match, evict if short, alloc the suffix, insert."""
        matched, node = self.checked_match(seq)
        m = len(matched)
        self.tree.lock(node)
        self.held.append((seq[:m], node))
        need = len(seq) - m
        if self.pool.num_free < need:
            self.checked_evict(need - self.pool.num_free)
        new = self.pool.alloc(need)
        self.held.pop()
        if new is None:  # everything else is locked: the request waits
            self.tree.unlock(node)
            return
        assert len(new) == need
        present, end = self.tree.insert(list(seq), np.concatenate([matched, new]))
        self.tree.unlock(node)
        assert present == m, f"insert reported {present} present, match said {m}"
        if need:
            assert end.key == list(seq[m:]) and not end.children
        for i, slot in enumerate(new.tolist()):
            self.model[seq[: m + i + 1]] = slot
        self.touch(seq, len(seq))
        if keep_lock:
            self.tree.lock(end)
            self.held.append((seq, end))

    @rule(seq=seqs)
    def insert_with_own_slots(self, seq):
        """A caller that computed KV for the whole sequence inserts it without matching first; the
        tree keeps its cached prefix and the caller frees its duplicate slots for that prefix."""
        if self.pool.num_free < len(seq):
            self.checked_evict(len(seq) - self.pool.num_free)
        new = self.pool.alloc(len(seq))
        if new is None:
            return
        m = self.model_match_len(seq)
        present, end = self.tree.insert(list(seq), new)
        assert present == m, f"insert reported {present} present, model has {m}"
        self.pool.free(new[:present])
        for i in range(m, len(seq)):
            self.model[seq[: i + 1]] = int(new[i])
        self.touch(seq, len(seq))
        assert attached(self.tree, end) and tuple(end.key) == seq[len(seq) - len(end.key):]

    @rule(seq=seqs)
    def match(self, seq):
        self.checked_match(seq)

    @rule(seq=seqs)
    def match_and_lock(self, seq):
        slots, node = self.checked_match(seq)
        self.tree.lock(node)
        self.held.append((seq[: len(slots)], node))

    @rule(data=st.data())
    def match_cached_and_lock(self, data):
        """Lock a prefix that is certainly cached (random sequences mostly miss deep prefixes)."""
        if not self.model:
            return
        seq = data.draw(st.sampled_from(sorted(self.model)))
        slots, node = self.checked_match(seq)
        assert len(slots) == len(seq)
        self.tree.lock(node)
        self.held.append((seq, node))

    @rule(data=st.data())
    def unlock(self, data):
        if not self.held:
            return
        i = data.draw(st.integers(0, len(self.held) - 1))
        _, node = self.held.pop(i)
        self.tree.unlock(node)

    @rule(n=st.integers(0, 12))
    def evict(self, n):
        self.checked_evict(n)

    @rule()
    def evict_all(self):
        ev = self.tree.evictable_size
        assert self.checked_evict(10 ** 6) == ev
        assert set(self.model) == self.locked_prefixes()
        assert self.tree.evictable_size == 0

    # ---- invariants ----------------------------------------------------------------------------
    @invariant()
    def tree_equals_model(self):
        assert tree_contents(self.tree) == self.model
        assert all(p[:-1] in self.model for p in self.model if len(p) > 1)

    @invariant()
    def no_slot_leaked_or_shared(self):
        in_tree = [s for node, _ in walk(self.tree) for s in node.value.tolist()]
        free = self.pool.free_slots()
        assert len(in_tree) == len(set(in_tree)), "slot used twice in the tree"
        assert sorted(in_tree + free) == list(range(MACHINE_SLOTS)), "slot leaked or double-freed"
        assert self.pool.num_free == MACHINE_SLOTS - len(in_tree)

    @invariant()
    def sizes_and_lock_refs(self):
        nodes = walk(self.tree)
        assert self.tree.total_size == sum(len(n.key) for n, _ in nodes) == len(self.model)
        assert self.tree.locked_size == sum(len(n.key) for n, _ in nodes if n.lock_ref > 0)
        assert self.tree.locked_size == len(self.locked_prefixes())
        assert self.tree.evictable_size == self.tree.total_size - self.tree.locked_size >= 0
        # each node's lock_ref counts exactly the held locks whose sequence runs through it
        for node, full in nodes:
            expect = sum(1 for seq, _ in self.held if seq[: len(full)] == full)
            assert node.lock_ref == expect, f"lock_ref {node.lock_ref} != {expect} on {full}"
        assert self.tree.root.lock_ref == 1

    @invariant()
    def held_locks_still_match(self):
        for seq, node in self.held:
            if seq:
                slots, end = self.checked_match(seq)
                assert len(slots) == len(seq) and end is node


RadixTreeMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestRadixTreeStateful = RadixTreeMachine.TestCase


# ---- plain unit tests ---------------------------------------------------------------------------
def new_tree():
    pool = make_pool()
    freed = []

    def free_slots(slots):
        freed.append(slots.tolist())
        pool.free(slots)

    return RadixTree(free_slots), pool, freed


def insert_fresh(tree, pool, tokens):
    slots, _ = tree.match_prefix(tokens)
    new = pool.alloc(len(tokens) - len(slots))
    present, node = tree.insert(tokens, np.concatenate([slots, new]))
    assert present == len(slots)
    return node


def test_split_on_partial_match():
    tree, pool, _ = new_tree()
    slots = np.array([10, 11, 12, 13])
    tree.insert([1, 2, 3, 4], slots)
    got, node = tree.match_prefix([1, 2, 9])
    assert got.tolist() == [10, 11]
    assert node.key == [1, 2] and node.value.tolist() == [10, 11]
    (child,) = node.children.values()
    assert child.key == [3, 4] and child.value.tolist() == [12, 13] and child.parent is node
    assert tree.root.children[1] is node
    assert tree.total_size == 4
    # the full sequence still matches across the split
    got, end = tree.match_prefix([1, 2, 3, 4, 5])
    assert got.tolist() == [10, 11, 12, 13] and end is child


def test_match_ending_mid_edge_splits_there():
    tree, _, _ = new_tree()
    tree.insert([0, 1, 2], np.array([5, 6, 7]))
    got, node = tree.match_prefix([0])
    assert got.tolist() == [5] and node.key == [0] and list(node.children) == [1]


def test_insert_duplicate_returns_full_length():
    tree, _, _ = new_tree()
    first = tree.insert([3, 1, 2], np.array([0, 1, 2]))
    assert first[0] == 0
    present, node = tree.insert([3, 1, 2], np.array([7, 8, 9]))
    assert present == 3 and node is first[1]
    assert tree.total_size == 3
    assert tree.match_prefix([3, 1, 2])[0].tolist() == [0, 1, 2]  # the cached slots are kept
    # a duplicate that is a strict prefix splits and still reports its full length
    present, node = tree.insert([3, 1], np.array([7, 8]))
    assert present == 2 and node.key == [3, 1] and tree.total_size == 3


def test_insert_extension_reports_shared_prefix():
    tree, _, _ = new_tree()
    tree.insert([1, 2], np.array([0, 1]))
    present, node = tree.insert([1, 2, 3], np.array([0, 1, 2]))
    assert present == 2 and node.key == [3] and tree.total_size == 3
    present, node = tree.insert([1, 3], np.array([0, 5]))
    assert present == 1 and node.key == [3] and node.value.tolist() == [5]


def test_unlock_of_unlocked_node_asserts():
    tree, pool, _ = new_tree()
    node = insert_fresh(tree, pool, [1, 2])
    with pytest.raises(AssertionError):
        tree.unlock(node)
    tree.lock(node)
    tree.unlock(node)
    with pytest.raises(AssertionError):
        tree.unlock(node)


def test_evict_with_everything_locked_frees_nothing():
    tree, pool, freed = new_tree()
    a = insert_fresh(tree, pool, [1, 2, 3])
    b = insert_fresh(tree, pool, [1, 4])
    tree.lock(a)
    tree.lock(b)
    assert tree.locked_size == tree.total_size == 4 and tree.evictable_size == 0
    assert tree.evict(100) == 0
    assert freed == [] and tree.total_size == 4
    tree.unlock(b)
    assert tree.evictable_size == 1
    assert tree.evict(100) == 1 and freed == [[3]]  # [1] is shared with locked a, stays


def test_split_preserves_lock_ref():
    tree, pool, _ = new_tree()
    node = insert_fresh(tree, pool, [1, 2, 3])
    tree.lock(node)
    tree.lock(node)
    _, upper = tree.match_prefix([1])
    assert upper is not node and node.parent is upper
    assert upper.lock_ref == 2 and node.lock_ref == 2
    assert tree.locked_size == 3
    assert tree.evict(10) == 0
    tree.unlock(node)
    tree.unlock(node)
    assert upper.lock_ref == 0 and tree.locked_size == 0
    assert tree.evict(10) == 3  # cascades through the split upper node
    assert tree.total_size == 0 and pool.num_free == POOL_SLOTS


@pytest.mark.parametrize("touch_a", [True, False])
def test_evict_lru_order(touch_a):
    tree, pool, freed = new_tree()
    insert_fresh(tree, pool, [0, 1, 2])          # A
    b_leaf = insert_fresh(tree, pool, [0, 3, 3])  # B, unique part [3, 3]
    if touch_a:
        tree.match_prefix([0, 1, 2])
    assert tree.evict(len(b_leaf.key)) == 2
    a_left = len(tree.match_prefix([0, 1, 2])[0])
    b_left = len(tree.match_prefix([0, 3, 3])[0])
    if touch_a:
        assert (a_left, b_left) == (3, 1)
    else:  # A was accessed first, so it is the LRU leaf
        assert (a_left, b_left) == (1, 3)


def test_evict_lru_sees_access_of_split_upper_node():
    """A match ending mid-edge splits it; the upper half was just accessed, so once its lower half
    is evicted it must outlive an older leaf."""
    tree, pool, freed = new_tree()
    insert_fresh(tree, pool, [0, 1, 2])   # t1
    insert_fresh(tree, pool, [3])         # t2
    tree.match_prefix([0])                # t3: splits [0,1,2] into [0] + [1,2]
    assert tree.evict(3) == 3             # [1,2] (t1) then [3] (t2); [0] (t3) stays
    assert len(tree.match_prefix([0, 1, 2])[0]) == 1
    assert len(tree.match_prefix([3])[0]) == 0


def test_insert_of_cached_sequence_refreshes_lru():
    tree, pool, _ = new_tree()
    a = pool.alloc(2)
    tree.insert([0, 1], a)                # t1
    insert_fresh(tree, pool, [2])         # t2
    present, _ = tree.insert([0, 1], pool.alloc(2))  # t3: fully cached, but counts as an access
    assert present == 2
    assert tree.evict(1) == 1             # [2] is now the LRU leaf
    assert tree.match_prefix([0, 1])[0].tolist() == a.tolist()
    assert len(tree.match_prefix([2])[0]) == 0


def test_evict_zero_and_empty():
    tree, pool, freed = new_tree()
    assert tree.evict(5) == 0
    insert_fresh(tree, pool, [1])
    assert tree.evict(0) == 0 and freed == []


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(seqs, st.booleans()), min_size=1, max_size=12))
def test_lock_unlock_roundtrip_restores_sizes(ops):
    """Locking then unlocking everything (in reverse) leaves every lock_ref at 0 and nothing locked."""
    tree, pool, _ = new_tree()
    held = []
    for seq, lock in ops:
        if pool.num_free < len(seq):
            break
        insert_fresh(tree, pool, list(seq))
        _, end = tree.match_prefix(list(seq))
        if lock:
            tree.lock(end)
            held.append(end)
    for node in reversed(held):
        tree.unlock(node)
    assert tree.locked_size == 0
    assert all(n.lock_ref == 0 for n in tree._nodes())
    total = tree.total_size
    assert tree.evict(10 ** 6) == total and tree.total_size == 0 and pool.num_free == POOL_SLOTS
