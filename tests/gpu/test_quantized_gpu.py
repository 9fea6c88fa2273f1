"""FP8 checkpoints on the GPU (pytest -m gpu): the FP8 GEMMs (kernels/fp8_gemm.py for 128x128 blocks, torch's
`_scaled_mm` for channel scales, model/fp8.py) against the same products from the dequantized operands and
against their dequantized bf16 form; a block-FP8 model's engine fitted to FP8 GEMMs on a GPU with FP8 tensor
cores, its scores against the dequantized engine's and transformers', its decode graphs against eager decode."""
import random

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, FineGrainedFP8Config

pytestmark = pytest.mark.gpu

from conftest import hf_scores, random_requests  # noqa: E402
from quantized_checkpoints import ct_checkpoint, fp8_block_checkpoint, fp8_blocks, fp8_scaled  # noqa: E402

from lmbatch.engine import Engine  # noqa: E402
from lmbatch.engine.build import fit  # noqa: E402
from lmbatch.engine.options import EngineOptions, EngineSpec  # noqa: E402
from lmbatch.model import fp8  # noqa: E402
from lmbatch.model.config import ModelConfig  # noqa: E402
from lmbatch.model.dequantize import scaled_fp8  # noqa: E402
from lmbatch.requests import GenerateRequest, SamplingParams  # noqa: E402

FP8_CORES = torch.cuda.get_device_capability() >= (8, 9)
needs_fp8 = pytest.mark.skipif(not FP8_CORES, reason="no FP8 tensor cores (compute capability < 8.9)")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@needs_fp8
@pytest.mark.parametrize("layout", ["block", "channel"])
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_fp8_gemm_against_its_dequantized_forms(layout, rows, monkeypatch):
    torch.manual_seed(rows)
    n, k = 576, 384                 # 4.5 blocks of outputs: the last block short
    w = 0.05 * torch.randn(n, k)
    wq, ws = fp8_blocks(w) if layout == "block" else fp8_scaled(w, per_channel=True)
    block = (128, 128) if layout == "block" else (1, k)
    wq, ws = wq.cuda(), ws.float().cuda().contiguous()
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    want = fp8.reference(x.float(), wq, ws, block)      # before the GPU path is barred from it
    monkeypatch.setattr(fp8, "reference", lambda *a: pytest.fail("the GPU ran the reference GEMM"))
    got = fp8.linear(x, wq, ws, block)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    assert _rel(got, want) < 0.01           # the same products: the sums' order and bf16 rounding apart
    plain = F.linear(x, scaled_fp8(wq, ws, block, torch.bfloat16))
    assert _rel(got, plain) < 0.04          # the activations' FP8 rounding (~2.6% here) apart


@needs_fp8
@pytest.mark.parametrize("rows", [1, 37, 300])
def test_one_pass_quantization_and_cublas_block_gemm(rows):
    """kernels/fp8_gemm.quantize_rows gives quantize_activations' bits (rows padded to 16 with zeros), and
    the block-scaled GEMM runs on cuBLAS where the scale grids' sides are multiples of 4 (N, K multiples of 512)
    and on the Triton kernel elsewhere (K 384: cuBLAS misread the last block's scales), to the same products."""
    from lmbatch.kernels import fp8_gemm

    torch.manual_seed(rows)
    assert fp8_gemm.cublas_block_scaled(), "torch's _scaled_mm took no block scales here"
    for k in (384, 1024):
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16) * 3
        q, s = fp8.quantize_activations(x, 128)
        rq, rs = fp8_gemm.quantize_rows(x, 128)
        assert torch.equal(rq[:rows].view(torch.uint8), q.view(torch.uint8)) and torch.equal(rs[:rows], s)
        assert not rq[rows:].float().any()
        wq, ws = fp8_blocks(0.05 * torch.randn(512, k))
        wq, ws = wq.cuda(), ws.cuda().contiguous()
        got = fp8.linear(x, wq, ws, (128, 128))
        triton = fp8_gemm.block_fp8_gemm(q, s, wq, ws, (128, 128), torch.bfloat16)
        assert _rel(got, triton) < 0.01 and _rel(got, fp8.reference(x.float(), wq, ws, (128, 128))) < 0.01, k


@needs_fp8
def test_fp8_gemm_runs_in_decode_graphs():
    """The activations' quantization and the GEMM capture as a CUDA graph (no host synchronization)."""
    wq, ws = fp8_blocks(0.05 * torch.randn(256, 256))
    wq, ws = wq.cuda(), ws.cuda().contiguous()
    x = torch.randn(16, 256, device="cuda", dtype=torch.bfloat16)
    eager = fp8.linear(x, wq, ws, (128, 128))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8.linear(x, wq, ws, (128, 128))
    graph.replay()
    assert torch.equal(out, eager)


@needs_fp8
@pytest.mark.parametrize("kind", ["block", "ct"])
def test_fp8_engine_scores(tmp_path, kind):
    """Fitted on this GPU the engine runs FP8 GEMMs; its scores are the dequantized engine's within the
    activations' rounding, and the dequantized engine's are transformers' (float32, dequantized) within bf16's."""
    path = fp8_block_checkpoint(tmp_path, "qwen3") if kind == "block" else ct_checkpoint(tmp_path)[0]
    spec, _ = fit(EngineSpec(str(path), "cuda"), ModelConfig.from_dir(path))
    assert spec.options.fp8_gemm is True
    reqs = random_requests(random.Random(0), 30)
    tokens = sum(len(r.continuation) for r in reqs)
    engine = Engine.from_pretrained(path, EngineOptions(fp8_gemm=True), device="cuda", dtype=torch.bfloat16)
    assert sum(p.dtype == torch.float8_e4m3fn for p in engine.model.parameters()) == 8
    got, _ = engine.score(reqs)
    plain, _ = Engine.from_pretrained(path, EngineOptions(fp8_gemm=False), device="cuda",
                                      dtype=torch.bfloat16).score(reqs)
    quant = FineGrainedFP8Config(dequantize=True) if kind == "block" else None
    hf = AutoModelForCausalLM.from_pretrained(path if kind == "block" else tmp_path / "ref", dtype=torch.float32,
                                              quantization_config=quant).to("cuda").eval()
    exact = hf_scores(hf, reqs)
    plain_err = sum(abs(p.logprob - e) for p, e in zip(plain, exact)) / tokens
    fp8_err = sum(abs(g.logprob - p.logprob) for g, p in zip(got, plain)) / tokens
    assert plain_err < 0.02, plain_err
    assert fp8_err < 0.15, fp8_err          # random weights: ~0.08 nats a token on the CPU's reference GEMM


@needs_fp8
def test_fp8_engine_decode_graphs_match_eager(tmp_path):
    path = fp8_block_checkpoint(tmp_path, "qwen3")
    reqs = [GenerateRequest([3, 17, 42, 9, i], SamplingParams(max_new_tokens=8, ignore_eos=True)) for i in range(5)]
    graphed, _ = Engine.from_pretrained(path, EngineOptions(fp8_gemm=True), device="cuda",
                                        dtype=torch.bfloat16).generate(reqs)
    eager, _ = Engine.from_pretrained(path, EngineOptions(fp8_gemm=True, cuda_graphs=False), device="cuda",
                                      dtype=torch.bfloat16).generate(reqs)
    assert sum(a.token_ids == b.token_ids for a, b in zip(graphed, eager)) >= 4  # bf16: an argmax tie may flip one
