"""Cascade decode attention (kernels/cascade_attention.py) on the CPU, under Triton's interpreter: rows of a
radix tree sharing 1, 2 and 3 levels beside rows sharing none, their tables staged and loaded as the
decode graphs do it (engine/graphs.py: a bucket padded past the step's rows), against attention in
float64 and against plain decode (kernels/decode_attention.py). The GPU suite runs the same kernels
compiled (tests/gpu/test_gpu.py).

The interpreter is chosen when `triton.jit` runs (TRITON_INTERPRET=1 at import), so the cases run in a
process of their own."""
import json

import pytest
from triton_interpreter import interpreted_each

SCRIPT = r'''
import json, sys
import numpy as np, torch

from lmbatch.engine.cascade import plan_levels
from lmbatch.engine.graphs import level_size, load_levels, stage_levels
from lmbatch.engine.radix_cache import RadixTree
from lmbatch.kernels import cascade_attention as cascade, decode_attention as decode
from lmbatch.kernels.cascade_attention import CascadeLevels, cascade_attention
from lmbatch.kernels.decode_attention import decode_attention

# fewer programs than a GPU wants (the interpreter runs each in turn): 4 key ranges a row, 4 of a level,
# 5 programs walking the level blocks (each walks several)
decode.splits_for = cascade.splits_for = lambda rows, kv_heads: 4
cascade.SHARED_SPLITS, cascade.PROGRAMS = 4, 5

def rows(seed):
    rng = np.random.default_rng(seed)
    tree, used = RadixTree(lambda s: None), [1]      # slot 0: the padding rows' scratch
    def take(n):
        used[0] += n
        return np.arange(used[0] - n, used[0], dtype=np.int64)
    base = rng.integers(0, 1000, 130).tolist()
    prompts = []
    for _ in range(3):
        mid = base + rng.integers(1000, 2000, 70).tolist()
        prompts += [mid + rng.integers(2000, 3000, 20 + j).tolist() for j in range(3)]
    prompts += [rng.integers(3000, 4000, 90 + j).tolist() for j in range(3)]
    for p in prompts:
        have, _ = tree.match_prefix(p)
        tree.insert(p, np.concatenate([have, take(len(p) - len(have))]))
    ends, seqs = [], []
    for i, p in enumerate(prompts):
        for c in range(2 if i < 9 else 1):
            have, node = tree.match_prefix(p)
            ends.append(node)
            seqs.append(np.concatenate([have, take(1 + (7 * i + c) % 40)]))
    return ends, seqs, used[0]

out = []
for H, KVH, D, softcap, max_levels in json.loads(sys.argv[1]):
    ends, seqs, slots = rows(0)
    n, b = len(seqs), len(seqs) + 3
    levels = CascadeLevels(b, H // KVH, "cpu")
    plan = plan_levels(ends, levels.per_block, max_levels, levels.max_blocks)
    seqs = seqs + [np.zeros(1, dtype=np.int64)] * (b - n)
    indptr = np.concatenate([[0], np.cumsum([len(s) for s in seqs])])
    host = np.zeros(level_size(b, plan, levels.per_block), dtype=np.int64)
    stage_levels(host, b, plan, indptr)
    load_levels(levels, torch.from_numpy(host), b, plan)
    g = torch.Generator().manual_seed(H)
    k, v = torch.randn(slots, KVH, D, generator=g), torch.randn(slots, KVH, D, generator=g)
    q = torch.randn(b, H, D, generator=g)
    idx, ptr = torch.tensor(np.concatenate(seqs), dtype=torch.int32), torch.tensor(indptr, dtype=torch.int32)
    got = cascade_attention(q, k, v, idx, ptr, 0.1, softcap, levels)
    plain = decode_attention(q, k, v, idx, ptr, 0.1, None, softcap)
    # where rows fill the GPU: own keys and levels in one program a (row, KV head), no key ranges (two of the
    # cases: the interpreter's time)
    got_whole, plain_whole = got, plain
    if H % 3 == 0:
        cascade.splits_for = decode.splits_for = lambda rows, kv_heads: 1
        got_whole = cascade_attention(q, k, v, idx, ptr, 0.1, softcap, levels)
        plain_whole = decode_attention(q, k, v, idx, ptr, 0.1, None, softcap)
        cascade.splits_for = decode.splits_for = lambda rows, kv_heads: 4
    worst = worst_whole = 0.0
    for i in range(n):
        sl = idx[indptr[i]:indptr[i + 1]].long()
        kk, vv = (x[sl].double().repeat_interleave(H // KVH, 1) for x in (k, v))
        sc = torch.einsum("hd,khd->hk", q[i].double(), kk) * 0.1
        sc = softcap * torch.tanh(sc / softcap) if softcap else sc
        want = torch.einsum("hk,khd->hd", sc.softmax(-1), vv)
        worst = max(worst, float((got[i].double() - want).abs().max()))
        worst_whole = max(worst_whole, float((got_whole[i].double() - want).abs().max()),
                          float((plain_whole[i].double() - want).abs().max()))
    out.append({"case": [H, KVH, D, softcap, max_levels], "levels": plan.levels.tolist(), "worst": worst,
                "vs_plain": float((got[:n] - plain[:n]).abs().max()), "worst_whole": worst_whole})
print(json.dumps(out))
'''

CASES = [[12, 2, 128, 0.0, 3], [8, 8, 32, 0.0, 2], [9, 3, 64, 3.0, 3], [16, 1, 64, 0.0, 1]]


@pytest.fixture(scope="module")
def results():
    """Each case in a process of its own, side by side where there are cores (the interpreter is one thread)."""
    runs = interpreted_each(SCRIPT, [(json.dumps([case]),) for case in CASES])
    return {tuple(r["case"]): r for run in runs for r in run}


@pytest.mark.parametrize("case", CASES, ids=lambda c: "h{}kv{}d{}cap{}L{}".format(*c))
def test_cascade_attention_is_attention(results, case):
    r = results[tuple(case)]
    levels = case[4]
    # 18 rows under the prefix (2 samples of 9 questions), 3 alone; levels capped at max_levels
    assert r["levels"] == [min(3, levels)] * 18 + [0] * 3, r["levels"]
    assert r["worst"] < 1e-5, r
    assert r["vs_plain"] < 1e-5, r
    assert r["worst_whole"] < 1e-5, r        # the one-program-a-row path, cascade and plain
