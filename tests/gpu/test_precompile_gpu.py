"""The helpers' kernels are the engine's (engine/precompile.py): after helpers compiled a fitted spec's
decode graphs and sampler into a new Triton cache, a fresh process capturing every graph of that spec and
sampling compiles nothing more (run on the GPU machine: pytest -m gpu)."""
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

from conftest import make_tiny_hf  # noqa: E402

from lmbatch.engine import precompile  # noqa: E402
from lmbatch.engine.build import fit  # noqa: E402
from lmbatch.engine.options import EngineOptions, EngineSpec  # noqa: E402
from lmbatch.model.checkpoint import model_config  # noqa: E402

ENGINE = """
import pickle, sys, torch
from lmbatch.engine.engine import Engine, Weights
from lmbatch.engine.sampling import sample_on_device
from lmbatch.requests import SamplingParams
spec = pickle.load(open(sys.argv[1], "rb"))
eng = Engine.from_pretrained(spec.model_dir, spec.options, device="cuda", dtype=getattr(torch, spec.dtype),
                             weights=Weights("dummy"))
g = eng.model_runner.graphs
with torch.inference_mode():
    g.capture_all()
    for v in g.variants():
        if v not in g.graphs:
            g._capture(*v)
    logits = torch.zeros(3, eng.cfg.vocab_size, device="cuda")
    sample_on_device(logits, [SamplingParams(temperature=0.5)] * 3, [0, 1, 2])
torch.cuda.synchronize()
print(sorted(g.graphs))
"""


def _kernels(cache: Path) -> set[str]:
    return {str(f.relative_to(cache)) for f in cache.rglob("*.json")}


@pytest.mark.parametrize("kind, attention", [("llama", "auto"), ("gemma2", "auto"), ("qwen3", "cascade")])
def test_precompiled_kernels_are_the_ones_the_engine_loads(tmp_path, monkeypatch, kind, attention):
    model = tmp_path / "m"
    make_tiny_hf(kind, model, hidden_size=256, head_dim=64)
    cache = tmp_path / "triton"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    cfg = model_config(model)
    spec, _ = fit(EngineSpec(str(model), "cuda", "bfloat16", EngineOptions(kv_cache_tokens=8192, attention=attention)),
                  cfg)
    helpers = precompile.Precompile(spec, count=3)
    procs = list(helpers.procs)
    helpers.go(spec, cfg)
    assert [p.wait(timeout=300) for p in procs] == [0, 0, 0]
    made = _kernels(cache)
    names = {Path(k).name for k in made}
    assert {"_whole_kernel.json", "_split_kernel.json", "_gumbel_argmax_kernel.json"} <= names, names
    (tmp_path / "spec.pkl").write_bytes(pickle.dumps(spec))
    out = subprocess.run([sys.executable, "-c", ENGINE, str(tmp_path / "spec.pkl")], env=os.environ.copy(),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert _kernels(cache) == made, sorted(_kernels(cache) - made)
