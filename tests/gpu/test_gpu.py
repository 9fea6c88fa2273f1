"""GPU backends (run on the GPU machine: pytest -m gpu). Each against the torch reference backend and
against transformers on random weights in bf16: prefix-cached extend, decode, eviction."""
import random

import pytest
import torch
from transformers import AutoModelForCausalLM

pytestmark = pytest.mark.gpu

from conftest import hf_scores, make_tiny_hf, random_requests  # noqa: E402

from lmbatch.attention.base import ForwardBatch, make_backend  # noqa: E402
from lmbatch.attention.kv_pool import KVPool  # noqa: E402
from lmbatch.engine import Engine  # noqa: E402
from lmbatch.requests import GenerateRequest, SamplingParams  # noqa: E402

BACKENDS = ["triton", "flashinfer"]


def _ragged_case(H=12, KVH=2, D=128, seed=0):
    """A batch of sequences with cached prefixes of various lengths, one shared by two sequences."""
    g = torch.Generator().manual_seed(seed)
    pool = KVPool(4096, 1, KVH, D, torch.bfloat16, "cuda")
    pool.k.normal_(generator=torch.Generator("cuda").manual_seed(seed))
    pool.v.normal_(generator=torch.Generator("cuda").manual_seed(seed + 1))
    shapes = [(0, 37), (100, 1), (300, 64), (5, 200), (1000, 1), (0, 1)]  # (prefix, new)
    perm = torch.randperm(4096, generator=g)
    seqs, used = [], 0
    for prefix, new in shapes:
        seqs.append(perm[used:used + prefix + new])
        used += prefix + new
    seqs[1] = torch.cat([seqs[2][:100], seqs[1][-1:]])  # shares the start of sequence 2's prefix
    qo, kv = [0], [0]
    for (prefix, new), s in zip(shapes, seqs):
        qo.append(qo[-1] + new)
        kv.append(kv[-1] + len(s))
    T = qo[-1]
    out_slots = torch.cat([s[len(s) - (qo[i + 1] - qo[i]):] for i, s in enumerate(seqs)])
    batch = ForwardBatch(torch.zeros(T, dtype=torch.long), torch.zeros(T, dtype=torch.long), out_slots,
                         qo, kv, torch.cat(seqs), torch.arange(T))
    q = torch.randn(T, H, D, generator=g).to("cuda", torch.bfloat16)
    k = torch.randn(T, KVH, D, generator=g).to("cuda", torch.bfloat16)
    v = torch.randn(T, KVH, D, generator=g).to("cuda", torch.bfloat16)
    return pool, batch, q, k, v


# FlashInfer's attention modules the tests build: (head_dim, sliding window, soft-cap), bf16. Each is ~80-90 s
# of nvcc alone (H200 host, 2026-11-28); built one after another at their first tests, they kept
# `-m "gpu and not gpu2"` from finishing in 380 s
FLASHINFER_MODULES = [(128, False, False), (64, False, False), (64, True, False), (64, False, True), (64, True, True)]


@pytest.fixture(scope="session")
def flashinfer_modules():
    """Every FlashInfer module the tests use, compiled side by side (FlashInfer's JIT runs nvcc in processes
    of its own, so threads build them at once) before the first test that needs one."""
    from concurrent.futures import ThreadPoolExecutor

    def build(module):
        head_dim, windowed, capped = module
        pool, batch, q, k, v = _ragged_case(4, 2, head_dim)
        attn = make_backend("flashinfer", pool, 4, head_dim, 0.1, 3.0 if capped else 0.0)
        attn.plan(batch.to("cuda"))
        attn.forward(0, q, k, v, window=50 if windowed else None)
        torch.cuda.synchronize()

    with ThreadPoolExecutor(len(FLASHINFER_MODULES)) as pool:
        list(pool.map(build, FLASHINFER_MODULES))


@pytest.fixture(params=BACKENDS)
def name(request):
    """A GPU backend's name; FlashInfer's with its modules built first."""
    if request.param == "flashinfer":
        request.getfixturevalue("flashinfer_modules")
    return request.param


# sliding windows and soft-caps at head_dim 64 only: each is a FlashInfer kernel of its own (~1 min of JIT)
@pytest.mark.parametrize("shape,window,softcap", [((12, 2, 128), None, 0.0), ((14, 2, 64), None, 0.0),
                                                  ((9, 3, 64), None, 0.0), ((14, 2, 64), 50, 0.0),
                                                  ((14, 2, 64), None, 3.0), ((9, 3, 64), 7, 3.0)])
def test_backend_matches_reference(name, shape, window, softcap):
    H, KVH, D = shape
    outs = {}
    for backend in ("torch", name):
        pool, batch, q, k, v = _ragged_case(H, KVH, D)
        attn = make_backend(backend, pool, H, D, 0.1, softcap)
        attn.plan(batch.to("cuda"))
        outs[backend] = attn.forward(0, q, k, v, window=window).float()
    ref, got = outs["torch"], outs[name]
    assert not got.isnan().any()
    assert ((got - ref).norm() / ref.norm()) < 1e-2


@pytest.mark.parametrize("shape,window,softcap", [((12, 2, 128), None, 0.0), ((32, 8, 128), None, 0.0),
                                                  ((8, 8, 64), None, 0.0), ((16, 1, 256), None, 0.0),
                                                  ((14, 2, 64), 50, 0.0), ((9, 3, 64), 7, 3.0)])
@pytest.mark.parametrize("splits", [None, 1, 16])
def test_split_decode_kernel_matches_reference(shape, window, softcap, splits):
    """The decode graphs' kernel: one query per row over rows of 1 to 4,100 keys (a short row leaves key
    ranges empty), every head of a KV head at once, against attention computed in float32."""
    from lmbatch.kernels.decode_attention import decode_attention

    H, KVH, D = shape
    g = torch.Generator("cuda").manual_seed(0)
    lens = [1, 2, 63, 64, 65, 300, 1000, 4100, 17]
    k = torch.randn(8192, KVH, D, generator=g, device="cuda").to(torch.bfloat16)
    v = torch.randn(8192, KVH, D, generator=g, device="cuda").to(torch.bfloat16)
    idx = [torch.randperm(8192, generator=g, device="cuda")[:n] for n in lens]
    q = torch.randn(len(lens), H, D, generator=g, device="cuda").to(torch.bfloat16)
    indptr = torch.tensor([0] + [sum(lens[:i + 1]) for i in range(len(lens))], dtype=torch.int32, device="cuda")
    got = decode_attention(q, k, v, torch.cat(idx).int(), indptr, 0.1, window, softcap, splits).float()
    for i, sl in enumerate(idx):
        sl = sl[-window:] if window else sl
        kk, vv = (x[sl].float().repeat_interleave(H // KVH, 1) for x in (k, v))
        sc = torch.einsum("hd,khd->hk", q[i].float(), kk) * 0.1
        sc = softcap * torch.tanh(sc / softcap) if softcap else sc
        want = torch.einsum("hk,khd->hd", sc.softmax(-1), vv)
        assert (got[i] - want).abs().max() < 3e-2, (i, lens[i], (got[i] - want).abs().max())


# every native architecture; the windowed ones (mistral, gemma2, gemma3_text: 12 tokens) on prompts of
# up to ~60 tokens; per-head q/k norms over a single KV head (Gemma 3 1B's shape, and any GQA model's
# tensor-parallel rank holding one KV head): that head's k is a strided slice of the fused projection
ARCHS = ["llama", "qwen2", "qwen3", "qwen3_moe", "mixtral", "mistral", "phi3", "olmo2", "gemma2", "gemma3_text",
         "gemma3_text:1kv"]


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, tmp_path_factory):
    kind, _, kv = request.param.partition(":")
    path = tmp_path_factory.mktemp(kind)
    # head_dim 64: FlashInfer compiles head dims 64, 128 and 256 only
    make_tiny_hf(kind, path, hidden_size=256, head_dim=64, **({"num_key_value_heads": 1} if kv else {}))
    return path


@pytest.fixture(scope="module", params=["llama", "qwen3", "qwen3_moe", "mixtral", "phi3", "olmo2", "gemma2",
                                        "gemma3_text"])
def tiny_graphed(request, tmp_path_factory):
    """Architectures whose decode graphs differ: q/k norms, routed experts, sliding windows, soft-caps."""
    path = tmp_path_factory.mktemp(request.param)
    make_tiny_hf(request.param, path, hidden_size=256, head_dim=64)
    return path


def _engine(path, backend, **kw):
    return Engine.from_pretrained(path, device="cuda", dtype=torch.bfloat16, attention=backend, **kw)


def _hf_reference(path, dtype):
    """transformers' model in `dtype`, with eager attention where the config soft-caps attention logits
    (Gemma 2): its SDPA and flash paths on CUDA leave the attention soft-cap out (0.24 nats/token here)."""
    from transformers import AutoConfig

    capped = getattr(AutoConfig.from_pretrained(path), "attn_logit_softcapping", None)
    kw = {"attn_implementation": "eager"} if capped else {}
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kw).to("cuda").eval()


def test_scores_against_transformers_and_reference(tiny, name):
    """bf16 scores agree with transformers' float32 ones at least as well as transformers' own bf16
    scores do (Gemma's soft-capped logits lose much in bf16 there), and with our torch reference."""
    path = tiny
    reqs = random_requests(random.Random(0), 40)
    ref, _ = _engine(path, "torch").score(reqs)
    got, stats = _engine(path, name, max_tokens_per_batch=48).score(reqs)
    assert stats.computed_tokens == stats.unique_tokens
    exact = hf_scores(_hf_reference(path, torch.float32), reqs)
    hf_bf16 = hf_scores(_hf_reference(path, torch.bfloat16), reqs)
    tokens = sum(len(r.continuation) for r in reqs)
    ours_err = sum(abs(b.logprob - e) for b, e in zip(got, exact)) / tokens
    hf_err = sum(abs(h - e) for h, e in zip(hf_bf16, exact)) / tokens
    assert ours_err <= 1.1 * hf_err + 0.005, (ours_err, hf_err)
    for req, a, b in zip(reqs, ref, got):
        assert abs(b.logprob - a.logprob) < 0.05 * len(req.continuation)


def test_greedy_decode_matches_reference(tiny, name):
    path = tiny
    reqs = [GenerateRequest([3, 17, 42, 9, i], SamplingParams(max_new_tokens=8, ignore_eos=True)) for i in range(5)]
    ref, _ = _engine(path, "torch").generate(reqs)
    got, _ = _engine(path, name).generate(reqs)
    same = sum(a.token_ids == b.token_ids for a, b in zip(ref, got))
    assert same >= 4  # bf16: an argmax tie may flip one sequence


def test_eviction_under_small_pool(tiny, name):
    path = tiny
    reqs = random_requests(random.Random(9), 40)
    longest = max(len(r.prompt) for r in reqs)
    big, _ = _engine(path, name).score(reqs)
    small, stats = _engine(path, name, kv_cache_tokens=longest + 8, max_tokens_per_batch=8).score(reqs)
    assert stats.evicted_tokens > 0
    assert max(abs(a.logprob - b.logprob) for a, b in zip(big, small)) < 0.05


def test_fused_ops_match_torch_path():
    import torch.nn.functional as F

    from lmbatch.kernels import fused
    from lmbatch.model.layers import apply_rope

    g = torch.Generator("cuda").manual_seed(0)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    x, r = torch.randn(300, 1536, generator=g, **bf), torch.randn(300, 1536, generator=g, **bf)
    w = torch.randn(1536, generator=g, **bf)
    s = r + x
    ref = w * (s.float() * torch.rsqrt(s.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
    res = r.clone()
    got = fused.rmsnorm(x, w, 1e-6, res)
    assert torch.equal(res, s)
    torch.testing.assert_close(got, ref)
    torch.testing.assert_close(fused.rmsnorm(s, w, 1e-6), ref)
    gu = torch.randn(300, 2 * 8960, generator=g, **bf)
    gate, up = gu.chunk(2, dim=-1)
    torch.testing.assert_close(fused.act_mul(gu), F.silu(gate) * up)
    torch.testing.assert_close(fused.act_mul(gu, "gelu_tanh"), F.gelu(gate, approximate="tanh") * up)
    gemma = (s.float() * torch.rsqrt(s.float().pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + w.float())).to(s.dtype)
    torch.testing.assert_close(fused.rmsnorm(s, w, 1e-6, offset=1.0), gemma)
    head = s[:, 512:640]                         # rows 1536 apart: one head of a fused projection
    w128 = w[:128]
    want = w128 * (head.float() * torch.rsqrt(head.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(s.dtype)
    torch.testing.assert_close(fused.rmsnorm(head, w128, 1e-6), want)
    torch.testing.assert_close(fused.rmsnorm(s.t().contiguous().t()[:, :128], w128, 1e-6),
                               fused.rmsnorm(s[:, :128].contiguous(), w128, 1e-6))
    qkv = torch.randn(300, (12 + 4) * 128, generator=g, **bf)
    q, k = qkv[:, :12 * 128].view(300, 12, 128), qkv[:, 12 * 128:14 * 128].view(300, 2, 128)
    ang = torch.rand(300, 64, generator=g, device="cuda") * 6
    want_q, want_k = apply_rope(q, ang.cos(), ang.sin()), apply_rope(k, ang.cos(), ang.sin())
    v = qkv[:, 14 * 128:].view(300, 2, 128)
    pool_k, pool_v = torch.zeros(1000, 2, 128, **bf), torch.zeros(1000, 2, 128, **bf)
    slots = torch.randperm(1000, generator=g, device="cuda")[:300]
    fused.rope_store_(q, k, v, ang.cos(), ang.sin(), pool_k, pool_v, slots)
    # the rotation in float32 as apply_rope computes it (the compiler may fuse a multiply-add: a last bit of
    # the bf16 result may differ), the value copied as it is
    torch.testing.assert_close(q, want_q)
    torch.testing.assert_close(pool_k[slots], want_k)
    assert torch.equal(pool_v[slots], v)


@pytest.mark.parametrize("n", [1, 3, 8, 13])
def test_decode_with_cuda_graphs_matches_eager(tiny_graphed, n):
    """Same greedy continuations with the decode steps replayed from CUDA graphs (padded to a bucket)."""
    path = tiny_graphed
    reqs = [GenerateRequest([5, 9, 2, i, 7] * (1 + i % 3), SamplingParams(max_new_tokens=12, ignore_eos=True))
            for i in range(n)]
    eager, _ = _engine(path, "triton", cuda_graphs=False).generate(reqs)
    eng = _engine(path, "triton")
    graphed, _ = eng.generate(reqs)
    assert eng.graphs is not None and eng.graphs.graphs, "no graph was captured"
    same = sum(a.token_ids == b.token_ids for a, b in zip(eager, graphed))
    # bf16: a GEMM of another row count may flip a near-tie in one row of eight (never the only row)
    assert same >= max(1, n - max(1, n // 8))


@pytest.mark.parametrize("max_running", [4, 64])
def test_overlapped_decode_matches_waiting_for_each_step(tmp_path, max_running, monkeypatch):
    """Decode steps launched before the host sees the last step's tokens (fed on the device) give what
    waiting for them gives: greedy and seeded-sampled rows, stop strings that end rows at different
    steps (each detected a step late, its extra token dropped), token limits from 3 to 40, rows
    admitted while a step is in flight (max_running 4). Float32: the same graphs run either way."""
    from conftest import make_tiny_with_tokenizer
    from transformers import AutoTokenizer

    from lmbatch.engine.sampler import Sampler

    path = make_tiny_with_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(str(path))

    def run(reqs, overlap):
        if not overlap:
            monkeypatch.setattr(Sampler, "plain", staticmethod(lambda r: False))
        eng = Engine.from_pretrained(path, device="cuda", dtype=torch.float32, attention="triton", tokenizer=tok,
                                     max_running=max_running)
        out = eng.generate(reqs)[0]
        monkeypatch.undo()
        return out

    def params(i, stop=()):
        return SamplingParams(max_new_tokens=3 + (i * 7) % 38, temperature=0.8 if i % 3 == 0 else 0.0, seed=i,
                              ignore_eos=i % 2 == 0, stop=stop)

    prompts = [tok.encode(f"Item {i}: the value of {i * 37} is") for i in range(24)]
    first = run([GenerateRequest(p, params(i)) for i, p in enumerate(prompts)], overlap=False)
    stops = [(r.text[len(r.text) // 2:len(r.text) // 2 + 2],) if i % 4 != 3 and len(r.text) > 4 else ()
             for i, r in enumerate(first)]
    reqs = [GenerateRequest(p, params(i, stops[i])) for i, p in enumerate(prompts)]
    waited, overlapped = run(reqs, overlap=False), run(reqs, overlap=True)
    assert sum(r.finish_reason == "stop" for r in waited) >= 8, [r.finish_reason for r in waited]
    same = [(a.token_ids, a.finish_reason, a.text) == (b.token_ids, b.finish_reason, b.text)
            for a, b in zip(waited, overlapped)]
    assert sum(same) >= len(reqs) - 1, [(a.text, b.text) for a, b, ok in zip(waited, overlapped, same) if not ok]
    for a, b in zip(waited, overlapped):
        assert a.decode_tokens == len(a.token_ids) and b.decode_tokens == len(b.token_ids)


def test_decode_graphs_recaptured_for_longer_rows(tmp_path):
    """Rows whose KV (shared prefixes counted per row) outgrow the graphs' index buffer: the graphs
    are captured again into a new memory pool (capturing into the freed one failed an allocator
    assert in tot-gsm8k with a 64k-token pool), with the eager run's tokens."""
    make_tiny_hf("llama", tmp_path, hidden_size=256, head_dim=64)
    prompt = [5 + i % 50 for i in range(300)]
    reqs = [GenerateRequest(prompt + [i], SamplingParams(max_new_tokens=8, ignore_eos=True)) for i in range(16)]
    eager, _ = _engine(tmp_path, "triton", cuda_graphs=False, kv_cache_tokens=1024).generate(reqs)
    eng = _engine(tmp_path, "triton", kv_cache_tokens=1024)
    before = len(eng.graphs.kv_indices)
    graphed, _ = eng.generate(reqs)
    assert len(eng.graphs.kv_indices) > before, "the index buffer did not grow"
    assert sum(a.token_ids == b.token_ids for a, b in zip(eager, graphed)) >= 14


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_jump_forward_rows_in_decode_graphs_match_eager(tmp_path, dtype):
    """Jump-forward tokens run as extra rows of the decode graphs (several rows of one sequence in
    one replay, and past the largest bucket in several replays): same JSON as eager ragged batches."""
    import json

    from conftest import make_tiny_with_tokenizer
    from transformers import AutoTokenizer

    from lmbatch.grammar import GrammarCompiler
    from lmbatch.programs.json_cities import SCHEMA, valid

    path = make_tiny_with_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(str(path))
    gc = GrammarCompiler(tok, vocab_size=len(tok))

    def run(**kw):
        reqs = [GenerateRequest(tok.encode(f"City number {i} as JSON: "), SamplingParams(max_new_tokens=160),
                                gc.constraint(json_schema=SCHEMA)) for i in range(12)]
        eng = Engine.from_pretrained(path, device="cuda", dtype=dtype, attention="triton", tokenizer=tok,
                                     max_running=4, **kw)
        return eng, eng.generate(reqs)[0]

    _, eager = run(cuda_graphs=False)
    eng, graphed = run()
    assert eng.graphs is not None and max(b for b, _ in eng.graphs.graphs) == 8, "graphs of up to 2 x max_running rows"
    assert all(r.grammar_complete is not None for r in graphed)
    assert all(r.jumped_tokens > 0 for r in graphed)
    same = sum(a.token_ids == b.token_ids for a, b in zip(eager, graphed))
    assert same >= 12 - 2, [(a.text, b.text) for a, b in zip(eager, graphed)]  # TF32 / bf16 near-ties
    done = [r.text for r in graphed if r.grammar_complete]
    assert done and all(valid(t) for t in done), done
    assert all(json.loads(t) is not None for t in done)


@pytest.mark.parametrize("max_running", [1, 8])
def test_decode_graph_rows_of_one_sequence_match_an_extend(tiny_graphed, max_running):
    """Several consecutive tokens of a sequence as separate graph rows (each its own query, all
    storing KV before any attends; past the largest bucket in several replays) give the logits of
    one eager extend of those tokens."""
    path = tiny_graphed
    eng = _engine(path, "triton", max_running=max_running)
    prompt, new = [5, 9, 2, 7, 3, 8, 1, 4], [6, 2, 9, 9, 5]
    slots = torch.from_numpy(eng.pool.alloc(len(prompt) + len(new)))      # the pool hands out numpy slot ids
    other = torch.from_numpy(eng.pool.alloc(4))

    def eager(ids, start, mine):
        fb = ForwardBatch(torch.tensor(ids), torch.arange(start, start + len(ids)), mine[start:start + len(ids)],
                          [0, len(ids)], [0, start + len(ids)], mine[:start + len(ids)], torch.arange(len(ids)))
        return eng.model(fb.to("cuda"), eng.attn)

    eager(prompt, 0, slots)
    eager([3, 3, 3, 3], 0, other)
    want = eager(new, len(prompt), slots).float()
    eng.pool.k[:, slots[len(prompt):]] = 0   # the graphs must write these again
    n = len(prompt)
    toks = [3] + new                          # a row of another sequence first, then the five rows
    positions = [3] + list(range(n, n + len(new)))
    seqs = [other.numpy()] + [slots[:n + j + 1].numpy() for j in range(len(new))]
    got = eng.graphs.run(toks, positions, seqs, rows=list(range(1, 6))).float()
    assert len(eng.graphs.buckets) == (2 if max_running == 1 else 5)
    assert ((got - want).norm() / want.norm()) < 2e-2
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.8


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_mask_modes_pick_the_same_tokens_on_cuda(tmp_path, temperature):
    """Masks filled ahead while the device computes the logits ("overlap"), for every row ("eager",
    through the same pinned buffer and non-blocking copy) or only after a rejected pick ("lazy"):
    the same tokens, on the device's real timing."""
    from conftest import make_tiny_with_tokenizer
    from transformers import AutoTokenizer

    from lmbatch.grammar import GrammarCompiler
    from lmbatch.programs.json_cities import SCHEMA

    path = make_tiny_with_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(str(path))
    gc = GrammarCompiler(tok, vocab_size=len(tok))
    out = {}
    for masks in ("lazy", "eager", "overlap"):
        reqs = [GenerateRequest(tok.encode(f"City number {i} as JSON: "),
                                SamplingParams(max_new_tokens=96, temperature=temperature, seed=i),
                                gc.constraint(json_schema=SCHEMA)) for i in range(48)]
        eng = Engine.from_pretrained(path, device="cuda", dtype=torch.bfloat16, attention="triton", tokenizer=tok,
                                     max_running=32, masks=masks)
        res, stats = eng.generate(reqs)
        out[masks] = [r.token_ids for r in res], stats.masked_rows, stats.resampled_rows
    assert out["lazy"][0] == out["eager"][0] == out["overlap"][0]
    assert out["eager"][2] == 0 and 0 < out["lazy"][1] == out["lazy"][2] < out["eager"][1]
    assert out["overlap"][2] <= out["lazy"][2]


def test_apply_mask_cuda_matches_cpu(tiny_tok) -> None:
    from transformers import AutoTokenizer

    from lmbatch.grammar import GrammarCompiler, allocate_bitmask, apply_mask
    from lmbatch.programs.json_cities import SCHEMA

    PAD = 64  # an embedding padded past the vocabulary
    gc = GrammarCompiler(AutoTokenizer.from_pretrained(str(tiny_tok)))
    c = gc.constraint(json_schema=SCHEMA)
    mask = allocate_bitmask(4, gc.vocab_size)
    c.fill_mask(mask, 0)
    c.fill_mask(mask, 2)
    for dtype in (torch.float32, torch.bfloat16):
        cpu = torch.randn(4, gc.vocab_size + PAD).to(dtype)
        cuda = cpu.cuda()
        apply_mask(cpu, mask, rows=[0, 2])
        apply_mask(cuda, mask, rows=[0, 2])  # the CPU bitmask is moved to the logits' device
        assert torch.equal(cuda.cpu(), cpu)
        assert torch.isinf(cpu[0]).sum() > 0 and not torch.isinf(cpu[1]).any()


@pytest.mark.parametrize("T", [1, 7, 300])
def test_fused_moe_matches_the_expert_loop(T):
    """The grouped-GEMM experts against each expert run on its tokens in float32 (decode-sized and
    prefill-sized batches; experts left without tokens)."""
    import torch.nn.functional as F

    from lmbatch.kernels.moe import fused_moe
    from lmbatch.model.layers import act_mul

    g = torch.Generator("cuda").manual_seed(T)
    E, k, H, n = 16, 4, 256, 192
    bf = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(T, H, generator=g, **bf)
    gu, dn = 0.05 * torch.randn(E, 2 * n, H, generator=g, **bf), 0.05 * torch.randn(E, H, n, generator=g, **bf)
    w, ex = torch.topk(torch.softmax(torch.randn(T, E, generator=g, device="cuda"), -1), k, -1)
    want = torch.zeros(T, H, device="cuda")
    for e in ex.unique().tolist():
        t, s = torch.where(ex == e)
        h = F.linear(act_mul(F.linear(x[t].float(), gu[e].float())), dn[e].float())
        want.index_add_(0, t, h * w[t, s, None])
    got = fused_moe(x, gu, dn, w, ex, act_mul).float()
    assert ((got - want).norm() / want.norm()) < 1e-2


@pytest.mark.parametrize("vocab", [49159, 151937])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_sampling_picks_the_tokens_of_the_torch_ops(vocab, dtype, monkeypatch):
    """The one-pass Triton sampler (kernels/sampling.py) draws the same token as the PyTorch ops for every
    row: temperatures 0 (greedy, untouched) to 1.7, masked (-inf) tokens, seeds and steps apart."""
    import lmbatch.kernels.sampling as fused_sampling
    from lmbatch.engine.sampling import sample_on_device

    calls = []
    own = fused_sampling.gumbel_argmax
    monkeypatch.setattr(fused_sampling, "gumbel_argmax", lambda *a: calls.append(1) or own(*a))
    g = torch.Generator(device="cuda").manual_seed(vocab)
    logits = (torch.randn(300, vocab, generator=g, device="cuda") * 3).to(dtype)
    logits[::7, ::5] = float("-inf")        # what a grammar's mask leaves
    params = [SamplingParams(temperature=(0.0, 0.3, 0.7, 1.0, 1.7)[i % 5], seed=i * 7919) for i in range(300)]
    for step in (0, 1, 37):
        steps = [step + i % 3 for i in range(300)]
        fused = sample_on_device(logits, params, steps)
        assert torch.equal(fused, sample_on_device(logits, params, steps, fused=False)), step
    assert len(calls) == 3


def _shared_rows(seed, prefix=1000, mids=3, mid=200, tails=3, tail=50, copies=2, alone=3):
    """Prompts in a radix tree: one few-shot prefix, `mids` middles under it, `tails` questions under
    each, `copies` rows of each question (levels 1 to 3), and `alone` rows sharing nothing; each row
    with 1 to 40 tokens of its own. Returns (end nodes, row keys, slots used)."""
    import numpy as np

    from lmbatch.engine.radix_cache import RadixTree

    rng = np.random.default_rng(seed)
    tree, used = RadixTree(lambda s: None), [0]

    def take(n):
        used[0] += n
        return np.arange(used[0] - n, used[0], dtype=np.int64)

    base = rng.integers(0, 1000, prefix).tolist()
    prompts = []
    for _ in range(mids):
        m = base + rng.integers(1000, 2000, mid).tolist()
        prompts += [m + rng.integers(2000, 3000, tail + j).tolist() for j in range(tails)]
    prompts += [rng.integers(3000, 4000, 300 + j).tolist() for j in range(alone)]
    for p in prompts:
        have, _ = tree.match_prefix(p)
        tree.insert(p, np.concatenate([have, take(len(p) - len(have))]))
    ends, seqs = [], []
    for i, p in enumerate(prompts):
        for c in range(copies if i < mids * tails else 1):
            have, node = tree.match_prefix(p)
            ends.append(node)
            seqs.append(np.concatenate([have, take(1 + (7 * i + c) % 40)]))
    return ends, seqs, used[0]


@pytest.mark.parametrize("shape,softcap", [((12, 2, 128), 0.0), ((32, 8, 128), 0.0), ((9, 3, 64), 3.0),
                                           ((16, 1, 64), 0.0), ((28, 4, 128), 0.0)])
@pytest.mark.parametrize("max_levels", [1, 2, 3])
@pytest.mark.parametrize("whole", [False, True])
def test_cascade_kernel_matches_plain_decode(shape, softcap, max_levels, whole, monkeypatch):
    """One step of rows sharing 1, 2 and 3 levels of the tree beside rows sharing none: cascade attention
    (each level read once per block of rows) against plain decode and float32 attention; `whole`: the own
    keys and the levels' merge in one program a (row, KV head), as where rows fill the GPU."""
    import numpy as np

    from lmbatch.engine.cascade import plan_levels
    from lmbatch.kernels import cascade_attention as cascade_module
    from lmbatch.kernels import decode_attention as decode_module
    from lmbatch.kernels.cascade_attention import CascadeLevels, cascade_attention
    from lmbatch.kernels.decode_attention import decode_attention

    if whole:
        monkeypatch.setattr(cascade_module, "splits_for", lambda rows, kv_heads: 1)
        monkeypatch.setattr(decode_module, "splits_for", lambda rows, kv_heads: 1)

    H, KVH, D = shape
    ends, seqs, slots = _shared_rows(0)
    T = len(seqs)
    levels = CascadeLevels(T, H // KVH, "cuda")
    plan = plan_levels(ends, levels.per_block, max_levels, levels.max_blocks)
    assert plan is not None and plan.levels.max() == max_levels and (plan.levels == 0).sum() == 3
    indptr = np.concatenate([[0], np.cumsum([len(s) for s in seqs])])
    levels.skip[:] = torch.tensor(plan.skip)
    levels.levels[:] = torch.tensor(plan.levels)
    levels.n_blocks[0] = plan.num_blocks
    levels.blocks[:plan.num_blocks] = torch.tensor(plan.table(indptr))
    levels.block_rows[:plan.num_blocks] = torch.tensor(plan.rows)
    g = torch.Generator("cuda").manual_seed(1)
    k = torch.randn(slots, KVH, D, generator=g, device="cuda").to(torch.bfloat16)
    v = torch.randn(slots, KVH, D, generator=g, device="cuda").to(torch.bfloat16)
    q = torch.randn(T, H, D, generator=g, device="cuda").to(torch.bfloat16)
    idx = torch.tensor(np.concatenate(seqs), dtype=torch.int32, device="cuda")
    ptr = torch.tensor(indptr, dtype=torch.int32, device="cuda")
    got = cascade_attention(q, k, v, idx, ptr, 0.1, softcap, levels).float()
    plain = decode_attention(q, k, v, idx, ptr, 0.1, None, softcap).float()
    assert (got - plain).abs().max() < 2e-2
    for i in range(0, T, 5):
        sl = idx[indptr[i]:indptr[i + 1]].long()
        kk, vv = (x[sl].float().repeat_interleave(H // KVH, 1) for x in (k, v))
        sc = torch.einsum("hd,khd->hk", q[i].float(), kk) * 0.1
        sc = softcap * torch.tanh(sc / softcap) if softcap else sc
        want = torch.einsum("hk,khd->hd", sc.softmax(-1), vv)
        assert (got[i] - want).abs().max() < 3e-2, (i, (got[i] - want).abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("whole", [False, True])
def test_cascade_decode_gives_the_tokens_of_plain_decode(tiny_graphed, dtype, whole, monkeypatch):
    """Greedy generation whose rows share 1, 2 and 3 levels (a few-shot prefix, middles, two samples of
    each question) and rows sharing none, in the decode graphs with and without cascade attention; `whole`:
    each (row, KV head) in one program, the levels merged in it, as in steps whose rows fill the GPU (where
    `--attention triton`, the default, attends with the levels too)."""
    from lmbatch.engine import cascade, graphs
    from lmbatch.kernels import decode_attention

    if whole:
        monkeypatch.setattr(decode_attention, "WHOLE_FROM", 0)

    def prompts(seed):
        g = random.Random(seed)
        base = [g.randrange(5, 120) for _ in range(150)]        # the tiny models' vocabulary: 128
        out = []
        for m in range(3):
            mid = base + [g.randrange(5, 120) for _ in range(40)]
            for q in range(4):          # a question of 20+ keys, then two samples of it (their own last keys)
                question = mid + [g.randrange(5, 120) for _ in range(20 + q)]
                out += [question + [g.randrange(5, 120) for _ in range(1 + c)] for c in range(2)]
        return out + [[g.randrange(5, 120) for _ in range(30 + j)] for j in range(5)]

    reqs = [GenerateRequest(p, SamplingParams(max_new_tokens=16, ignore_eos=True)) for p in prompts(3)]
    seen = []
    plan = cascade.plan_levels
    monkeypatch.setattr(graphs, "plan_levels", lambda *a: seen.append(plan(*a)) or seen[-1])

    def run(on):
        with monkeypatch.context() as m:
            if not on:      # plain decode in every bucket
                m.setattr(graphs.DecodeGraphs, "use_cascade", lambda self, every_step: None)
            eng = Engine.from_pretrained(tiny_graphed, device="cuda", dtype=dtype,
                                         attention="cascade" if on else "triton", max_running=64)
        assert (eng.model_runner.graphs.levels is not None) == on
        return eng, eng.generate(reqs)[0]

    (eng, plain), (_, shared) = run(False), run(True)
    assert max(int(p.levels.max()) for p in seen if p is not None) == 3
    if dtype == torch.float32:
        assert [a.token_ids for a in plain] == [b.token_ids for b in shared]
        return
    # bf16: another order of the same sums may flip a near-tie of these random models, and the row's
    # later tokens follow it; where a row first differs, both tokens score within a near-tie under plain.
    # A routed model's near-tie may be its router's: other experts, any gap (mixtral: 1.7 nats, H200)
    from lmbatch.requests import ScoreRequest

    routed = eng.cfg.num_experts > 0

    differ = 0
    for req, a, b in zip(reqs, plain, shared):
        if a.token_ids != b.token_ids:
            differ += 1
            j = next(i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y)
            ctx = list(req.prompt) + a.token_ids[:j]
            la, lb = (r.logprob for r in eng.score([ScoreRequest(ctx, [a.token_ids[j]]),
                                                    ScoreRequest(ctx, [b.token_ids[j]])])[0])
            assert routed or abs(la - lb) < 0.1, (j, la, lb)
    assert differ <= len(reqs) // 2, differ


@pytest.mark.parametrize("whole", [False, True])
def test_levels_made_from_the_last_steps_give_the_tokens_of_plain_decode(tmp_path, whole, monkeypatch):
    """Rows leave (each its own length) and join (more requests than rows) step after step: most steps take
    the last plan's levels (cascade.replan; a new row reads all its keys as its own), the others plan anew;
    float32 greedy tokens equal plain decode's."""
    from lmbatch.engine import cascade, graphs
    from lmbatch.kernels import decode_attention

    if whole:
        monkeypatch.setattr(decode_attention, "WHOLE_FROM", 0)
    make_tiny_hf("qwen3", tmp_path, hidden_size=256, head_dim=64)
    g = random.Random(7)
    base = [g.randrange(5, 120) for _ in range(120)]
    prompts = []
    for m in range(6):
        mid = base + [g.randrange(5, 120) for _ in range(30)]
        prompts += [mid + [g.randrange(5, 120) for _ in range(20 + q)] for q in range(10)]
    reqs = [GenerateRequest(p, SamplingParams(max_new_tokens=2 + g.randrange(20), ignore_eos=True)) for p in prompts]
    made = []
    monkeypatch.setattr(graphs, "replan", lambda *a: made.append(cascade.replan(*a)) or made[-1])
    got = Engine.from_pretrained(tmp_path, device="cuda", dtype=torch.float32, attention="cascade",
                                 max_running=24).generate(reqs)[0]
    assert sum(p is not None for p in made) >= 20 and sum(p is None for p in made) >= 2, len(made)
    monkeypatch.setattr(graphs.DecodeGraphs, "use_cascade", lambda self, every_step: None)   # plain decode
    want = Engine.from_pretrained(tmp_path, device="cuda", dtype=torch.float32, attention="triton",
                                  max_running=24).generate(reqs)[0]
    assert [r.token_ids for r in got] == [r.token_ids for r in want]


def test_cascade_bucket_whose_rows_share_nothing_replays_the_plain_graph(tmp_path):
    """A step of a cascade bucket with no shared level replays the bucket's plain-decode graph (captured then),
    and a step whose rows share levels its cascade graph: float32 tokens equal plain decode's either way."""
    make_tiny_hf("llama", tmp_path, hidden_size=256, head_dim=64)
    g = random.Random(5)
    alone = [[5 + j] + [g.randrange(5, 120) for _ in range(30 + j)] for j in range(40)]     # first keys differ
    shared = [[4] * 60 + [g.randrange(5, 120) for _ in range(10 + j)] for j in range(40)]
    for prompts, cascade in ((alone, False), (shared, True)):
        reqs = [GenerateRequest(p, SamplingParams(max_new_tokens=8, ignore_eos=True)) for p in prompts]
        eng = Engine.from_pretrained(tmp_path, device="cuda", dtype=torch.float32, attention="cascade", max_running=64)
        got = eng.generate(reqs)[0]
        graphs = eng.model_runner.graphs
        assert graphs is not None and graphs.levels is not None
        assert {c for (b, c) in graphs.graphs if b >= 40} >= {cascade}, sorted(graphs.graphs)
        want = Engine.from_pretrained(tmp_path, device="cuda", dtype=torch.float32, attention="triton",
                                      max_running=64).generate(reqs)[0]
        assert [r.token_ids for r in got] == [r.token_ids for r in want]


def test_graphs_captured_mid_run_leave_the_cache_alone(tmp_path, monkeypatch):
    """Buckets captured mid-run (here: only the largest ahead, the others as rows finish and the step
    shrinks into them) give the float32 tokens of graphs all captured before the first step (the same
    kernels a bucket): a capture's forwards store KV into the scratch slot, not into the slots of the
    tokens the last step wrote."""
    from lmbatch.engine import graphs

    make_tiny_hf("llama", tmp_path, hidden_size=256, head_dim=64)
    g = random.Random(7)
    reqs = [GenerateRequest([g.randrange(5, 120) for _ in range(20 + 3 * i)],
                            SamplingParams(max_new_tokens=4 + 2 * i, ignore_eos=True)) for i in range(24)]
    want = Engine.from_pretrained(tmp_path, device="cuda", dtype=torch.float32, attention="triton",
                                  max_running=32).generate(reqs)[0]
    captured = []
    original = graphs.DecodeGraphs._capture
    monkeypatch.setattr(graphs.DecodeGraphs, "capture_all",
                        lambda self: self._capture(self.buckets[-1], self._cascades(self.buckets[-1])))
    monkeypatch.setattr(graphs.DecodeGraphs, "_capture", lambda self, b, c: captured.append(b) or original(self, b, c))
    eng = Engine.from_pretrained(tmp_path, device="cuda", dtype=torch.float32, attention="triton", max_running=32)
    got = eng.generate(reqs)[0]
    assert len(set(captured)) >= 4, captured       # buckets met mid-run as the step shrank
    assert [r.token_ids for r in got] == [r.token_ids for r in want]


def test_a_wide_stream_captures_its_buckets_as_it_starts(tmp_path, monkeypatch):
    """An engine of 8 decode rows and 24 wide ones (EngineOptions.wide_rows) captures graphs up to 16 rows
    ahead (twice its rows, jump-forward's); a stream of WIDE_FROM generations or more captures the 24-row
    bucket as it starts and decodes its 24 requests in one round, with the float32 tokens and the forward
    passes of an engine of 24 rows."""
    import lmbatch.engine.stream

    make_tiny_hf("llama", tmp_path, hidden_size=256, head_dim=64)
    g = random.Random(3)
    reqs = [GenerateRequest([g.randrange(5, 120) for _ in range(10 + i)],
                            SamplingParams(max_new_tokens=6, ignore_eos=True)) for i in range(24)]
    want, want_stats = Engine.from_pretrained(tmp_path, device="cuda", dtype=torch.float32, attention="triton",
                                              max_running=24).generate(reqs)
    eng = Engine.from_pretrained(tmp_path, device="cuda", dtype=torch.float32, attention="triton", max_running=8,
                                 wide_rows=24)
    eng.model_runner.capture_graphs()
    assert eng.graphs.buckets[-1] == 24 and max(b for b, _ in eng.graphs.graphs) == 16
    monkeypatch.setattr(lmbatch.engine.stream, "WIDE_FROM", 24)
    got, stats = eng.generate(reqs)
    assert max(b for b, _ in eng.graphs.graphs) == 24
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert stats.forward_batches == want_stats.forward_batches


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe", "gemma2"])
def test_deterministic_engine_bits_do_not_depend_on_the_batch(tmp_path, kind):
    """bf16 on CUDA with --deterministic: scores and greedy / sampled tokens bit for bit the same across
    batch budgets, pools, the cache and decode rows (graphs on); the scores near the default mode's."""
    make_tiny_hf(kind, tmp_path, hidden_size=256, head_dim=64)
    g = random.Random(0)
    shared = [g.randrange(5, 120) for _ in range(150)]
    from lmbatch.requests import ScoreRequest

    score = [ScoreRequest(shared + [g.randrange(5, 120) for _ in range(5 + 9 * i)], [g.randrange(5, 120)])
             for i in range(12)]
    gen = [GenerateRequest(shared[:40 + 9 * i], SamplingParams(max_new_tokens=12, temperature=0.7 * (i % 2), seed=i,
                                                                ignore_eos=True)) for i in range(9)]
    got = []
    for kw in (dict(max_tokens_per_batch=4096), dict(max_tokens_per_batch=77, kv_cache_tokens=1024, max_running=3),
               dict(max_tokens_per_batch=300, cache=False)):
        eng = _engine(tmp_path, "triton", deterministic=True, **kw)
        got.append(([r.logprob for r in eng.score(score)[0]], [r.token_ids for r in eng.generate(gen)[0]]))
    assert got[1] == got[0] and got[2] == got[0]
    plain = [r.logprob for r in _engine(tmp_path, "triton").score(score)[0]]
    assert max(abs(a - b) for a, b in zip(plain, got[0][0])) < 0.05


@pytest.mark.parametrize("task", ["mmlu", "program", "arc_easy:mc,mmlu", "tot"])
def test_deterministic_runs_are_the_same_bits_on_cuda(tmp_path, task, monkeypatch):
    """tests/e2e/test_deterministic_runs.py in bf16 on CUDA (graphs on): MMLU, a sampling program, a suite
    and tree of thought give every logprob and token bit for bit the same across batch budgets, a pool,
    fcfs, two data-parallel workers (where two GPUs are visible) and a kill and resume."""
    import importlib.util
    from pathlib import Path

    from conftest import make_tiny_with_tokenizer

    spec = importlib.util.spec_from_file_location(
        "deterministic_runs", Path(__file__).parents[1] / "e2e" / "test_deterministic_runs.py")
    cpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cpu)
    monkeypatch.setattr(cpu, "ON", dict(device="cuda", dtype="bfloat16"))
    if torch.cuda.device_count() < 2:       # a worker a GPU: two workers need a machine of two
        monkeypatch.setattr(cpu, "VARIANTS", {k: v for k, v in cpu.VARIANTS.items() if k != "workers"})
    tiny = make_tiny_with_tokenizer(tmp_path / "tiny", 2048)
    if task == "tot":
        cpu.test_tree_of_thought_tokens_do_not_depend_on_the_batch(tiny, tmp_path)
        return
    program = tmp_path / "sampled.py"
    program.write_text(cpu.PROGRAM)
    cpu.test_every_bit_the_same_however_the_run_executes(tiny, program, tmp_path, task)
