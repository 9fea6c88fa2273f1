"""Plain data for what the engine is asked to do and what it returns."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 32
    temperature: float = 0.0        # 0: greedy
    top_p: float = 1.0
    seed: int = 0
    stop: tuple[str, ...] = ()      # stop strings (need the engine's tokenizer)
    ignore_eos: bool = False


@dataclass(frozen=True)
class ScoreRequest:
    """Loglikelihood of `continuation` given `context` (lm-eval-harness semantics)."""
    context: list[int]
    continuation: list[int]

    @property
    def tokens(self) -> list[int]:
        return self.context + self.continuation


@dataclass(frozen=True)
class GenerateRequest:
    prompt: list[int]
    params: SamplingParams = SamplingParams()

    @property
    def tokens(self) -> list[int]:
        return self.prompt


@dataclass
class Counters:
    prompt_tokens: int = 0
    cached_tokens: int = 0          # prompt tokens whose KV came from the cache
    computed_tokens: int = 0        # prompt tokens run through the model for this request


@dataclass
class ScoreResult(Counters):
    logprob: float = 0.0            # sum of the continuation's token logprobs
    num_tokens: int = 0
    is_greedy: bool = False         # every continuation token is the argmax


@dataclass
class GenerateResult(Counters):
    token_ids: list[int] = field(default_factory=list)
    text: str | None = None
    finish_reason: str = ""         # "length", "eos" or "stop"
    decode_tokens: int = 0


@dataclass
class RunStats:
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    computed_tokens: int = 0
    decode_tokens: int = 0
    unique_tokens: int = 0          # sum of edge lengths of the batch's radix tree
    optimal_hit_rate: float = 0.0   # Theorem 3.1
    engine_optimal_hit_rate: float = 0.0
    forward_batches: int = 0
    evicted_tokens: int = 0
    order: list[int] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
