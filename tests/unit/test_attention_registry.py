"""An attention backend is its module and one registry entry (lmbatch/attention/registry.py): the run's
choice of backend, the engine's refusals and its decode graphs read the entry's fields, never the names of
the backends there are (issue 59)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import make_tiny_hf

from lmbatch.attention import registry
from lmbatch.attention.registry import REGISTRY, Entry, able
from lmbatch.engine import build
from lmbatch.errors import UserError
from lmbatch.model.config import ModelConfig

ROOT = Path(__file__).resolve().parents[2]


def test_no_module_names_a_backend_but_the_registry():
    """Outside the registry only FlashInfer's own rule names a backend (auto takes it where its kernels for
    the model are built already, lmbatch/attention/gpu.py's flashinfer_built)."""
    names = "|".join(n for n in REGISTRY if n != "flashinfer")
    for path in ("lmbatch/engine/build.py", "lmbatch/engine/model_runner.py", "lmbatch/attention/base.py"):
        code = (ROOT / path).read_text()
        assert not re.search(rf'"({names})"', code), path


def _cfg(tmp_path, kind):
    make_tiny_hf(kind, tmp_path / kind)
    return ModelConfig.from_dir(tmp_path / kind)


def test_a_new_entry_is_all_a_backend_needs(tmp_path, monkeypatch):
    """A backend registered with its capabilities is taken, and refused, as they say."""
    mine = Entry("lmbatch.attention.torch_ref", "TorchBackend", cuda=True, sinks=True, deterministic=True)
    monkeypatch.setitem(REGISTRY, "mine", mine)
    monkeypatch.setattr(build, "ATTENTION", (*build.ATTENTION, "mine"))
    llama, gpt_oss, deepseek = (_cfg(tmp_path, k) for k in ("llama", "gpt_oss", "deepseek_v3"))
    assert build.pick_attention("mine", "cuda", "bfloat16", llama) == ("mine", "asked for")
    assert build.pick_attention("mine", "cuda", "bfloat16", gpt_oss).name == "mine"       # it has sinks
    for device, dtype, cfg, why in (("cpu", "float32", llama, "needs CUDA"), ("cuda", "float32", llama, "float32"),
                                    ("cuda", "bfloat16", deepseek, "latent attention")):
        with pytest.raises(UserError, match=why):
            build.pick_attention("mine", device, dtype, cfg)
    monkeypatch.setitem(REGISTRY, "mine", Entry("m", "C", cuda=False, float32=True, latent=True, graphs=False))
    assert build.pick_attention("mine", "cpu", "float32", llama) == ("mine", "asked for")
    assert build.pick_attention("mine", "cuda", "bfloat16", deepseek) == ("mine", "asked for")
    with pytest.raises(UserError, match=f"only the {able('sinks')} backends"):
        build.pick_attention("mine", "cuda", "bfloat16", gpt_oss)


def test_what_the_backends_there_are_can_do():
    assert able("sinks") == "triton and torch" and able("deterministic") == "triton and torch"
    assert [n for n, e in REGISTRY.items() if not e.cuda] == [registry.REFERENCE]
    assert REGISTRY[registry.DEFAULT_CUDA].cuda and REGISTRY[registry.DEFAULT_CUDA].deterministic
    assert {n: e.levels for n, e in REGISTRY.items()} == {"flashinfer": "never", "triton": "large",
                                                          "cascade": "every", "torch": "never"}
