"""The decode graphs' slot arena (engine/slot_arena.py): over any run of steps, in which rows join, stay,
leave and come back, step by step each row's keys gathered from the arena are exactly the first
position + 1 slots of its array, padding rows read the scratch slot, and an array is sent only in the
first step that passes it since the arena was last placed anew."""
import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmbatch.engine.slot_arena import SlotArena, gather, row_deltas

SCRATCH = 99_999


def _step(arena: SlotArena, seqs: list[np.ndarray], lens: list[int], pad: int) -> tuple[torch.Tensor, int]:
    """What DecodeGraphs._replay does with the arena: the flat index of a step (rows, then `pad` padding
    rows of one key) and the slots sent."""
    placed = arena.place(seqs)
    fresh = np.concatenate(placed.fresh) if placed.fresh else np.empty(0, dtype=np.int64)
    arena.write(placed, torch.from_numpy(fresh))
    every = np.array(lens + [1] * pad, dtype=np.int64)
    indptr = np.concatenate([[0], np.cumsum(every)])
    total = int(indptr[-1])
    out = torch.full((total + 3,), -1, dtype=torch.int32)
    iota = torch.arange(total + 3, dtype=torch.int64)
    gather(arena.buffer, torch.from_numpy(row_deltas(placed.offsets, indptr)), torch.from_numpy(every), total,
           iota, out)
    assert out[total:].eq(-1).all(), "the gather wrote past its rows"
    return out[:total], len(fresh)


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_each_row_reads_its_own_slots_step_after_step(data):
    arrays: list[np.ndarray] = []
    base = 0
    live: list[int] = []
    arena = SlotArena(SCRATCH, "cpu")
    for _ in range(data.draw(st.integers(1, 12))):
        # rows leave, new ones join (a new array), and some that left come back (their old array)
        live = [i for i in live if data.draw(st.booleans())]
        for _ in range(data.draw(st.integers(0, 4))):
            n = data.draw(st.integers(1, 40))
            arrays.append(np.arange(base, base + n, dtype=np.int64) * 3 % 1000)
            base += n
            live.append(len(arrays) - 1)
        gone = [i for i in range(len(arrays)) if i not in live]
        if gone and data.draw(st.booleans()):
            live.append(data.draw(st.sampled_from(gone)))
        if not live:
            continue
        # a row may run several tokens of its sequence (jump-forward): several entries of one array
        rows = [i for i in live for _ in range(data.draw(st.integers(1, 2)))]
        lens = [data.draw(st.integers(1, len(arrays[i]))) for i in rows]
        before = dict(arena.offset)
        known = {id(arrays[i]) for i in rows} & set(before)
        got, sent = _step(arena, [arrays[i] for i in rows], lens, data.draw(st.integers(0, 3)))
        want = np.concatenate([arrays[i][:k] for i, k in zip(rows, lens)])
        assert got[:len(want)].tolist() == want.tolist()
        assert got[len(want):].eq(SCRATCH).all(), "padding rows read the scratch slot"
        new = {id(arrays[i]) for i in rows} - known
        held = sum(len(arrays[i]) for i in set(rows))
        assert sent in (sum(len(arrays[i]) for i in set(rows) if id(arrays[i]) in new), held), sent
        assert {id(arrays[i]) for i in rows} <= set(arena.offset) == set(arena.held), "the step's arrays are held"
        assert all(arena.held[k] is arrays[i] for i in rows for k in [id(arrays[i])])
        step = {id(arrays[i]) for i in rows}
        assert set(arena.offset) in (step, set(before) | step), "only a compaction lets arrays go, all but the step's"
        assert arena.top <= arena.capacity == len(arena.buffer)


def test_an_array_is_sent_once_while_it_stays():
    arena = SlotArena(SCRATCH, "cpu")
    a, b = np.arange(10, dtype=np.int64), np.arange(100, 120, dtype=np.int64)
    _, sent = _step(arena, [a, b], [3, 5], 1)
    assert sent == 30
    for k in range(4, 9):
        got, sent = _step(arena, [a, b], [k, k + 2], 0)
        assert sent == 0 and got.tolist() == list(range(k)) + list(range(100, 100 + k + 2))
    c = np.arange(200, 210, dtype=np.int64)
    got, sent = _step(arena, [c, b], [2, 1], 0)      # a left, c joined: only c is sent
    assert sent == 10 and got.tolist() == [200, 201, 100]
    got, sent = _step(arena, [a], [2], 0)            # a is back: it kept its place
    assert sent == 0 and got.tolist() == [0, 1]
    big = np.arange(1000, 1200, dtype=np.int64)      # no room for it: the step's arrays placed anew
    got, sent = _step(arena, [big, a], [3, 1], 0)
    assert sent == 210 and got.tolist() == [1000, 1001, 1002, 0] and set(arena.offset) == {id(big), id(a)}
