import ctypes
import gc
import os
import random

import pytest

from lmbatch.engine.threads import cpu_environment

cpu_environment()       # before torch loads, as the CLI does: MKL's bits whatever the threads (engine/threads.py)

import torch  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    DeepseekV3Config,
    Gemma2Config,
    Gemma3TextConfig,
    Glm4MoeConfig,
    GptOssConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Olmo2Config,
    Olmo3Config,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
    SmolLM3Config,
)

from lmbatch.requests import ScoreRequest  # noqa: E402

# GPU tests (marked gpu) need CUDA: on a machine without it they are not collected at all.
collect_ignore = [] if torch.cuda.is_available() else ["gpu"]


@pytest.fixture(autouse=True, scope="module")
def _memory_back_after_each_module():
    """The suite runs in one process: after each test file, what it left unreachable is collected and the
    C heap's free pages go back to the system (glibc keeps them otherwise), so the process's peak is one
    file's, not the sum of the files' leftovers."""
    yield
    gc.collect()
    if os.environ.get("LMBATCH_TEST_NO_TRIM") is None:
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):      # not glibc
            pass


def pytest_report_header(config):
    if collect_ignore:
        return "gpu tests: not collected (no CUDA here); run them on the GPU machine with -m gpu"


TINY = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128, max_position_embeddings=512, rms_norm_eps=1e-6)

TINY_CONFIGS = {
    "llama": lambda: LlamaConfig(**TINY, rope_theta=10000.0, tie_word_embeddings=False),
    "llama3-rope-tied": lambda: LlamaConfig(**TINY, rope_theta=500000.0, tie_word_embeddings=True,
                                            rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                          "original_max_position_embeddings": 64}),
    "qwen2": lambda: Qwen2Config(**TINY, rope_theta=1000000.0, tie_word_embeddings=True),
    # head_dim apart from hidden / heads; q/k RMSNorm per head
    "qwen3": lambda: Qwen3Config(**TINY, head_dim=24, tie_word_embeddings=False),
    # routed experts on layer 0, a dense MLP on layer 1 (mlp_only_layers); top-k weights not renormalized
    "qwen3_moe": lambda: Qwen3MoeConfig(**TINY, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                        moe_intermediate_size=48, norm_topk_prob=False, mlp_only_layers=[1]),
    "mixtral": lambda: MixtralConfig(**TINY, num_local_experts=4, num_experts_per_tok=2),
    # a window shorter than the parity tests' sequences (20 to 50 tokens)
    "mistral": lambda: MistralConfig(**TINY, sliding_window=12),
    "phi3": lambda: Phi3Config(**TINY, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    "olmo2": lambda: Olmo2Config(**TINY, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    # a sliding (layer 0) and a full layer (1), YaRN on the full one only
    "olmo3": lambda: Olmo3Config(
        **TINY, pad_token_id=0, bos_token_id=1, eos_token_id=2, sliding_window=12,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "yarn", "factor": 8.0, "rope_theta": 10000.0,
                                            "original_max_position_embeddings": 64}}),
    # a dense layer, then two of 8 experts in 4 groups (the best 2 groups' experts chosen from) beside a
    # shared expert; RoPE on half of each head; q/k norms and q/k/v biases
    "glm4_moe": lambda: Glm4MoeConfig(**{**TINY, "num_hidden_layers": 3}, moe_intermediate_size=32, n_routed_experts=8,
                                      num_experts_per_tok=2, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                                      use_qk_norm=True, attention_bias=True),
    # a sliding (layer 0) and a full layer with sinks; 4 biased experts whose SwiGLU clamp (limit 1) bites; YaRN
    # with truncate off
    "gpt_oss": lambda: GptOssConfig(**TINY, head_dim=16, sliding_window=12, num_local_experts=4, num_experts_per_tok=2,
                                    swiglu_limit=1.0, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                    rope_parameters={"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0,
                                                     "beta_slow": 1.0, "truncate": False, "rope_theta": 10000.0,
                                                     "original_max_position_embeddings": 64}),
    # latent attention (q LoRA, interleaved RoPE, YaRN with mscale and mscale_all_dim: both the rotation's
    # attention factor and the softmax scale); a dense layer, then GLM-4.5's routing over 8 experts in 4 groups
    "deepseek_v3": lambda: DeepseekV3Config(
        **{**TINY, "num_hidden_layers": 3, "num_key_value_heads": 4}, q_lora_rank=24, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, moe_intermediate_size=32, n_routed_experts=8,
        num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5,
        rope_parameters={"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64, "mscale": 1.0,
                         "mscale_all_dim": 0.7, "rope_theta": 10000.0}),
    # NoPE every second layer (layer 1), which slides
    "smollm3": lambda: SmolLM3Config(**TINY, no_rope_layer_interval=2, use_sliding_window=True, sliding_window=12,
                                     pad_token_id=0, bos_token_id=1, eos_token_id=2),
    # sliding (layer 0) and global (layer 1) layers; caps small enough to bite on random weights
    "gemma2": lambda: Gemma2Config(**TINY, head_dim=16, sliding_window=12, query_pre_attn_scalar=24,
                                   attn_logit_softcapping=2.0, final_logit_softcapping=5.0),
    # a RoPE base of its own for sliding layers, linear scaling on global ones
    "gemma3_text": lambda: Gemma3TextConfig(
        **TINY, head_dim=16, sliding_window=12, query_pre_attn_scalar=24, final_logit_softcapping=5.0,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0}}),
}


def make_tiny_hf(kind: str, path, seed: int = 0, **overrides):
    """A tiny random HF model saved to `path`; every weight (biases and norms too) drawn at random."""
    torch.manual_seed(seed)
    cfg = TINY_CONFIGS[kind]()
    for k, v in overrides.items():
        setattr(cfg, k, v)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif name.endswith("sinks"):            # gpt-oss's attention sinks: large enough to weigh
                p.copy_(1 + torch.randn_like(p))
            else:
                p.copy_(0.08 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):     # DeepSeek's router bias: a buffer, saved
                b.copy_(0.1 * torch.randn_like(b))
    model.eval()
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="session", params=list(TINY_CONFIGS))
def tiny_model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return request.param, path, make_tiny_hf(request.param, path)


CHAT_TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
                 "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def make_small_tokenizer(path, vocab_size: int = 2048):
    """A byte-level BPE tokenizer trained here on a fixed text (SmolLM2's special tokens, pre-tokenizer and
    chat format), saved to `path`: every byte has a token, so grammars and any text work, and no model
    package is needed (GPU machines have none)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    words = ("the of and to in is was for on that with as by at from city river population landmark name "
             "answer question true false yes no capital country north south museum park bridge tower "
             "one two three four five because which what who where when how many number").split()
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 14))).capitalize() + rng.choice(".?!:")
             for _ in range(3000)]
    lines += [f'{{"name": "{rng.choice(words).title()}", "population": {rng.randint(0, 10**7)}, '
              f'"landmarks": ["{rng.choice(words)}"]}}' for _ in range(500)]
    lines += [f"Answer: {rng.choice('ABCD')}\n{rng.randint(0, 9999)} + {rng.randint(0, 99)} = " for _ in range(500)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                       show_progress=False))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   pad_token="<|im_end|>", unk_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return fast


def make_tiny_with_tokenizer(path, max_positions: int = 2048, seed: int = 0):
    """A tiny random Llama over a small trained byte-level BPE tokenizer, saved to `path`."""
    torch.manual_seed(seed)
    vocab = len(make_small_tokenizer(path))
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path


def wide_tiny(tiny, path, intermediate_size: int = 2048):
    """`tiny`'s tokenizer with a Llama of wider MLPs: weights of a few MiB, so that a tensor lies wholly
    past the first and before the last MiB of model.safetensors."""
    import shutil

    shutil.copytree(tiny, path)
    cfg = LlamaConfig.from_pretrained(path)
    cfg.intermediate_size = intermediate_size
    torch.manual_seed(1)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path


def scale_in_place(weights, factor: float = 1.5, restore_mtime: bool = False) -> str:
    """Scales one float32 tensor of a safetensors file in place (same file, same size): the one whose data
    lies furthest from both ends of the file. Optionally puts the modification time back. Returns its name."""
    import json
    import os

    import numpy as np

    st = os.stat(weights)
    with open(weights, "r+b") as fh:
        n = int.from_bytes(fh.read(8), "little")
        header = {k: v for k, v in json.loads(fh.read(n)).items() if k != "__metadata__"}
        size = st.st_size

        def margin(item):
            start, end = item[1]["data_offsets"]
            return min(8 + n + start, size - 8 - n - end)
        name, entry = max(header.items(), key=margin)
        assert entry["dtype"] == "F32"
        start, end = entry["data_offsets"]
        fh.seek(8 + n + start)
        data = np.frombuffer(fh.read(end - start), np.float32) * np.float32(factor)
        fh.seek(8 + n + start)
        fh.write(data.tobytes())
    assert os.stat(weights).st_size == size
    if restore_mtime:
        os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    return name


@pytest.fixture(scope="session")
def tiny_tok(tmp_path_factory):
    return make_tiny_with_tokenizer(tmp_path_factory.mktemp("tiny_tok"))


def hf_scores(hf, reqs: list[ScoreRequest]) -> list[float]:
    """A transformers model's logprob of each request's continuation, one request at a time on its device."""
    dev = next(hf.parameters()).device
    out = []
    for req in reqs:
        with torch.no_grad():
            lp = torch.log_softmax(hf(torch.tensor([req.tokens], device=dev)).logits[0].float(), -1)
        c = len(req.context)
        cont = torch.tensor(req.continuation, device=dev)[:, None]
        out.append(float(lp[c - 1:len(req.tokens) - 1].gather(1, cont).sum()))
    return out


def random_requests(rng: random.Random, n: int, vocab: int = 128) -> list[ScoreRequest]:
    """Shared and unshared prefixes, duplicates, and prompts that are prefixes of others."""
    stems = [[rng.randrange(vocab) for _ in range(rng.randint(1, 30))] for _ in range(3)]
    reqs = []
    while len(reqs) < n:
        kind = rng.random()
        if kind < 0.15 and reqs:
            reqs.append(rng.choice(reqs))                                    # duplicate
            continue
        if kind < 0.3 and reqs:
            base = rng.choice(reqs).tokens
            toks = base[: rng.randint(2, len(base))] if len(base) >= 2 else base + [1]  # prefix of another
        else:
            toks = rng.choice(stems) + [rng.randrange(vocab) for _ in range(rng.randint(1, 12))]
        if len(toks) < 2:
            toks = toks + [rng.randrange(vocab)]
        cut = rng.randint(1, len(toks) - 1)
        reqs.append(ScoreRequest(toks[:cut], toks[cut:]))
    return reqs


class Page:
    """An HTML file parsed by html.parser: its tags counted, every attribute, the text."""

    def __init__(self, text: str):
        from collections import Counter
        from html.parser import HTMLParser

        self.tags: Counter = Counter()
        self.attrs: list = []
        self.text: list = []
        page = self

        class Parser(HTMLParser):
            def handle_starttag(self, tag, attrs):
                page.tags[tag] += 1
                page.attrs += [(tag, k, v) for k, v in attrs]

            def handle_startendtag(self, tag, attrs):
                self.handle_starttag(tag, attrs)

            def handle_data(self, data):
                page.text.append(data)

        parser = Parser()
        parser.feed(text)
        parser.close()


def assert_self_contained_html(text: str, plots: int) -> Page:
    """`lmbatch report --html`'s page: it parses, holds one SVG per plot (each a figure), and refers to
    nothing outside itself (no script, stylesheet, image or link; no URL)."""
    page = Page(text)
    assert text.startswith("<!DOCTYPE html>") and page.tags["html"] == page.tags["body"] == 1
    assert page.tags["svg"] == page.tags["figure"] == plots         # one SVG per plot, each a figure
    assert not {"script", "link", "img", "iframe", "object", "embed", "use", "image", "base"} & set(page.tags)
    refs = [(t, k, v) for t, k, v in page.attrs if k in ("src", "href", "xlink:href", "srcset", "action", "data")]
    assert not refs, refs
    for needle in ("http:", "https:", "src=", "href=", "url(", "@import", "//"):
        assert needle not in text, needle
    return page


def tot_on_workers(tmp_path, model, workers: tuple[str, ...] = ("1", "2")) -> dict:
    """Tree of thought (6 questions, float32, on CUDA) with each `--data-parallel` of `workers`: each run's
    instance rows and summary (tests/gpu: workers' results against one engine's)."""
    import json

    import pyarrow.parquet as pq

    from lmbatch.options import RunOptions
    from lmbatch.run.run import run

    got = {}
    for dp in workers:
        d = run(RunOptions.of(task="tot-gsm8k", limit=6, model=str(model), out=tmp_path, run_id=f"tot{dp}",
                              device="cuda", dtype="float32", data_parallel=dp, quiet=True))
        got[dp] = (pq.read_table(d / "instances.parquet").to_pylist(), json.loads((d / "summary.json").read_text()))
    return got
