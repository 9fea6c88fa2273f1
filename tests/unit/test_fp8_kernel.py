"""The block-scaled FP8 GEMM (kernels/fp8_gemm.py) on the CPU under Triton's interpreter, against model/fp8.py's
`reference` (the same products from the dequantized operands, float32): rows, outputs and inputs that are not
multiples of the tiles or the 128x128 scale blocks; the one-pass activation quantization (`quantize_rows`)
against `quantize_activations` (its scales and padding here, its values on the GPU) and its M-major scales
through the GEMM. The GPU suite runs it compiled (tests/gpu/test_quantized_gpu.py).
The interpreter is chosen when `triton.jit` runs (TRITON_INTERPRET=1 at import), so the cases run in a process
of their own."""
from pathlib import Path

from triton_interpreter import interpreted

SCRIPT = r'''
import json, sys
import torch

sys.path.insert(0, sys.argv[1])
from quantized_checkpoints import fp8_blocks
from lmbatch.kernels.fp8_gemm import block_fp8_gemm, quantize_rows
from lmbatch.model.fp8 import quantize_activations, reference

torch.manual_seed(0)
out, same = [], []
for m, n, k in [(1, 256, 256), (20, 320, 300), (70, 128, 384)]:
    x, w = torch.randn(m, k), torch.randn(n, k)
    wq, ws = fp8_blocks(w)
    xq, xs = quantize_activations(x, 128)
    got = block_fp8_gemm(xq, xs, wq, ws.contiguous(), (128, 128), torch.float32)
    want = reference(x, wq, ws, (128, 128))
    out.append([float((got - want).abs().max()), float(want.abs().max())])
    # the one-pass quantization: the same scales, rows padded to 16 with zeros, scales M-major (its e4m3
    # values are compared on the GPU: the interpreter's float32 -> e4m3 cast rounds 124.3 to 64)
    rq, rs = quantize_rows(x, 128)
    same.append([rq.shape[0] == -(-m // 16) * 16, rs.stride() == (1, rq.shape[0]), torch.equal(rs[:m], xs),
                 not rq[m:].float().any().item()])
    got = block_fp8_gemm(xq, rs[:m], wq, ws.contiguous(), (128, 128), torch.float32)
    out.append([float((got - want).abs().max()), float(want.abs().max())])
print(json.dumps([out, same]))
'''


def test_block_fp8_gemm_under_the_interpreter():
    out, same = interpreted(SCRIPT, str(Path(__file__).parents[1]), timeout=300)
    for worst, scale in out:
        assert worst < 1e-5 * scale * 10, (worst, scale)        # float32 sums in another order
    assert all(all(case) for case in same), same
