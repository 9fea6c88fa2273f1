"""The engine: runs a whole batch of score and generate requests in the planner's order over the
radix-tree KV cache.

It keeps what outlives a run (the model on its device with its KV pool, attention backend and decode
graphs: `ModelRunner`; the radix cache; the sampler) and drives each run's parts in one direction:

    plan -> RunState -> Prefill (ragged batches of prompt chunks, in plan order)
                         -> LogitCapture (logits of demanded positions, reduced on the device)
                         -> Decode (continuous batching) -> Sampler (grammar masks, jump-forward)
         -> results

Logits are computed only at positions some request scores or samples from, and are captured
whichever request happens to compute the position.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, Hashable, Protocol, Sequence, cast

import torch

from lmbatch.engine.decode import Decode
from lmbatch.engine.kv import KVSlots
from lmbatch.engine.logits import LogitCapture
from lmbatch.engine.model_runner import ModelRunner
from lmbatch.engine.prefill import Prefill
from lmbatch.engine.radix_cache import RadixTree
from lmbatch.engine.sampler import MASK_MODES, Sampler
from lmbatch.engine.state import Request, Result, RunState
from lmbatch.model.config import ModelConfig
from lmbatch.model.network import Transformer
from lmbatch.model.tensor_parallel import TensorParallel, shard_config
from lmbatch.requests import GenerateRequest, GenerateResult, RunStats, ScoreRequest, ScoreResult
from lmbatch.scheduler.planner import Plan, plan_requests

if TYPE_CHECKING:
    from lmbatch.engine.model_runner import LanguageModel


@dataclass(frozen=True)
class EngineOptions:
    kv_cache_tokens: int = 32768        # KV pool size
    max_tokens_per_batch: int = 4096    # prefill batch budget
    attention: str | None = None        # backend name (lmbatch.attention.BACKENDS); None: the device's default
    cache: bool = True                  # reuse KV across requests (the radix cache)
    max_running: int = 256              # decode rows
    cuda_graphs: bool = True            # replay decode steps as CUDA graphs (CUDA only)
    jump_forward: bool = True           # append grammar-forced text without decoding it
    masks: str = "overlap"              # when grammar rows fill their token masks (sampler.MASK_MODES)

    def __post_init__(self) -> None:
        if self.masks not in MASK_MODES:
            raise ValueError(f"masks must be one of {MASK_MODES}, not {self.masks!r}")


class Engine:
    def __init__(self, model: LanguageModel, options: EngineOptions | None = None, *, tokenizer: Any = None,
                 **overrides: Any):
        """`overrides`: EngineOptions fields, e.g. `Engine(model, kv_cache_tokens=4096)`."""
        o = self.options = replace(options or EngineOptions(), **overrides)
        self.cfg, self.tokenizer = model.cfg, tokenizer
        self.runner = ModelRunner(model, kv_cache_tokens=o.kv_cache_tokens, attention=o.attention,
                                  cuda_graphs=o.cuda_graphs, max_running=o.max_running)
        self.model, self.device, self.pool = model, self.runner.device, self.runner.pool
        self.attn, self.graphs = self.runner.attn, self.runner.graphs
        self.tree = RadixTree(self.pool.free) if o.cache else None
        self.sampler = Sampler(self.cfg, self.device, tokenizer=tokenizer, masks=o.masks,
                               jump_forward=o.jump_forward, max_rows=o.max_running)

    @classmethod
    def from_pretrained(cls, path, options: EngineOptions | None = None, *, device="cpu", dtype=torch.float32,
                        load_format="auto", tokenizer: Any = None, tp: TensorParallel | None = None,
                        **overrides: Any) -> "Engine":
        """An engine over the checkpoint folder `path` (random weights with load_format="dummy"): our
        network for the model_types it implements, else transformers' model (model/fallback.py).
        `tp`: this process's rank of a tensor-parallel group (its slice of the model and of the KV)."""
        from lmbatch.model.weights import init_dummy, load_weights

        cfg = ModelConfig.from_dir(path)
        model: LanguageModel
        if tp is not None:
            model = Transformer.empty(shard_config(cfg, tp.size), device, dtype, tp)
            init_dummy(model) if load_format == "dummy" else load_weights(model, path, full=cfg)
        elif cfg.runtime == "transformers":
            from lmbatch.model.fallback import HFCausalLM
            model = HFCausalLM.load(path, device, dtype, random_weights=load_format == "dummy")
        else:
            model = Transformer.empty(cfg, device, dtype)
            init_dummy(model) if load_format == "dummy" else load_weights(model, path)
        return cls(model.eval(), options, tokenizer=tokenizer, **overrides)

    def warm_up(self, tokens: int = 16) -> None:
        """Compile kernels and load libraries now, not in the first real batch (see ModelRunner.warm_up)."""
        self.runner.warm_up(tokens)

    # ---- what callers may ask of the cache -------------------------------------------------------
    @property
    def kv_slots(self) -> int:
        """Tokens the KV pool holds."""
        return self.pool.num_slots

    def match_len(self, ids: list[int]) -> int:
        """Tokens of `ids` whose KV the cache holds now (0 without a cache)."""
        return self.tree.match_len(ids) if self.tree is not None else 0

    def match_lens(self, seqs: list[list[int]]) -> list[int]:
        """`match_len` of each (one call for many: `ParallelEngine` asks its workers once)."""
        return [self.match_len(ids) for ids in seqs]

    data_parallel = 1       # engines behind this one (engine/parallel.py's ParallelEngine has several)
    tensor_parallel = 1     # devices its model is split over (ParallelEngine's workers may span several)

    def close(self) -> None:
        """Nothing to end: the model and its pool go with the process (a ParallelEngine ends its workers)."""

    # ---- runs ------------------------------------------------------------------------------------
    def score(self, requests: Sequence[ScoreRequest], **kw) -> tuple[list[ScoreResult], RunStats]:
        return cast("tuple[list[ScoreResult], RunStats]", self.run(requests, **kw))

    def generate(self, requests: Sequence[GenerateRequest], **kw) -> tuple[list[GenerateResult], RunStats]:
        return cast("tuple[list[GenerateResult], RunStats]", self.run(requests, **kw))

    @torch.inference_mode()
    def run(self, requests: Sequence[Request], schedule: str = "dfs", seed: int = 0,
            progress: Callable[[int, RunStats], None] | None = None,
            plan: Plan | None = None, handover: Handover | None = None,
            groups: Sequence[Hashable] | None = None) -> tuple[list[Result], RunStats]:
        """Execute every request; results come back in the order of `requests`.

        `progress(i, stats)` is called as request i's last prompt token is issued (scoring) or as
        its generation ends. `plan`: `plan_requests(requests, schedule, seed)`, if made already.
        `handover`: results handed over while the run goes on (see `Handover`). `groups`: requests
        of one group run on one device (a program's calls); one engine has one device."""
        t0 = time.perf_counter()
        if plan is None:
            plan = plan_requests(requests, schedule, seed)
        state = RunState(requests, plan, progress, keep_final=handover is not None)
        capture = LogitCapture(state)       # registers every request's logit demands on the plan
        t1 = time.perf_counter()
        kv = KVSlots(self.pool, self.tree, state.stats)
        decode = Decode(state, self.runner, kv, capture, self.sampler, self.options.max_running)
        prefill = Prefill(state, self.runner, kv, capture, decode, self.options.max_tokens_per_batch)

        def hand_over() -> None:
            """The batch being built runs now and every logit in flight is recorded: each request
            reported done so far has its final result."""
            prefill.flush()
            capture.drain()
            final, state.final = state.final, []
            capture.finish_scores(final)
            cast(Handover, handover).take(final, state.results, state.stats)

        tick = (lambda: hand_over() if handover.due() else None) if handover is not None else None
        decode.tick = tick
        for i in plan.order:
            prefill.add(i)
            if tick is not None:
                tick()
        prefill.flush()
        decode.run_all()
        capture.drain()
        capture.finish_scores()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        state.stats.plan_s, state.stats.execute_s = t1 - t0, time.perf_counter() - t1
        return state.results, state.stats


class Handover(Protocol):
    """What a caller of `Engine.run` takes while the run goes on (the runner's checkpoints): between
    prefill batches and decode steps the engine asks `due()`, and when it says so, runs what it has
    queued (a partial batch) and calls `take(final, results, stats)` with the requests whose results
    are final since the last call (scored ones summed, generated ones ended; each once, as they
    finished). `take` may raise to stop the run. The results of the rest come back from `run`."""

    def due(self) -> bool: ...

    def take(self, final: list[int], results: Sequence[Result], stats: RunStats) -> None: ...
