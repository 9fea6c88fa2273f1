import pytest
import torch

# GPU tests (marked gpu) need CUDA: on a machine without it they are not collected at all.
collect_ignore = [] if torch.cuda.is_available() else ["test_gpu.py"]


def pytest_report_header(config):
    if collect_ignore:
        return "gpu tests: not collected (no CUDA here); run them on the GPU machine with -m gpu"

from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

TINY = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128, max_position_embeddings=512, rms_norm_eps=1e-6)

TINY_CONFIGS = {
    "llama": lambda: LlamaConfig(**TINY, rope_theta=10000.0, tie_word_embeddings=False),
    "llama3-rope-tied": lambda: LlamaConfig(**TINY, rope_theta=500000.0, tie_word_embeddings=True,
                                            rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                          "original_max_position_embeddings": 64}),
    "qwen2": lambda: Qwen2Config(**TINY, rope_theta=1000000.0, tie_word_embeddings=True),
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
            else:
                p.copy_(0.08 * torch.randn_like(p))
    model.eval()
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="session", params=list(TINY_CONFIGS))
def tiny_model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return request.param, path, make_tiny_hf(request.param, path)


def make_tiny_with_tokenizer(path, max_positions: int = 2048, seed: int = 0):
    """A tiny random Llama over the embedded model's tokenizer (vocab 49152), saved to `path`."""
    import shutil

    from lmbatch.models import embedded_model_dir

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                      tie_word_embeddings=True)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    for f in embedded_model_dir().iterdir():
        if f.name.startswith("tokenizer") or f.name.endswith(".jinja"):
            shutil.copy(f, path / f.name)
    return path


@pytest.fixture(scope="session")
def tiny_tok(tmp_path_factory):
    return make_tiny_with_tokenizer(tmp_path_factory.mktemp("tiny_tok"))
