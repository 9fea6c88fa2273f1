"""The transformers fallback (lmbatch/model/fallback.py) under the engine: greedy generation as transformers'
own `generate`, with prefixes reused; models it must refuse rather than run wrong; which folders are causal LMs."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM, BertConfig, BertLMHeadModel, GPTNeoXConfig

from lmbatch.engine import Engine
from lmbatch.errors import UserError
from lmbatch.model.checkpoint import resolve_model
from lmbatch.model.fallback import HFCausalLM
from lmbatch.requests import GenerateRequest, SamplingParams, ScoreRequest

NEW = 8


@pytest.fixture(scope="module")
def neox(tmp_path_factory):
    """A tiny random GPT-NeoX (partial rotary) without an EOS token, saved; and its transformers model."""
    path = tmp_path_factory.mktemp("neox")
    torch.manual_seed(3)
    cfg = GPTNeoXConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, max_position_embeddings=256, rotary_pct=0.5, bos_token_id=None,
                        eos_token_id=None)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm.weight" in name else 0.1 * torch.randn_like(p))
    model.eval().save_pretrained(path)
    return path, model


def test_greedy_generation_matches_transformers_generate(neox):
    path, hf = neox
    prompts = [[3, 17, 42, 9, 11], [3, 17, 42, 9, 11, 100, 5], [3, 17, 42, 60], [77]]
    reqs = [GenerateRequest(p, SamplingParams(max_new_tokens=NEW, ignore_eos=True)) for p in prompts]
    eng = Engine.from_pretrained(path, max_tokens_per_batch=5)
    assert eng.cfg.runtime == "transformers" and eng.graphs is None
    results, stats = eng.generate(reqs)
    for p, res in zip(prompts, results):
        with torch.no_grad():
            want = hf.generate(torch.tensor([p]), do_sample=False, max_new_tokens=NEW, min_new_tokens=NEW,
                               pad_token_id=0)[0, len(p):].tolist()
        assert res.token_ids == want
        assert res.finish_reason == "length"
    assert stats.cached_tokens > 0 and stats.decode_tokens == NEW * len(prompts)


def test_scores_of_one_batch_reading_its_own_prefix(neox):
    """Sequences of one batch that read KV another one of it writes (a prefix inserted earlier in the batch)."""
    path, hf = neox
    reqs = [ScoreRequest([5, 6, 7, 8, 9, 10], [11, 12]), ScoreRequest([5, 6, 7, 8, 9, 10, 13], [14]),
            ScoreRequest([5, 6, 7, 20], [21, 22, 23])]
    results, stats = Engine.from_pretrained(path, max_tokens_per_batch=64).score(reqs)
    assert stats.cached_tokens > 0 and stats.forward_batches == 1
    for req, res in zip(reqs, results):
        with torch.no_grad():
            lp = torch.log_softmax(hf(torch.tensor([req.tokens])).logits[0].float(), -1)
        c = len(req.context)
        want = lp[c - 1:len(req.tokens) - 1].gather(1, torch.tensor(req.continuation)[:, None]).sum()
        assert abs(res.logprob - float(want)) < 1e-4


def test_cache_layout_other_than_the_pools_is_refused(neox):
    """Keys of another shape than (kv_heads, head_dim) per token (as MLA models cache them): an error, not garbage."""
    path, _ = neox
    model = HFCausalLM.load(path, "cpu", torch.float32)
    model.cfg = replace(model.cfg, num_kv_heads=2, head_dim=32)
    with pytest.raises(UserError, match=r"caches keys \(1, 4, 3, 16\).*KV pool holds \(1, 2, 3, 32\)"):
        Engine(model).score([ScoreRequest([1, 2, 3], [4])])


def test_encoder_under_a_causal_head_is_refused(tmp_path):
    """BERT's LM head without is_decoder attends both ways: refused, though transformers would load it."""
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    BertLMHeadModel(cfg).save_pretrained(tmp_path)
    assert resolve_model(str(tmp_path)) == tmp_path.resolve()     # its name says causal LM
    with pytest.raises(UserError, match="is not causal"):
        Engine.from_pretrained(tmp_path)


@pytest.mark.parametrize("config", [{"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]},
                                    {"model_type": "gpt_neox", "architectures": ["GPTNeoXForCausalLM"]},
                                    {"model_type": "gpt_neox"}, {"model_type": "llama"}])
def test_causal_lm_folders_are_accepted(tmp_path, config):
    sizes = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
             "num_attention_heads": 4}      # a native model's config must give them
    (tmp_path / "config.json").write_text(json.dumps({**sizes, **config}))
    (tmp_path / "model.safetensors").write_bytes((8).to_bytes(8, "little") + b"{}      ")   # no tensors
    if config["model_type"] == "llama":     # native: its weights must have its config's shapes (model/shapes.py)
        from conftest import make_tiny_hf

        make_tiny_hf("llama", tmp_path)
        saved = json.loads((tmp_path / "config.json").read_text())
        (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in saved.items() if k != "architectures"}))
    assert resolve_model(str(tmp_path)) == tmp_path.resolve()


@pytest.mark.parametrize("config, what", [
    ({"model_type": "t5", "architectures": ["T5ForConditionalGeneration"]}, "T5ForConditionalGeneration (t5)"),
    ({"model_type": "roberta", "architectures": ["RobertaForMaskedLM"]}, "RobertaForMaskedLM (roberta)"),
    ({"model_type": "vit"}, "a vit:"),
    ({"model_type": "no_such_model"}, "a no_such_model:")])
def test_other_folders_are_refused(tmp_path, config, what):
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match="runs causal LMs: natively llama, qwen2, .*; any other decoder-only") as e:
        resolve_model(str(tmp_path))
    assert what in str(e.value) and "\n" not in str(e.value)
