"""The torch backend's batched decode (issue 57): a decode batch (one new token a sequence) runs as batched ops,
rows that share their first keys reading them once, and gives what attending row by row gives, to float32
rounding, for grouped-query heads, soft-capped scores and sliding windows; pool slots no row reads may hold
anything (NaN here)."""
from __future__ import annotations

import pytest
import torch

from lmbatch.attention.base import ForwardBatch
from lmbatch.attention.kv_pool import KVPool
from lmbatch.attention.torch_ref import MIN_SHARED, TorchBackend, decode_rows

H, KVH, D, SLOTS = 6, 2, 16, 4096


def _batch(rows: list[list[int]]) -> ForwardBatch:
    """A decode batch: each row's keys' slots, its last one the new token's."""
    kv_indptr = [0]
    for r in rows:
        kv_indptr.append(kv_indptr[-1] + len(r))
    B = len(rows)
    return ForwardBatch(torch.zeros(B, dtype=torch.long), torch.tensor([len(r) - 1 for r in rows]),
                        torch.tensor([r[-1] for r in rows]), list(range(B + 1)), kv_indptr,
                        torch.tensor([s for r in rows for s in r]), torch.arange(B))


def _rows(gen: torch.Generator) -> list[list[int]]:
    """Samples of two prompts (rows sharing their first 40 or 25 slots, then their own), a row of its own, rows
    that share only 5 first keys (fewer than MIN_SHARED: read as their own), and a row that reads the new token
    of another (a prompt that is a prefix of another's, inserted earlier in the batch)."""
    free = iter(torch.randperm(SLOTS, generator=gen)[:3000].tolist())
    take = lambda n: [next(free) for _ in range(n)]  # noqa: E731
    a, b, c, prefix = take(40), take(25), take(5), take(21)
    rows = [a + take(k) for k in (1, 3, 7, 2)] + [b + take(k) for k in (9, 1, 4)] + [take(60)]
    return rows + [c + take(k) for k in (30, 2)] + [prefix, prefix + take(1)]


@pytest.mark.parametrize("softcap,window", [(0.0, None), (30.0, None), (0.0, 24), (0.0, 500), (20.0, 30)])
def test_batched_decode_equals_row_by_row(softcap, window):
    gen = torch.Generator().manual_seed(0)
    pool = KVPool(SLOTS, 1, KVH, D, torch.float32, "cpu")
    pool.k.fill_(float("nan"))
    pool.v.fill_(float("nan"))
    rows = _rows(gen)
    used = torch.tensor(sorted({s for r in rows for s in r}))
    pool.k[0, used] = torch.randn(len(used), KVH, D, generator=gen)
    pool.v[0, used] = torch.randn(len(used), KVH, D, generator=gen)
    batch = _batch(rows)
    q = torch.randn(len(rows), H, D, generator=gen)
    new_k, new_v = pool.k[0, batch.out_slots].clone(), pool.v[0, batch.out_slots].clone()
    attn = TorchBackend(pool, H, D, None, softcap)
    attn.plan(batch)
    d = attn.decode
    assert d is not None and [len(r) for r, _ in d.shared] == [4, 3, 2]   # the prompts' samples, the prefix's rows
    assert [len(s) for _, s in d.shared] == [40, 25, 20] and MIN_SHARED > 5   # a row's new token is its own
    got = attn.forward(0, q, new_k, new_v, window)
    attn.decode = None                                                    # the loop over rows
    want = attn.forward(0, q, new_k, new_v, window)
    assert torch.isfinite(got).all()
    assert (got - want).abs().max() < 1e-5


def test_only_a_batch_of_one_token_a_sequence_is_batched():
    rows = [[1, 2, 3], [1, 2, 4, 5]]
    assert decode_rows(_batch(rows)) is not None
    two = _batch(rows)
    two.qo_indptr = [0, 2, 3]            # the first sequence's last two tokens are new
    assert decode_rows(two) is None
    pool = KVPool(8, 1, KVH, D, torch.float32, "cpu")
    attn = TorchBackend(pool, H, D)
    attn.deterministic = True           # attend_fixed's bits stay its own
    attn.plan(_batch(rows))
    assert attn.decode is None
