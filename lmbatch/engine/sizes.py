"""What a model takes in memory, decided from its config alone (no torch): its weights' bytes, and whether it
is small enough that its decode steps are short and a run of several stages has its host set their pace
(engine/devices.py gives such a run several workers a GPU, engine/build.py more decode rows)."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lmbatch.model.config import ModelConfig

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
HOST_BOUND_STAGES = 3   # a run that generates in this many stages or more on such a model: its host sets the pace
SMALL_MODEL_BYTES = 4 << 30     # weights of a small model at most (1.5B in bf16: 2.9 GiB; 8B: 15.3)


def weight_bytes(cfg: ModelConfig, dtype: str) -> int:
    """The model's weights in memory: every linear layer (every expert), embeddings and LM head."""
    h = cfg.hidden_size
    attention = cfg.attention_params()
    sparse = sum(cfg.sparse_layers)
    mlp = (cfg.num_layers - sparse) * 3 * h * cfg.intermediate_size + \
        sparse * ((cfg.num_experts * cfg.moe_intermediate_size + cfg.shared_experts_size) * 3 * h + h * cfg.num_experts)
    embeddings = cfg.vocab_size * h * (1 if cfg.tie_word_embeddings else 2)
    return (cfg.num_layers * attention + mlp + embeddings) * DTYPE_BYTES.get(dtype, 2)
