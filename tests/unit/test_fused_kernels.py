"""kernels/fused.py's RoPE-and-store kernel on the CPU, under Triton's interpreter: a decode step's q rotated
in place and its keys (rotated) and values written into the KV pool's slots, as rotating then storing does
(layers.apply_rope, AttentionBackend.store). The GPU suite runs it compiled, in bf16 (tests/gpu/test_gpu.py).

The interpreter is chosen when `triton.jit` runs (TRITON_INTERPRET=1 at import): a process of its own."""

from triton_interpreter import interpreted

SCRIPT = r'''
import json
import torch

from lmbatch.kernels.fused import rope_store_
from lmbatch.model.layers import apply_rope

out = []
for T, H, KVH, D in [(5, 12, 2, 128), (3, 4, 4, 64), (2, 9, 3, 32)]:
    g = torch.Generator().manual_seed(T * H)
    qkv = torch.randn(T, (H + 2 * KVH) * D, generator=g)        # the fused projection's rows, as the model has them
    q, k, v = qkv.split([H * D, KVH * D, KVH * D], dim=-1)
    q, k, v = q.view(T, H, D), k.view(T, KVH, D), v.view(T, KVH, D)
    ang = torch.rand(T, D // 2, generator=g) * 6
    cos, sin = ang.cos(), ang.sin()
    want_q, want_k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    pool_k, pool_v = torch.full((20, KVH, D), 7.0), torch.full((20, KVH, D), 7.0)
    slots = torch.tensor([3, 11, 0, 19, 5][:T])
    k_before, v_before = k.clone(), v.clone()
    rope_store_(q, k, v, cos, sin, pool_k, pool_v, slots)
    untouched = [i for i in range(20) if i not in slots.tolist()]
    out.append({"q": float((q - want_q).abs().max()), "k": float((pool_k[slots] - want_k).abs().max()),
                "v": bool(torch.equal(pool_v[slots], v)), "rest": bool((pool_k[untouched] == 7).all()
                                                                      and (pool_v[untouched] == 7).all()),
                "kv_kept": bool(torch.equal(k, k_before) and torch.equal(v, v_before))})
print(json.dumps(out))
'''


def test_rope_store_rotates_q_in_place_and_stores_rotated_keys_and_values():
    for r in interpreted(SCRIPT, timeout=600):
        assert r["q"] < 1e-6 and r["k"] < 1e-6, r
        assert r["v"] and r["rest"] and r["kv_kept"], r


SAMPLING = r'''
import json
import torch

import triton.language as tl

import lmbatch.kernels.sampling as kernel
from lmbatch.engine import sampling
from lmbatch.kernels.sampling import gumbel_argmax

kernel.libdevice = tl.math      # the interpreter has no libdevice: the same IEEE float32 division and log

out = []
for V, n in [(5000, 12), (2048, 4), (700, 3)]:       # over several blocks of 2,048, one block, a part of one
    g = torch.Generator().manual_seed(V)
    logits = torch.randn(n + 2, V, generator=g) * 3
    logits[::3, ::5] = float("-inf")                 # what a grammar's mask leaves
    logits[1, :] = float("-inf")                     # every token masked: the first one
    logits[2, 3] += 50                               # two tokens far above the rest: the noise decides
    logits[0, [V - 1, V // 2 + 3, V // 2, 9]] = float("inf")   # ties (+inf): the first, across lanes and blocks
    logits[2, 4000 % V] = logits[2, 3]
    rows = torch.arange(n, dtype=torch.int64)
    seeds = torch.arange(n, dtype=torch.int64) * 7919 - 3
    steps = torch.arange(n, dtype=torch.int64) % 5
    temp = torch.tensor([0.3, 0.7, 1.0, 1.7][:1] * n, dtype=torch.float32) + torch.arange(n) * 0.1
    got = gumbel_argmax(logits, rows, seeds, steps, temp, (sampling._K_SEED, sampling._K_STEP, sampling._K_TOKEN,
                                                           sampling._M1, sampling._M2))
    z = logits[:n] / temp[:, None]
    want = (z - torch.log(-torch.log(sampling._uniform(seeds, steps, V)))).argmax(dim=-1)
    out.append({"got": got.tolist(), "want": want.tolist()})
print(json.dumps(out))
'''


def test_fused_sampling_kernel_picks_the_first_token_at_the_noisy_maximum():
    """kernels/sampling.py's Gumbel-max kernel against the PyTorch ops' noise and argmax (the first index of
    the maximum): rows over several blocks of the vocabulary, masked tokens, a row all masked (its first
    token), two tokens far above the rest, ties at +inf (the first of them). The GPU suite runs it compiled,
    with libdevice (test_fused_sampling_picks_the_tokens_of_the_torch_ops)."""
    for r in interpreted(SAMPLING, timeout=600):
        assert r["got"] == r["want"], r
