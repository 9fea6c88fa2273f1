"""Broken model folders and a program file whose instances() raises, as users met them: `lmbatch run`
prints one line, `error: ...`, exits with code 2 and shows no traceback; a broken model folder is
refused before the task's data is loaded. The first cases run the console script in a child process
(its real stderr and exit code); a small random Llama with a trained tokenizer is built once and copied.

Then, through typer's CliRunner: model folders whose JSON files, tokenizer.json or shapes are wrong
(our own checks before any library reads them: `lmbatch run` and the lm-eval backend's `pretrained=`),
and `lmbatch lm-eval`'s bad inputs (no --tasks, unknown tasks, a Hub task while offline, bad
--model_args); the shape check against every tiny family and the embedded model (no false alarm)."""
from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import TINY_CONFIGS, make_tiny_hf, make_tiny_with_tokenizer
from typer.testing import CliRunner

from lmbatch.cli import app
from lmbatch.errors import UserError
from lmbatch.model.checkpoint import resolve_model
from lmbatch.model.embedded import embedded_model_dir

# the task: one instance, whose loading leaves a mark next to the program file
PROGRAM = '''from pathlib import Path
from lmbatch.frontend import select

def instances():
    Path(__file__).with_name("instances-called").touch()
    return [{"id": "a", "text": "The answer is"}]

def program(s, text):
    s += text + select("c", [" yes", " no"])
'''
RAISING = '''def instances():
    raise ValueError("boom")

def program(s):
    pass
'''


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return make_tiny_with_tokenizer(tmp_path_factory.mktemp("good"), 2048)


def _config(**changes):
    def edit(d):
        cfg = json.loads((d / "config.json").read_text())
        cfg.update(changes)
        (d / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))
    return edit


def _weights(make):
    def edit(d):
        (d / "model.safetensors").write_bytes(make((d / "model.safetensors").read_bytes()))
    return edit


def _no_weights(d):
    (d / "model.safetensors").unlink()


def _no_tokenizer(d):
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (d / f).unlink(missing_ok=True)


def _not_json(d):
    (d / "config.json").write_text('{"model_type": "llama", "hidden_size": 64,')


CASES = {   # id: (how the good folder is broken, what the one line says after "model at DIR")
    "layers-not-int": (_config(num_hidden_layers="thirty"),
                       ": config.json: num_hidden_layers must be an integer, got 'thirty'"),
    "no-hidden-size": (_config(hidden_size=None), ": config.json: hidden_size is missing"),
    "no-safetensors": (_no_weights, " has no *.safetensors weights"),
    "truncated-header": (_weights(lambda b: b[:100]),
                         ": model.safetensors is not a readable safetensors file (its header length"),
    "truncated-data": (_weights(lambda b: b[:len(b) // 2]),
                       ": model.safetensors is not a readable safetensors file (its tensors need"),
    "random-bytes": (_weights(lambda b: random.Random(0).randbytes(len(b))),
                     ": model.safetensors is not a readable safetensors file ("),
    "git-lfs-pointer": (_weights(lambda b: b"version https://git-lfs.github.com/spec/v1\noid sha256:0\nsize 9\n"),
                        ": model.safetensors is not a readable safetensors file (it is a Git LFS pointer"),
    "no-tokenizer": (_no_tokenizer, " has no tokenizer files (tokenizer.json or tokenizer_config.json)"),
    "config-not-json": (_not_json, ": config.json is not readable JSON ("),
}


def _run(task, model, out):
    cmd = [sys.executable, "-c", "from lmbatch.cli import main; main()", "run", str(task), "--model", str(model),
           "--device", "cpu", "--limit", "1", "--out", str(out), "--run-id", "r", "--quiet"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def _one_error_line(res) -> str:
    assert res.returncode == 2, res.stdout + res.stderr
    assert "Traceback" not in res.stdout + res.stderr, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[-1].startswith("error: "), res.stderr
    assert not res.stdout.strip(), res.stdout
    return lines[0]


@pytest.mark.parametrize("case", list(CASES))
def test_broken_model_folder_is_one_line_before_the_data(good, tmp_path, case):
    break_it, says = CASES[case]
    model = tmp_path / "model"
    shutil.copytree(good, model)
    break_it(model)
    (tmp_path / "task.py").write_text(PROGRAM)
    line = _one_error_line(_run(tmp_path / "task.py", model, tmp_path / "out"))
    assert line.startswith((f"error: model at {model}{says}", f"error: model at {model.resolve()}{says}")), line
    assert not (tmp_path / "instances-called").exists(), "the data was loaded before the model was checked"
    assert not (tmp_path / "out" / "r").exists()


def test_program_file_whose_instances_raise(good, tmp_path):
    (tmp_path / "prog.py").write_text(RAISING)
    line = _one_error_line(_run(tmp_path / "prog.py", good, tmp_path / "out"))
    assert line == f"error: {tmp_path / 'prog.py'}: instances() raised ValueError: boom", line


def test_the_good_folder_runs(good, tmp_path):
    """The cases' folder unbroken, and the task: the errors above are theirs alone."""
    (tmp_path / "task.py").write_text(PROGRAM)
    res = _run(tmp_path / "task.py", good, tmp_path / "out")
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "instances-called").exists() and (tmp_path / "out" / "r" / "summary.json").is_file()


def test_program_file_whose_instances_are_not_a_list(good, tmp_path):
    (tmp_path / "prog.py").write_text("def instances():\n    return None\n\ndef program(s):\n    pass\n")
    line = _one_error_line(_run(tmp_path / "prog.py", good, tmp_path / "out"))
    assert line == f"error: {tmp_path / 'prog.py'}: instances() must return a list of dicts, got NoneType", line



# ---- model folders: JSON files, tokenizer.json and shapes, checked by our own code (CliRunner) ------------
def _cli(*args) -> tuple[int, str, str]:
    r = CliRunner().invoke(app, [str(a) for a in args])
    return r.exit_code, r.stdout, r.stderr


def _one_line(code: int, stdout: str, stderr: str) -> str:
    assert code == 2, stdout + stderr
    assert "Traceback" not in stdout + stderr, stderr
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    return lines[0]


def _file(name, make):
    def edit(d):
        (d / name).write_bytes(make((d / name).read_bytes()))
    return edit


def _write(name, text):
    def edit(d):
        (d / name).write_text(text)
    return edit


def _tensors(edit_names):
    """Rewrite model.safetensors with some tensors left out (edit_names: names -> names kept)."""
    def edit(d):
        from safetensors.torch import load_file, save_file

        tensors = load_file(str(d / "model.safetensors"))
        save_file({k: tensors[k] for k in edit_names(sorted(tensors))}, str(d / "model.safetensors"),
                  metadata={"format": "pt"})
    return edit


def _extra_tensor(name):
    """Rewrite model.safetensors with one more tensor, named `name`."""
    def edit(d):
        import torch
        from safetensors.torch import load_file, save_file

        tensors = load_file(str(d / "model.safetensors"))
        save_file({**tensors, name: torch.zeros(4)}, str(d / "model.safetensors"), metadata={"format": "pt"})
    return edit


def _index(weight_map):
    def edit(d):
        from safetensors import safe_open

        with safe_open(str(d / "model.safetensors"), "np") as f:
            names = list(f.keys())
        (d / "model.safetensors.index.json").write_text(weight_map(names))
    return edit


def _half(b: bytes) -> bytes:
    return b[:len(b) // 2]


# id: (how the good folder is broken, the one line after "error: model at DIR"); the good folder is a
# tied llama: vocab 2048, hidden 64, intermediate 128, 2 layers, 4 heads and 2 KV heads of head_dim 16
FOLDER_CASES = {
    "tokenizer-json-truncated": (_file("tokenizer.json", _half),
                                 ": tokenizer.json is not readable JSON (Expecting "),
    "tokenizer-json-not-object": (_write("tokenizer.json", "[1, 2]"),
                                  ": tokenizer.json is not a JSON object (it holds a list)"),
    "tokenizer-json-not-a-tokenizer": (_write("tokenizer.json", '{"model": {"type": "BPE"}}'),
                                       ": tokenizer.json does not load as a tokenizer (Missing vocab/merges"),
    "tokenizer-config-truncated": (_file("tokenizer_config.json", _half),
                                   ": tokenizer_config.json is not readable JSON ("),
    "special-tokens-map-not-json": (_write("special_tokens_map.json", "{'bos_token': '<s>'}"),
                                    ": special_tokens_map.json is not readable JSON (Expecting property name"),
    "generation-config-truncated": (_file("generation_config.json", _half),
                                    ": generation_config.json is not readable JSON ("),
    "config-not-object": (_write("config.json", '["llama"]'), ": config.json is not a JSON object (it holds a list)"),
    "index-truncated": (_index(lambda names: json.dumps({"weight_map": {n: "model.safetensors" for n in names}})[:40]),
                        ": model.safetensors.index.json is not readable JSON ("),
    "index-without-weight-map": (_index(lambda names: '{"metadata": {}}'),
                                 ": model.safetensors.index.json has no weight_map of tensor names to shard files"),
    "vocab-size": (_config(vocab_size=1000), ": config.json vocab_size is 1000 but model.safetensors has 2048 rows "
                                             "in model.embed_tokens.weight"),
    "hidden-size": (_config(hidden_size=128), ": config.json hidden_size is 128 but model.safetensors has 64 columns "
                                              "in model.embed_tokens.weight"),
    "more-layers": (_config(num_hidden_layers=3), ": config.json num_hidden_layers is 3 but model.safetensors holds 2 "
                                                  "layers (model.layers.0 to model.layers.1)"),
    "fewer-layers": (_config(num_hidden_layers=1), ": config.json num_hidden_layers is 1 but model.safetensors holds 2 "
                                                   "layers (model.layers.0 to model.layers.1)"),
    "layer-missing": (_tensors(lambda names: [n for n in names if not n.startswith("model.layers.0.")]),
                      ": config.json num_hidden_layers is 2 but model.safetensors holds no tensors of layer 0 "
                      "(model.layers.0.*)"),
    "projection-missing": (_tensors(lambda names: [n for n in names if n != "model.layers.1.self_attn.v_proj.weight"]),
                           ": there is no model.layers.1.self_attn.v_proj.weight in model.safetensors"),
    "attention-heads": (_config(num_attention_heads=8),
                        ": config.json num_attention_heads x head_dim is 8 x 16 = 128 but model.safetensors has 64 "
                        "rows in model.layers.0.self_attn.q_proj.weight"),
    "kv-heads": (_config(num_key_value_heads=4),
                 ": config.json num_key_value_heads x head_dim is 4 x 16 = 64 but model.safetensors has 32 rows in "
                 "model.layers.0.self_attn.k_proj.weight"),
    "head-dim": (_config(head_dim=32), ": config.json num_attention_heads x head_dim is 4 x 32 = 128 but "
                                       "model.safetensors has 64 rows in model.layers.0.self_attn.q_proj.weight"),
    "intermediate-size": (_config(intermediate_size=256),
                          ": config.json intermediate_size is 256 but model.safetensors has 128 rows in "
                          "model.layers.0.mlp.gate_proj.weight"),
    # issue 47: these failed as a KeyError's traceback once the weights were read (17 s into the run)
    "tensor-with-no-place": (_extra_tensor("model.layers.0.mlp.extra.weight"),
                             ": model.safetensors holds model.layers.0.mlp.extra.weight, which a llama model of this "
                             "config.json has no place for"),
    "norm-missing": (_tensors(lambda names: [n for n in names if n != "model.layers.1.input_layernorm.weight"]),
                     ": model.safetensors has no tensor for the model's layers.1.input_layernorm.weight"),
    "untied-without-lm-head": (_config(tie_word_embeddings=False),
                               ": config.json tie_word_embeddings is false but there is no lm_head.weight in "
                               "model.safetensors"),
}


def _broken(good, tmp_path, case, cases) -> Path:
    model = tmp_path / "model"
    shutil.copytree(good, model)
    cases[case][0](model)
    return model


@pytest.mark.parametrize("case", list(FOLDER_CASES))
def test_lmbatch_run_refuses_a_broken_folder_in_one_line(good, tmp_path, case):
    model, out = _broken(good, tmp_path, case, FOLDER_CASES), tmp_path / "out"
    line = _one_line(*_cli("run", "mmlu", "--limit", 1, "--subjects", "anatomy", "--model", model, "--out", out))
    assert line.startswith(f"error: model at {model.resolve()}{FOLDER_CASES[case][1]}"), line
    assert not out.exists() or not any(out.iterdir())


# the same folders as the lm-eval backend's pretrained= (a few: the check is the same code)
@pytest.mark.parametrize("case", ["tokenizer-json-truncated", "vocab-size", "more-layers", "kv-heads",
                                  "index-truncated"])
def test_lm_eval_refuses_a_broken_pretrained_folder_in_one_line(good, task_dir, tmp_path, case):
    model, out = _broken(good, tmp_path, case, FOLDER_CASES), tmp_path / "out"
    line = _one_line(*_cli("lm-eval", "--model_args", f"pretrained={model}", "--tasks", "hellaswag_offline",
                           "--include_path", task_dir, "--limit", 1, "--output_path", out))
    assert line.startswith(f"error: model at {model.resolve()}{FOLDER_CASES[case][1]}"), line
    assert not out.exists()


# ---- every native family's layout: the shape check finds what is wrong, and no false alarm ---------------
FAMILY_CASES = {   # (family, config changes, the line after "model at DIR: config.json ")
    "qwen3-head-dim-by-q-norm": ("qwen3", {"head_dim": 16},
                                 "head_dim is 16 but model.safetensors has 24 entries in "
                                 "model.layers.0.self_attn.q_norm.weight"),
    "phi3-fused-qkv": ("phi3", {"num_key_value_heads": 4},
                       "(num_attention_heads + 2 x num_key_value_heads) x head_dim (hidden_size / num_attention_heads)"
                       " is (4 + 2 x 4) x 16 = 192 but model.safetensors has 128 rows in "
                       "model.layers.0.self_attn.qkv_proj.weight"),
    "phi3-fused-gate-up": ("phi3", {"intermediate_size": 100},
                           "2 x intermediate_size is 2 x 100 = 200 but model.safetensors has 320 rows in "
                           "model.layers.0.mlp.gate_up_proj.weight"),
    "qwen3-moe-experts": ("qwen3_moe", {"num_local_experts": 8},
                          "num_local_experts is 8 but model.safetensors has 4 rows (experts) in "
                          "model.layers.0.mlp.gate.weight"),
    "qwen3-moe-expert-size": ("qwen3_moe", {"moe_intermediate_size": 40},
                              "moe_intermediate_size is 40 but model.safetensors has 48 rows in "
                              "model.layers.0.mlp.experts.0.gate_proj.weight"),
    "qwen3-moe-dense-layer": ("qwen3_moe", {"intermediate_size": 100},
                              "intermediate_size is 100 but model.safetensors has 160 rows in "
                              "model.layers.1.mlp.gate_proj.weight"),
    "mixtral-experts": ("mixtral", {"num_local_experts": 2},
                        "num_local_experts is 2 but model.safetensors has 4 rows (experts) in "
                        "model.layers.0.block_sparse_moe.gate.weight"),
    "mixtral-expert-size": ("mixtral", {"intermediate_size": 100},
                            "intermediate_size is 100 but model.safetensors has 160 rows in "
                            "model.layers.0.block_sparse_moe.experts.0.w1.weight"),
    "olmo2-kv-heads": ("olmo2", {"num_key_value_heads": 4},
                       "num_key_value_heads x head_dim (hidden_size / num_attention_heads) is 4 x 16 = 64 but "
                       "model.safetensors has 32 rows in model.layers.0.self_attn.k_proj.weight"),
    "gemma2-vocab": ("gemma2", {"vocab_size": 100},
                     "vocab_size is 100 but model.safetensors has 128 rows in model.embed_tokens.weight"),
    "gemma3-layers": ("gemma3_text", {"num_hidden_layers": 4, "layer_types": None},
                      "num_hidden_layers is 4 but model.safetensors holds 2 layers (model.layers.0 to "
                      "model.layers.1)"),
    "mistral-head-dim": ("mistral", {"head_dim": 8},
                         "num_attention_heads x head_dim is 4 x 8 = 32 but model.safetensors has 64 rows in "
                         "model.layers.0.self_attn.q_proj.weight"),
    "qwen2-layers": ("qwen2", {"num_hidden_layers": 1, "layer_types": None},
                     "num_hidden_layers is 1 but model.safetensors holds 2 layers (model.layers.0 to model.layers.1)"),
    "gpt-oss-experts": ("gpt_oss", {"num_local_experts": 8},
                        "num_local_experts is 8 but model.safetensors has 4 rows (experts) in "
                        "model.layers.0.mlp.router.weight"),
    "deepseek-v3-kv-lora-rank": ("deepseek_v3", {"kv_lora_rank": 16},
                                 "kv_lora_rank + qk_rope_head_dim is 16 + 8 = 24 but model.safetensors has 40 rows in "
                                 "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"),
    "deepseek-v3-v-head-dim": ("deepseek_v3", {"v_head_dim": 16},
                               "num_attention_heads x (qk_nope_head_dim + v_head_dim) is 4 x (16 + 16) = 128 but "
                               "model.safetensors has 112 rows in model.layers.0.self_attn.kv_b_proj.weight"),
    "glm4-moe-shared-experts": ("glm4_moe", {"n_shared_experts": 2},
                                "n_shared_experts x moe_intermediate_size is 64 but model.safetensors has 32 rows in "
                                "model.layers.1.mlp.shared_experts.gate_proj.weight"),
    "glm4-moe-experts": ("glm4_moe", {"n_routed_experts": 4},
                         "n_routed_experts is 4 but model.safetensors has 8 rows (experts) in "
                         "model.layers.1.mlp.gate.weight"),
}


def _sharded(d):
    """model.safetensors split in two shards (embeddings and layer 0; the rest), with their index."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(d / "model.safetensors"))
    (d / "model.safetensors").unlink()
    first = {k for k in tensors if not k.startswith("model.layers.") or k.startswith("model.layers.0.")}
    shards = {"model-00001-of-00002.safetensors": sorted(first),
              "model-00002-of-00002.safetensors": sorted(set(tensors) - first)}
    for file, names in shards.items():
        save_file({k: tensors[k] for k in names}, str(d / file), metadata={"format": "pt"})
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: file for file, names in shards.items() for k in names}}))


def test_a_sharded_checkpoint_is_checked_over_its_shards(good, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(good, model)
    _sharded(model)
    assert resolve_model(str(model)) == model.resolve()
    _config(num_hidden_layers=3)(model)
    with pytest.raises(UserError) as e:
        resolve_model(str(model))
    assert str(e.value) == (f"model at {model}: config.json num_hidden_layers is 3 but the shards of "
                            f"model.safetensors.index.json hold 2 layers (model.layers.0 to model.layers.1)")
    _config(num_hidden_layers=2, intermediate_size=64)(model)
    with pytest.raises(UserError) as e:
        resolve_model(str(model))
    assert str(e.value) == (f"model at {model}: config.json intermediate_size is 64 but "
                            f"model-00001-of-00002.safetensors has 128 rows in model.layers.0.mlp.gate_proj.weight")


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    for kind in TINY_CONFIGS:
        make_tiny_hf(kind, root / kind)
    return root


@pytest.mark.parametrize("case", list(FAMILY_CASES))
def test_each_family_layout_is_checked(families, tmp_path, case):
    kind, changes, says = FAMILY_CASES[case]
    model = tmp_path / kind
    shutil.copytree(families / kind, model)
    _config(**changes)(model)
    with pytest.raises(UserError) as e:
        resolve_model(str(model))
    assert str(e.value) == f"model at {model}: config.json {says}"


@pytest.mark.parametrize("kind", list(TINY_CONFIGS))
def test_every_tiny_family_passes_the_shape_check(families, kind):
    from lmbatch.model.checkpoint import _check_weights
    from lmbatch.model.config import ModelConfig
    from lmbatch.model.shapes import shape_problem

    folder = families / kind
    raw = json.loads((folder / "config.json").read_text())
    tensors, where = _check_weights(folder, native=True)
    assert len(tensors) > 10 and where == "model.safetensors"
    assert shape_problem(ModelConfig.from_json(raw), raw, tensors, where) is None
    assert resolve_model(str(folder)) == folder.resolve()


def test_multi_token_prediction_layers_are_skipped(families, tmp_path):
    """GLM-4.5's and DeepSeek-V3's checkpoints store their multi-token-prediction layers after the decoder's
    (layers num_hidden_layers on, as many as num_nextn_predict_layers): they pass the checks and are not
    loaded, as transformers skips them; a layer past those is still one the config does not have."""
    from lmbatch.engine import Engine
    from lmbatch.requests import ScoreRequest

    model = tmp_path / "model"
    shutil.copytree(families / "glm4_moe", model)
    reqs = [ScoreRequest([1, 5, 9, 4], [7, 3])]
    want = Engine.from_pretrained(model).score(reqs)[0][0].logprob
    _extra_tensor("model.layers.3.eh_proj.weight")(model)         # 3 layers and 1 MTP layer
    assert resolve_model(str(model)) == model.resolve()
    assert Engine.from_pretrained(model).score(reqs)[0][0].logprob == want
    _extra_tensor("model.layers.4.eh_proj.weight")(model)
    with pytest.raises(UserError, match="num_hidden_layers is 3 but model.safetensors holds 5 layers"):
        resolve_model(str(model))


@pytest.mark.parametrize("kind", list(TINY_CONFIGS))
def test_the_parameter_names_known_without_torch_are_the_networks(families, kind):
    """names.py's parameters of a config are `Transformer(cfg)`'s, and every tensor of the family's
    checkpoint has its place among them: the name check before loading refuses only what loading would."""
    import torch

    from lmbatch.model.checkpoint import _check_weights
    from lmbatch.model.config import ModelConfig
    from lmbatch.model.names import name_problem, parameter_names, target
    from lmbatch.model.network import Transformer

    cfg = ModelConfig.from_dir(families / kind)
    with torch.device("meta"):
        params = {name for name, _ in Transformer(cfg).named_parameters()}
    assert parameter_names(cfg) == params
    tensors, where = _check_weights(families / kind, native=True)
    assert {target(n, cfg) for n in tensors} - {None} == params
    assert name_problem(cfg, list(tensors), where) is None


def test_the_embedded_model_passes_the_shape_check():
    from lmbatch.model.checkpoint import _check_weights
    from lmbatch.model.config import ModelConfig
    from lmbatch.model.shapes import shape_problem

    folder = embedded_model_dir()
    raw = json.loads((folder / "config.json").read_text())
    tensors, where = _check_weights(folder, native=True)
    assert shape_problem(ModelConfig.from_json(raw), raw, tensors, where) is None
    assert resolve_model(None) == folder


def test_a_16_gb_checkpoint_checks_in_well_under_a_second(tmp_path):
    """Headers only: a Llama-3-8B-shaped checkpoint (16 GB of bfloat16, a sparse file) checks at once."""
    v, h, inter, n, heads, kv, hd = 128256, 4096, 14336, 32, 32, 8, 128
    shapes = {"model.embed_tokens.weight": [v, h], "lm_head.weight": [v, h], "model.norm.weight": [h]}
    for i in range(n):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": [h], p + "post_attention_layernorm.weight": [h],
                       p + "self_attn.q_proj.weight": [heads * hd, h], p + "self_attn.k_proj.weight": [kv * hd, h],
                       p + "self_attn.v_proj.weight": [kv * hd, h], p + "self_attn.o_proj.weight": [h, heads * hd],
                       p + "mlp.gate_proj.weight": [inter, h], p + "mlp.up_proj.weight": [inter, h],
                       p + "mlp.down_proj.weight": [h, inter]})
    header, end = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in shapes.items():
        size = 2 * shape[0] * (shape[1] if len(shape) > 1 else 1)
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [end, end + size]}
        end += size
    raw = json.dumps(header).encode()
    with (tmp_path / "model.safetensors").open("wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        f.truncate(8 + len(raw) + end)
    assert end > 16e9
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": v, "hidden_size": h,
        "intermediate_size": inter, "num_hidden_layers": n, "num_attention_heads": heads, "num_key_value_heads": kv}))
    start = time.perf_counter()
    assert resolve_model(str(tmp_path)) == tmp_path.resolve()
    assert time.perf_counter() - start < 0.5
    _config(num_key_value_heads=4)(tmp_path)
    with pytest.raises(UserError, match="num_key_value_heads x head_dim .* is 4 x 128 = 512 but model.safetensors "
                                        "has 1024 rows in model.layers.0.self_attn.k_proj.weight"):
        resolve_model(str(tmp_path))


# ---- `lmbatch lm-eval`'s bad inputs: one line, before lm-eval starts -------------------------------------
@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    from lmbatch.lm_eval.backend import write_offline_tasks

    d = tmp_path_factory.mktemp("tasks")
    write_offline_tasks(d)
    return d


BAD_MODEL_ARGS = {   # --model_args beside pretrained=: the one line after "error: "
    "dtype=nonsense": "--model_args dtype=nonsense: use auto, float32, bfloat16 or float16",
    "device=quantum": "--model_args device=quantum: use auto, cpu or cuda",
    "attention=fast": "--model_args attention=fast: use auto, flashinfer, triton, cascade or torch",
    "schedule=lifo": "--model_args schedule=lifo: use dfs, fcfs or random",
    "max_length=abc": "--model_args max_length=abc: use a whole number, at least 1",
    "max_length=0": "--model_args max_length=0: use a whole number, at least 1",
    "kv_cache_tokens=-5": "--model_args kv_cache_tokens=-5: use a whole number, at least 1",
    "threads=0": "--model_args threads=0: use a whole number, at least 1",
    "max_tokens_per_batch=1.5": "--model_args max_tokens_per_batch=1.5: use a whole number, at least 1",
    "tensor_parallel=0": "--model_args tensor_parallel=0: use a number of devices (at least 1) or auto",
    "data_parallel=many": "--model_args data_parallel=many: use a number of workers (at least 1) or auto",
    "prefix_token_id=-1": "--model_args prefix_token_id=-1: use a token id (a whole number, at least 0)",
    "add_bos_token=maybe": "--model_args add_bos_token=maybe: use true or false",
    "score_cache=2": "--model_args score_cache=2: use true or false",
    # issue 47 (8c): blamed --dtype, once lm-eval had started (10.8 s)
    "dtype=float16,device=cpu": "--model_args dtype=float16 on CPU: use dtype=float32 (or bfloat16, ~100x slower "
                                "on most CPUs)",
    "batch_size=8": "--model_args batch_size=8: lm-eval gives the model its batch_size itself: give it as "
                    "--batch_size only",
}


def _lm_eval(good, task_dir, out, *args) -> str:
    return _one_line(*_cli("lm-eval", *args, "--limit", 1, "--output_path", out))


@pytest.mark.parametrize("arg", list(BAD_MODEL_ARGS))
def test_lm_eval_bad_model_arg_is_one_line(good, task_dir, tmp_path, arg):
    line = _lm_eval(good, task_dir, tmp_path / "out", "--model_args", f"pretrained={good},{arg}",
                    "--tasks", "hellaswag_offline", "--include_path", task_dir)
    assert line == f"error: {BAD_MODEL_ARGS[arg]}"
    assert not (tmp_path / "out").exists()


def test_lm_eval_float16_where_no_gpu_is_visible_is_one_line_before_lm_eval(good, task_dir, tmp_path, monkeypatch):
    """dtype=float16 with the device left to auto, on a machine without a GPU: named as the model_arg it is,
    before lm-eval starts (its evaluator is never called)."""
    import lm_eval.evaluator

    from lmbatch.engine import devices

    monkeypatch.setattr(devices, "visible_gpus", lambda: devices.GPUs(0, None))
    monkeypatch.setattr(lm_eval.evaluator, "simple_evaluate", lambda *a, **k: pytest.fail("lm-eval started"))
    line = _lm_eval(good, task_dir, tmp_path / "out", "--model_args", f"pretrained={good},dtype=float16",
                    "--tasks", "hellaswag_offline", "--include_path", task_dir)
    assert line == ("error: --model_args dtype=float16 on CPU (no GPU is visible here): use dtype=float32 (or "
                    "bfloat16, ~100x slower on most CPUs)")


LM_EVAL_CASES = {   # id: (arguments after --model_args pretrained=GOOD, the one line after "error: ")
    "no-tasks": ([], "give --tasks: lm-eval task, group or tag names, comma-separated (`lmbatch lm-eval ls tasks` "
                     "lists them)"),
    "device": (["--device", "cuda:0", "--tasks", "hellaswag_offline"], "--device cuda:0: lmbatch runs on auto, cpu "
                                                                       "or cuda"),
    "device-twice": (["--device", "cuda", "--tasks", "hellaswag_offline"],
                     "--model_args device=cpu and --device cuda: two devices; give one"),
    "unknown-task": (["--tasks", "hellaswag_offline,hellaswagg"],
                     "--tasks hellaswagg: lm-eval has no task, group or tag of that name (close: hellaswag, "),
    "no-task-file": (["--tasks", "/no/such/task.yaml"], "--tasks /no/such/task.yaml: no such task file"),
}


@pytest.mark.parametrize("case", list(LM_EVAL_CASES))
def test_lm_eval_bad_input_is_one_line(good, task_dir, tmp_path, case):
    args, says = LM_EVAL_CASES[case]
    pretrained = f"pretrained={good}" + (",device=cpu" if case == "device-twice" else "")
    line = _lm_eval(good, task_dir, tmp_path / "out", "--model_args", pretrained, "--include_path", task_dir, *args)
    assert line.startswith(f"error: {says}"), line
    assert not (tmp_path / "out").exists()


def test_lm_eval_hub_task_while_offline_is_one_line(good, task_dir, tmp_path, monkeypatch):
    """HF_HUB_OFFLINE and a task over a Hub dataset not in the local caches: named before lm-eval
    starts (a group is expanded to its tasks through lm-eval's index)."""
    import datasets.config
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets")
    line = _lm_eval(good, task_dir, tmp_path / "out", "--model_args", f"pretrained={good}", "--include_path", task_dir,
                    "--tasks", "hellaswag_offline,arc_easy")
    assert line == ("error: --tasks arc_easy: lm-eval task arc_easy reads allenai/ai2_arc from the Hugging Face Hub, "
                    "which is not in the local cache, and HF_HUB_OFFLINE is set: run it once online, or use tasks over "
                    "local files (lmbatch lm-eval-tasks DIR writes mmlu_offline, hellaswag_offline "
                    "and gsm8k_offline for --include_path)")
    assert not (tmp_path / "out").exists()
    from lmbatch.lm_eval.checks import _in_local_cache

    assert not _in_local_cache("allenai/ai2_arc")
    (tmp_path / "hub" / "datasets--allenai--ai2_arc").mkdir(parents=True)       # fetched before: lm-eval may try
    assert _in_local_cache("allenai/ai2_arc")


def test_lm_eval_task_whose_data_fails_to_load_is_one_line(tmp_path):
    """What cannot be checked up front (here a data file that is not there; the Hub unreachable ends the
    same way): the failure, raised inside lm-eval as it loads the task, is one line naming the task.
    In a child process (lm-eval's log handler holds the stderr of its first call), lm-eval's logs off."""
    import lm_eval

    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "broken_data.yaml").write_text(json.dumps({
        "include": str(Path(lm_eval.__file__).parent / "tasks" / "hellaswag" / "hellaswag.yaml"),
        "task": "broken_data", "tag": [], "dataset_path": "json", "dataset_name": None, "training_split": None,
        "dataset_kwargs": {"data_files": {"validation": str(tmp_path / "missing.jsonl")}}}))
    res = subprocess.run([sys.executable, "-c", "from lmbatch.cli import main; main()", "lm-eval", "--model", "dummy",
                          "--tasks", "broken_data", "--include_path", str(tasks), "--limit", "1",
                          "--output_path", str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "LMEVAL_LOG_LEVEL": "ERROR"})
    line = _one_line(res.returncode, res.stdout, res.stderr)
    assert line == (f"error: lm-eval task broken_data: its data (json) cannot be loaded: FileNotFoundError: "
                    f"Unable to find '{tmp_path / 'missing.jsonl'}'"), line
    assert not (tmp_path / "out").exists()
