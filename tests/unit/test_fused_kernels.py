"""Our small Triton kernels on the CPU, under Triton's interpreter, against their plain PyTorch forms:
kernels/fused.py's RoPE-and-store (a decode step's q rotated in place and its keys (rotated) and values
written into the KV pool's slots, as rotating then storing does: layers.apply_rope, AttentionBackend.store),
RMSNorm and gated activations; kernels/sampling.py's Gumbel-max; kernels/moe.py's grouped-GEMM experts. The
GPU suite runs them compiled, in bf16 (tests/gpu/test_gpu.py).

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


NORM_ACT = r'''
import json
import torch

from lmbatch.kernels.fused import act_mul, rmsnorm
from lmbatch.model import layers

out = []
for dtype in (torch.float32, torch.float16):
    def close(name, got, want):
        same = got.dtype == want.dtype and got.shape == want.shape
        out.append({"case": f"{name} {dtype}", "same_kind": same, "dtype": str(dtype),
                    "exact": float((got == want).float().mean()) if same else 0.0,
                    # float32: to 1e-5; float16: within 2**-9 of the value (an ulp is 2**-10 of it at most)
                    "near": same and bool(torch.allclose(got.float(), want.float(), rtol=1e-5, atol=1e-5)
                                          if dtype == torch.float32 else
                                          torch.allclose(got.float(), want.float(), rtol=2 ** -9, atol=2 ** -14))})

    for T, N, offset in [(3, 64, 0.0), (2, 96, 1.0), (4, 128, 0.0)]:
        g = torch.Generator().manual_seed(T * N)
        x, res = torch.randn(T, N, generator=g).to(dtype), torch.randn(T, N, generator=g).to(dtype)
        norm = layers.RMSNorm(N, 1e-6, offset).to(dtype)
        norm.weight.data = (torch.rand(N, generator=g) + 0.5).to(dtype)
        close(f"rmsnorm {T}x{N} offset {offset}", rmsnorm(x, norm.weight, 1e-6, offset=offset), norm(x))
        want, want_res = norm(x, res.clone())
        got_res = res.clone()
        got = rmsnorm(x, norm.weight, 1e-6, got_res, offset)
        close(f"add_rmsnorm {T}x{N}", got, want)
        close(f"add_rmsnorm residual {T}x{N}", got_res, want_res)
        wide = torch.randn(T, 3 * N, generator=g).to(dtype)         # a head's slice of the fused projection
        close(f"rmsnorm strided {T}x{N}", rmsnorm(wide[:, N:2 * N], norm.weight, 1e-6, offset=offset),
              norm(wide[:, N:2 * N].contiguous()))
    for T, I in [(3, 96), (2, 1500)]:                   # within one block of 1,024, and over two
        g = torch.Generator().manual_seed(T * I)
        gu = torch.randn(T, 2 * I, generator=g).to(dtype) * 3
        for act in ("silu", "gelu_tanh"):
            gate, up = gu.chunk(2, dim=-1)
            f = torch.nn.functional
            ref = (f.silu(gate) if act == "silu" else f.gelu(gate, approximate="tanh")) * up
            close(f"act_mul {act} {T}x{I}", act_mul(gu, act), ref)
print(json.dumps(out))
'''


def test_fused_norm_and_activation_kernels_round_as_the_plain_ops():
    """kernels/fused.py's RMSNorm (alone, with the residual add updated in place, Gemma's offset, rows at a
    stride) and gated activations (SiLU, tanh-GELU; a row within one block and over two) against
    model/layers.py's plain PyTorch forms, float32 and float16, under Triton's interpreter. In float16 they
    round where the plain ops do: at least 99% of the values are the same bits (the tanh-GELU, whose formula
    is another, 95%: leaving out the SiLU's rounding before `* up` left 74% the same) and none is more than
    an ulp or two off; float32 to 1e-5. The GPU suite runs them compiled, in bf16 (test_fused_ops_match_torch_path)."""
    r = interpreted(NORM_ACT, timeout=600)
    assert len(r) == 2 * (3 * 4 + 2 * 2), len(r)
    for c in r:
        assert c["same_kind"] and c["near"], c
        if c["dtype"] == "torch.float16":
            assert c["exact"] >= (0.95 if "gelu" in c["case"] else 0.99), c


MOE = r'''
import json
import torch
import torch.nn.functional as F

from lmbatch.kernels.moe import fused_moe
from lmbatch.model.layers import act_mul

out = []
E, k, H, n = 8, 2, 64, 80      # the intermediate size past one block of 64 columns
for T in (1, 7, 40):            # decode-sized (blocks of 16 rows a expert) and prefill-sized (64)
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, H, generator=g)
    gu, dn = 0.2 * torch.randn(E, 2 * n, H, generator=g), 0.2 * torch.randn(E, H, n, generator=g)
    w, ex = torch.topk(torch.softmax(torch.randn(T, E, generator=g), -1), k, -1)
    want = torch.zeros(T, H)
    for e in ex.unique().tolist():
        t, s = torch.where(ex == e)
        want.index_add_(0, t, F.linear(act_mul(F.linear(x[t], gu[e])), dn[e]) * w[t, s, None])
    got = fused_moe(x, gu, dn, w, ex, act_mul)
    out.append({"T": T, "unused": E - len(ex.unique()), "err": float((got - want).abs().max()),
                "scale": float(want.abs().max())})
print(json.dumps(out))
'''


def test_fused_moe_kernel_is_the_expert_loop():
    """kernels/moe.py's grouped GEMMs (slots sorted by expert, each expert's run padded to a block) against
    each expert run on its own tokens and the routing weights summed, float32 under Triton's interpreter: one
    token, a decode-sized batch, a prefill-sized one; experts left without tokens. The GPU suite runs it
    compiled, in bf16 (test_fused_moe_matches_the_expert_loop)."""
    r = interpreted(MOE, timeout=600)
    assert [c["T"] for c in r] == [1, 7, 40] and r[0]["unused"] > 0, r
    for c in r:
        assert c["err"] <= 1e-5 * max(1.0, c["scale"]), c
