"""Issue 58's model_types on CUDA in bf16 (run on the GPU machine: `python -m pytest -m gpu`; the tensor-parallel
case needs two GPUs: `-m gpu2`). Each type on the path a run picks for it (Triton attention and decode graphs
for olmo3, smollm3, glm4_moe and gpt_oss, whose sinks the Triton kernels take; the torch backend for DeepSeek's
latent attention, `ModelConfig.torch_attention_only`) against the torch reference backend and transformers:
scores as close to transformers' float32 ones as transformers' own bf16 scores are, and within real margins of
the reference's (a routed model's in float32: bf16 routers flip experts on random weights' near-ties); greedy
tokens of the reference (a routed model's in float32 too); the sink kernels compiled against the reference; and the
grouped-GEMM MoE kernel running GLM's and DeepSeek's grouped sigmoid routing and gpt-oss's biased, clamped
experts as the CPU loop does."""
import copy
import random

import pytest
import torch

pytestmark = pytest.mark.gpu

from conftest import hf_scores, make_tiny_hf, random_requests  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from lmbatch.engine import Engine, EngineOptions  # noqa: E402
from lmbatch.model.config import ModelConfig  # noqa: E402
from lmbatch.model.network import MoE, Transformer  # noqa: E402
from lmbatch.model.weights import load_weights  # noqa: E402
from lmbatch.requests import GenerateRequest, SamplingParams  # noqa: E402

# sizes of the GPU kernels' usual shapes where the family has them (head_dim 64); DeepSeek's config derives its
# head_dim (its RoPE width) itself, so only its width grows
# gpt-oss's released clamp (7.0; the CPU tiny config's 1.0 clamps more): transformers before 5.24 fixes its
# experts' clamp at 7.0 whatever the config says, and the GPU machine's may be older
SIZES = {"olmo3": dict(hidden_size=256, head_dim=64), "smollm3": dict(hidden_size=256, head_dim=64),
         "glm4_moe": dict(hidden_size=256), "gpt_oss": dict(hidden_size=256, head_dim=64, swiglu_limit=7.0),
         "deepseek_v3": dict(hidden_size=256)}
ON_TORCH = {"deepseek_v3"}       # attention the GPU kernels do not compute yet
ROUTED = {"glm4_moe", "gpt_oss", "deepseek_v3"}


@pytest.fixture(scope="module", params=list(SIZES))
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    make_tiny_hf(request.param, path, **SIZES[request.param])
    return request.param, path


def _engine(path, attention=None, dtype=torch.bfloat16, **kw):
    extra = {"attention": attention} if attention else {}
    return Engine.from_pretrained(path, device="cuda", dtype=dtype, **extra, **kw)


def _hf(path, dtype):
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to("cuda").eval()


def test_the_run_picks_the_backend_the_model_has_kernels_for(tiny):
    kind, path = tiny
    eng = _engine(path)
    backend = type(eng.model_runner.attn).__name__
    assert backend == ("TorchBackend" if kind in ON_TORCH else "TritonBackend"), backend
    assert (eng.model_runner.graphs is None) == (kind in ON_TORCH)


def test_scores_against_transformers_and_reference(tiny):
    """bf16 scores agree with transformers' float32 ones at least as well as transformers' own bf16 scores,
    and with the torch reference backend's (prefill in chunks of 48 tokens over cached prefixes)."""
    kind, path = tiny
    reqs = random_requests(random.Random(0), 40)
    ref, _ = _engine(path, "torch").score(reqs)
    got, stats = _engine(path, max_tokens_per_batch=48).score(reqs)
    assert stats.computed_tokens == stats.unique_tokens
    exact = hf_scores(_hf(path, torch.float32), reqs)
    hf_bf16 = hf_scores(_hf(path, torch.bfloat16), reqs)
    tokens = sum(len(r.continuation) for r in reqs)
    ours_err = sum(abs(b.logprob - e) for b, e in zip(got, exact)) / tokens
    hf_err = sum(abs(h - e) for h, e in zip(hf_bf16, exact)) / tokens
    assert ours_err <= 1.1 * hf_err + 0.005, (kind, ours_err, hf_err)
    tol = 0.05
    if kind in ROUTED:      # bf16 routers flip experts on these weights' near-ties (gpt-oss: 0.65 nats on one
        # request, H200): each request against the reference path in float32, on the run's kernels
        tol = 1e-2          # Triton's dots round float32 inputs to tf32 (glm4_moe: 1.5e-4 a token from
        # transformers' float32 on average, H200)
        ref, _ = _engine(path, "torch", dtype=torch.float32).score(reqs)
        got, _ = _engine(path, None if kind in ON_TORCH else "triton", dtype=torch.float32,
                         max_tokens_per_batch=48).score(reqs)
    for req, a, b in zip(reqs, ref, got):
        assert abs(b.logprob - a.logprob) < tol * len(req.continuation), (kind, a.logprob, b.logprob)


@pytest.mark.parametrize("n", [1, 5, 13])
def test_greedy_decode_matches_reference(tiny, n):
    """The run's decode path (decode graphs where the model has them) gives the torch reference's greedy
    tokens; bf16: a GEMM of another shape may flip a near-tie in one row. A routed model's bf16 router flips
    experts on near-ties of these random weights (glm4_moe: 2 rows of 5 on an H200), and a row's later tokens
    follow, so there bf16 must give at least half the rows (of more than one) and float32 all but one in eight
    (every row of one)."""
    kind, path = tiny
    reqs = [GenerateRequest([3, 17, 42, 9, i] * (1 + i % 3), SamplingParams(max_new_tokens=12, ignore_eos=True))
            for i in range(n)]
    for dtype in (torch.bfloat16, torch.float32) if kind in ROUTED else (torch.bfloat16,):
        ref, _ = _engine(path, "torch", dtype=dtype).generate(reqs)
        # float32 attends on the torch backend by default: the Triton kernels and graphs asked for
        eng = _engine(path, "triton" if dtype == torch.float32 and kind not in ON_TORCH else None, dtype=dtype)
        got, _ = eng.generate(reqs)
        if kind not in ON_TORCH:
            assert eng.model_runner.graphs is not None and eng.model_runner.graphs.graphs, "no graph was captured"
        same = sum(a.token_ids == b.token_ids for a, b in zip(ref, got))
        # float32 on Triton: its dots round to tf32, so a near-tie may still flip one row in eight (none of
        # one). A routed model's single bf16 row is held by its float32 run alone: one flip is half the rows
        if kind in ROUTED and dtype == torch.bfloat16:
            need = -(-n // 2) if n > 1 else 0
        else:
            need = max(1, n - max(1, n // 8))
        assert same >= need, (kind, dtype, same, n)


@pytest.mark.parametrize("window", [None, 50])
@pytest.mark.parametrize("new", [1, 37])
def test_sink_kernels_match_the_reference(window, new):
    """The Triton backend with gpt-oss's sinks (split decode for one new token, else extend; bf16, head_dim 64)
    against the torch backend's sink attention on the same ragged batch."""
    from lmbatch.attention.base import ForwardBatch, make_backend
    from lmbatch.attention.kv_pool import KVPool

    g = torch.Generator("cuda").manual_seed(new)
    H, KVH, D, lens = 16, 2, 64, [1, 70, 300, 1000]
    sinks = (2 * torch.randn(H, generator=g, device="cuda") + 1).to(torch.bfloat16)
    outs = {}
    for name in ("torch", "triton"):
        pool = KVPool(4 * 2048, 1, KVH, D, torch.bfloat16, "cuda")      # a sequence's slots in its own 2,048
        pool.k.normal_(generator=torch.Generator("cuda").manual_seed(1))
        pool.v.normal_(generator=torch.Generator("cuda").manual_seed(2))
        qo, kv, seqs = [0], [0], []
        for i, n in enumerate(lens):
            seqs.append(torch.arange(i * 2048, i * 2048 + n + new))
            qo.append(qo[-1] + new)
            kv.append(kv[-1] + n + new)
        slots = torch.cat([s[-new:] for s in seqs])
        batch = ForwardBatch(torch.zeros(qo[-1], dtype=torch.long), torch.zeros(qo[-1], dtype=torch.long), slots, qo,
                             kv, torch.cat(seqs), torch.arange(qo[-1]))
        q = torch.randn(qo[-1], H, D, generator=torch.Generator("cuda").manual_seed(3), device="cuda")
        k = torch.randn(qo[-1], KVH, D, generator=torch.Generator("cuda").manual_seed(4), device="cuda")
        attn = make_backend(name, pool, H, D, 0.125)
        attn.plan(batch.to("cuda"))
        outs[name] = attn.forward(0, q.to(torch.bfloat16), k.to(torch.bfloat16), k.to(torch.bfloat16), window,
                                  sinks=sinks).float()
    ref, got = outs["torch"], outs["triton"]
    assert not got.isnan().any() and ((got - ref).norm() / ref.norm()) < 1e-2


@pytest.mark.parametrize("kind", ["glm4_moe", "gpt_oss", "deepseek_v3"])
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_moe_kernel_matches_the_loop(kind, rows, tmp_path):
    """A routed layer on CUDA (the grouped-GEMM kernel: routing weights in float32, gpt-oss's gate/up bias
    through the activation and its down bias after the sum) against the same layer on the CPU (one expert at
    a time), float32: the same routing, outputs to 1e-4."""
    make_tiny_hf(kind, tmp_path, hidden_size=256)
    cfg = ModelConfig.from_dir(tmp_path)
    model = Transformer(cfg)
    load_weights(model, tmp_path)
    layer = next(b.mlp for b in model.layers if isinstance(b.mlp, MoE))
    x = torch.randn(rows, cfg.hidden_size, generator=torch.Generator().manual_seed(rows))
    with torch.no_grad():
        want = layer(x)
        got = copy.deepcopy(layer).cuda()(x.cuda()).cpu()
    assert (got - want).abs().max() < 1e-4 * max(1.0, want.abs().max().item())


@pytest.mark.gpu2
@pytest.mark.parametrize("kind", ["olmo3", "glm4_moe", "gpt_oss", "deepseek_v3"])
def test_tensor_parallel_over_nccl(tmp_path, kind):
    """Two ranks over NCCL (float32, the torch backend) give one GPU's scores: OLMo's split q/k norms,
    shared experts, gpt-oss's sinks and biases added once, DeepSeek's heads split over a whole latent."""
    from lmbatch.engine.options import EngineSpec
    from lmbatch.engine.parallel import ParallelEngine

    assert torch.cuda.device_count() >= 2, "gpu2 tests need two GPUs"
    make_tiny_hf(kind, tmp_path, **SIZES[kind])
    cfg = ModelConfig.from_dir(tmp_path)
    reqs = random_requests(random.Random(0), 24, cfg.vocab_size)
    want, _ = Engine.from_pretrained(tmp_path, EngineOptions(kv_cache_tokens=4096), device="cuda",
                                     dtype=torch.float32).run(reqs)
    spec = EngineSpec(str(tmp_path), "cuda", "float32", EngineOptions(kv_cache_tokens=4096, max_tokens_per_batch=256),
                      tensor_parallel=2)
    engine = ParallelEngine(spec, cfg, gpus=["0", "1"])
    try:
        got, _ = engine.run(reqs)
    finally:
        engine.close()
    for a, b in zip(got, want):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4 * max(1, b.num_tokens))
