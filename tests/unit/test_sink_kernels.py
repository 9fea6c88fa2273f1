"""gpt-oss's attention sinks in the Triton kernels (kernels/extend_attention.py, kernels/decode_attention.py) on
the CPU, under Triton's interpreter: ragged prefill over cached prefixes and split decode (and decode with one
program a row), with and without a sliding window, against attention computed in float64 with each head's sink
logit one more softmax column (as transformers' eager attention has it); without sinks the kernels are what they
were. The GPU suite runs the
same kernels compiled (tests/gpu/test_new_architectures.py).

The interpreter is chosen when `triton.jit` runs (TRITON_INTERPRET=1 at import), so the cases run in a
process of their own."""
import json

import pytest
from triton_interpreter import interpreted

SCRIPT = r'''
import json, sys
import numpy as np, torch

from lmbatch.kernels import decode_attention as decode
from lmbatch.kernels.decode_attention import decode_attention
from lmbatch.kernels.extend_attention import extend_attention

decode.splits_for = lambda rows, kv_heads: 4        # few programs: the interpreter runs each in turn
H, KVH, D, SCALE = 8, 2, 32, 0.15

def reference(q, k, v, window, sinks):
    """Causal attention of a sequence's last n queries over its L keys, float64, sinks as a softmax column."""
    n, L = q.shape[0], k.shape[0]
    keys, queries = torch.arange(L)[None, :], torch.arange(L - n, L)[:, None]
    mask = (keys <= queries) & ((keys > queries - window) if window else True)
    kk, vv = (x.double().repeat_interleave(H // KVH, 1).transpose(0, 1) for x in (k, v))
    s = (q.double().transpose(0, 1) @ kk.transpose(1, 2) * SCALE).masked_fill(~mask, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.double().view(H, 1, 1).expand(H, n, 1)], -1)
    p = s.softmax(-1)[..., :L]
    return (p @ vv).transpose(0, 1)

def case(shapes, window, with_sinks, splits, seed):
    g = torch.Generator().manual_seed(seed)
    slots = sum(a + b for a, b in shapes) + 8
    k, v = torch.randn(slots, KVH, D, generator=g), torch.randn(slots, KVH, D, generator=g)
    perm = torch.randperm(slots, generator=g)
    seqs, qo, kv, used = [], [0], [0], 0
    for prefix, new in shapes:
        seqs.append(perm[used:used + prefix + new])
        used += prefix + new
        qo.append(qo[-1] + new)
        kv.append(kv[-1] + prefix + new)
    q = torch.randn(qo[-1], H, D, generator=g)
    sinks = 2 * torch.randn(H, generator=g) + 1 if with_sinks else None
    idx = torch.cat(seqs).to(torch.int32)
    qo_t, kv_t = torch.tensor(qo, dtype=torch.int32), torch.tensor(kv, dtype=torch.int32)
    if all(new == 1 for _, new in shapes):
        got = decode_attention(q, k, v, idx, kv_t, SCALE, window, 0.0, splits, sinks=sinks)
    else:
        got = extend_attention(q, k, v, idx, qo_t, kv_t, max(b for _, b in shapes), SCALE, window, 0.0, False, sinks)
    worst = 0.0
    for i, s in enumerate(seqs):
        want = reference(q[qo[i]:qo[i + 1]], k[s.long()], v[s.long()], window, sinks)
        worst = max(worst, float((got[qo[i]:qo[i + 1]].double() - want).abs().max()))
    return worst

out = {}
for name, (shapes, window, with_sinks, splits) in json.loads(sys.argv[1]).items():
    out[name] = case([tuple(x) for x in shapes], window, with_sinks, splits, len(out))
print(json.dumps(out))
'''

EXTEND = [[0, 37], [20, 5], [70, 1], [3, 70]]         # (cached prefix, new tokens) per sequence
DECODE = [[0, 1], [4, 1], [63, 1], [129, 1], [300, 1]]
# "whole": decode with one program a (row, KV head), as in steps whose rows fill the GPU
CASES = {f"{kind}-{'window' if window else 'full'}-{'sinks' if sinks else 'plain'}": (shapes, window, sinks, splits)
         for kind, shapes, splits in (("extend", EXTEND, None), ("decode", DECODE, None), ("whole", DECODE, 1))
         for window in (None, 16) for sinks in (True, False)}


@pytest.fixture(scope="module")
def results():
    return interpreted(SCRIPT, json.dumps(CASES))


@pytest.mark.parametrize("case", list(CASES))
def test_kernel_attention_with_and_without_sinks(results, case):
    assert results[case] < 1e-5, results[case]
