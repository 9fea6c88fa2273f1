"""Plain data for what the engine is asked to do and what it returns."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:      # lmbatch.grammar imports xgrammar: loaded only where a grammar is used
    from lmbatch.grammar import Constraint


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 32
    temperature: float = 0.0        # 0: greedy
    top_p: float = 1.0
    seed: int = 0
    stop: tuple[str, ...] = ()      # stop strings (need the engine's tokenizer)
    ignore_eos: bool = False
    # thinking first (empty: none): unconstrained tokens up to the end-of-thinking marker `think_end`
    # (forced after `think_budget` tokens); then the constraint, stop strings and max_new_tokens apply
    think_end: tuple[int, ...] = ()
    think_budget: int = 0

    @property
    def most_tokens(self) -> int:
        """The most tokens the output can take: thinking, its marker and the answer."""
        return self.max_new_tokens + (self.think_budget + len(self.think_end) if self.think_end else 0)


@dataclass(frozen=True)
class ScoreRequest:
    """Loglikelihood of `continuation` given `context` (lm-eval-harness semantics)."""
    context: list[int]
    continuation: list[int]

    @property
    def tokens(self) -> list[int]:
        return self.context + self.continuation

    @property
    def prompt(self) -> list[int]:
        """What must run through the model: the continuation's last token is scored, never run.
        Requests with equal prompts (e.g. one-token choices after one context) run once. A one-token
        continuation's prompt is the context itself (no copy: callers only read it)."""
        if len(self.continuation) == 1:
            return self.context
        return self.context + self.continuation[:-1]

    @property
    def prompt_len(self) -> int:
        """len(self.prompt), without making it."""
        return len(self.context) + len(self.continuation) - 1


@dataclass(frozen=True)
class GenerateRequest:
    prompt: list[int]
    params: SamplingParams = SamplingParams()
    constraint: Constraint | None = None    # its own matcher state

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)


@dataclass
class TokenCounts:
    """Token counts: of one request's result, one program, one stage of a run, or a whole run."""
    prompt_tokens: int = 0
    cached_tokens: int = 0          # prompt tokens whose KV came from the cache
    computed_tokens: int = 0        # prompt tokens run through the model
    decode_tokens: int = 0          # tokens generated (none for a score request)

    def add(self, other: TokenCounts) -> None:
        self.prompt_tokens += other.prompt_tokens
        self.cached_tokens += other.cached_tokens
        self.computed_tokens += other.computed_tokens
        self.decode_tokens += other.decode_tokens


@dataclass
class ScoreResult(TokenCounts):
    """Score requests merged into another's execution (same prompt) keep zero counts."""
    logprob: float = 0.0            # sum of the continuation's token logprobs
    num_tokens: int = 0
    is_greedy: bool = False         # every continuation token is the argmax


@dataclass
class GenerateResult(TokenCounts):
    token_ids: list[int] = field(default_factory=list)
    text: str | None = None
    finish_reason: str = ""         # "length", "eos" or "stop"
    steps: int = 0                  # forward passes that sampled its tokens (fewer with jump-forward)
    jumped_tokens: int = 0          # tokens appended by jump-forward, not decoded
    grammar_complete: bool | None = None   # constrained: the grammar matched to its end
    think_tokens: int = 0           # leading tokens that are thinking and its end marker (text: the rest)
    thinking: str | None = None     # the thinking's text, without its marker


@dataclass
class RunStats(TokenCounts):
    requests: int = 0               # requests asked for
    executed: int = 0               # distinct executed requests (equal score prompts merged)
    unique_tokens: int = 0          # sum of edge lengths of the batch's radix tree
    optimal_hit_rate: float = 0.0   # Theorem 3.1
    engine_optimal_hit_rate: float = 0.0
    forward_batches: int = 0
    evicted_tokens: int = 0
    masked_rows: int = 0            # grammar rows that filled a token mask (the rest kept their own pick)
    resampled_rows: int = 0         # of those, rows masked after their pick was rejected (a second round)
    order: list[int] = field(default_factory=list)                  # executed requests, in execution order
    members: dict[int, list[int]] = field(default_factory=dict)    # executed request -> requests it served
    plan_s: float = 0.0             # building the radix tree and the order (and logit demands)
    execute_s: float = 0.0          # everything after planning
    # for a progress bar while decoding: the most tokens the run's generation requests may total (each unfinished
    # one's `most_tokens`, each finished one's own), and those decoded by running ones (not yet in decode_tokens)
    decode_budget: int = 0
    decoding_tokens: int = 0

    def add_run(self, other: RunStats) -> None:
        """Add another run's counts (one engine batch into the interpreter's totals). Its timings,
        order, members and optima are its own: not added."""
        self.add(other)
        self.requests += other.requests
        self.add_engine_counts(other)

    def add_engine_counts(self, other: RunStats) -> None:
        """Add what another engine executed and how (one worker's run into a data-parallel run's)."""
        self.executed += other.executed
        self.forward_batches += other.forward_batches
        self.evicted_tokens += other.evicted_tokens
        self.masked_rows += other.masked_rows
        self.resampled_rows += other.resampled_rows

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def optimal_hit_rate(unique_tokens: int, prompt_tokens: int) -> float:
    """Theorem 3.1's hit rate: every distinct prefix computed once (`unique_tokens`, the radix tree's
    edge lengths summed) of `prompt_tokens`."""
    return 1 - unique_tokens / prompt_tokens if prompt_tokens else 0.0
