"""Deterministic mode's parts on the CPU: GEMMs in fixed row blocks and attention of fixed shapes give each
row a result that does not depend on the rest of its batch, bit for bit; an engine's scores and tokens
then do not depend on the batch budget, the pool, the cache or the number of decode rows."""
import random

import pytest
import torch
import torch.nn.functional as F

from lmbatch.attention.torch_ref import attend_fixed
from lmbatch.engine import Engine
from lmbatch.model.embedded import embedded_model_dir
from lmbatch.model.layers import fixed_linear
from lmbatch.requests import GenerateRequest, SamplingParams, ScoreRequest


def test_fixed_linear_rows_do_not_depend_on_the_batch():
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(1536, 576, generator=g), torch.randn(1536, generator=g)
    x = torch.randn(1000, 576, generator=g)
    full = fixed_linear(x, w, b)
    assert (full - F.linear(x, w, b)).abs().max() < 1e-3
    for lo, hi in [(0, 1), (3, 4), (5, 40), (31, 33), (100, 1000), (999, 1000)]:
        assert torch.equal(fixed_linear(x[lo:hi], w, b), full[lo:hi]), (lo, hi)
    assert torch.equal(fixed_linear(x[:64].view(8, 8, 576), w, b).view(64, -1), full[:64])


@pytest.mark.parametrize("softcap,window", [(0.0, None), (2.0, 50)])
def test_fixed_attention_of_a_query_does_not_depend_on_the_cut(softcap, window):
    """A sequence's queries attended all at once, or its last n with the keys up to them (a later batch
    over a cached prefix): the same bits; and close to PyTorch's attention."""
    g = torch.Generator().manual_seed(1)
    H, KVH, D, L = 9, 3, 64, 300
    q = torch.randn(L, H, D, generator=g)
    k, v = torch.randn(L, KVH, D, generator=g), torch.randn(L, KVH, D, generator=g)
    full = attend_fixed(q, k, v, 0.125, softcap, window)
    keys, queries = torch.arange(L)[None, :], torch.arange(L)[:, None]
    mask = (keys <= queries) & ((keys > queries - window) if window else True)
    kt, vt = k.repeat_interleave(3, 1).transpose(0, 1), v.repeat_interleave(3, 1).transpose(0, 1)
    s = q.transpose(0, 1) @ kt.transpose(1, 2) * 0.125
    s = softcap * torch.tanh(s / softcap) if softcap else s
    ref = (s.masked_fill(~mask, float("-inf")).softmax(-1) @ vt).transpose(0, 1)
    assert (full - ref).abs().max() < 1e-5
    for end, n in [(300, 1), (300, 17), (250, 100), (129, 5), (128, 128), (1, 1)]:
        assert torch.equal(attend_fixed(q[end - n:end], k[:end], v[:end], 0.125, softcap, window), full[end - n:end])


@pytest.mark.parametrize("window", [None, 50])
def test_fixed_attention_with_sinks(window):
    """gpt-oss's attention sinks in deterministic mode: the same bits however the sequence is cut, and
    transformers' eager attention (the sink one more softmax column, dropped) to float32 rounding."""
    from lmbatch.attention.torch_ref import attend_fixed_sinks

    g = torch.Generator().manual_seed(2)
    H, KVH, D, L = 8, 2, 32, 300
    q = torch.randn(L, H, D, generator=g)
    k, v = torch.randn(L, KVH, D, generator=g), torch.randn(L, KVH, D, generator=g)
    sinks = 3 * torch.randn(H, generator=g)
    full = attend_fixed_sinks(q, k, v, 0.125, window, sinks)
    keys, queries = torch.arange(L)[None, :], torch.arange(L)[:, None]
    mask = (keys <= queries) & ((keys > queries - window) if window else True)
    kt, vt = k.repeat_interleave(4, 1).transpose(0, 1), v.repeat_interleave(4, 1).transpose(0, 1)
    s = (q.transpose(0, 1) @ kt.transpose(1, 2) * 0.125).masked_fill(~mask, float("-inf"))
    s = torch.cat([s, sinks.view(H, 1, 1).expand(H, L, 1)], -1)
    ref = (s.softmax(-1)[..., :-1] @ vt).transpose(0, 1)
    assert (full - ref).abs().max() < 1e-5
    assert (full - attend_fixed(q, k, v, 0.125, 0.0, window)).abs().max() > 0.1      # the sinks weigh
    for end, n in [(300, 1), (300, 17), (129, 5)]:
        assert torch.equal(attend_fixed_sinks(q[end - n:end], k[:end], v[:end], 0.125, window, sinks),
                           full[end - n:end])


@pytest.fixture(scope="module")
def requests_():
    g = random.Random(0)
    shared = [g.randrange(100, 5000) for _ in range(130)]
    score = []
    for _ in range(3):
        ctx = shared + [g.randrange(100, 5000) for _ in range(g.randrange(5, 60))]
        score += [ScoreRequest(ctx, [g.randrange(100, 5000) for _ in range(g.randrange(1, 4))]) for _ in range(2)]
    gen = [GenerateRequest(shared[:50 + 7 * i], SamplingParams(max_new_tokens=4, temperature=0.8 * (i % 2), seed=i,
                                                                 ignore_eos=True)) for i in range(3)]
    return score, gen


def _engine(**kw):
    return Engine.from_pretrained(embedded_model_dir(), device="cpu", dtype=torch.float32, deterministic=True, **kw)


def test_deterministic_engine_scores_and_tokens_do_not_depend_on_how_they_ran(requests_):
    score, gen = requests_
    runs = [dict(max_tokens_per_batch=4096), dict(max_tokens_per_batch=200, cache=False),
            dict(max_tokens_per_batch=61, kv_cache_tokens=400, max_running=2)]
    got = []
    for kw in runs:
        eng = _engine(**kw)
        got.append(([r.logprob for r in eng.score(score)[0]], [r.token_ids for r in eng.generate(gen)[0]]))
    for other in got[1:]:
        assert other == got[0]      # every bit
    plain = Engine.from_pretrained(embedded_model_dir(), device="cpu", dtype=torch.float32, max_tokens_per_batch=4096)
    assert max(abs(a.logprob - b) for a, b in zip(plain.score(score)[0], got[0][0])) < 1e-3
