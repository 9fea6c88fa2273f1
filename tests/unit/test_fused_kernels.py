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
