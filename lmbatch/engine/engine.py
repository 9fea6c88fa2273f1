"""The engine: runs a whole batch of score and generate requests in the planner's order over the
radix-tree KV cache.

It keeps what outlives a run (the model on its device with its KV pool, attention backend and decode
graphs: `ModelRunner`; the radix cache; the sampler); each run (`Stream`, engine/stream.py) drives its parts
in one direction:

    plan -> RunState -> Prefill (ragged batches of prompt chunks, in plan order)
                         -> LogitCapture (logits of demanded positions, reduced on the device)
                         -> Decode (continuous batching) -> Sampler (grammar masks, jump-forward)
         -> results

Logits are computed only at positions some request scores or samples from, and are captured
whichever request happens to compute the position.
"""
from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, Iterator, NamedTuple, Sequence, cast

import torch

from lmbatch.engine.model_runner import ModelRunner
from lmbatch.engine.options import DECODE_ROWS, EngineOptions
from lmbatch.engine.protocol import Handover, Progress, Request, Result, StreamArgs, drain
from lmbatch.engine.radix_cache import RadixTree
from lmbatch.engine.sampler import Sampler
from lmbatch.engine.stream import Stream
from lmbatch.model.checkpoint import model_config
from lmbatch.model.network import Transformer
from lmbatch.model.tensor_parallel import TensorParallel, shard_config
from lmbatch.requests import GenerateRequest, GenerateResult, RunStats, ScoreRequest, ScoreResult

if TYPE_CHECKING:
    from pathlib import Path

    from typing_extensions import Unpack

    from lmbatch.engine.model_runner import LanguageModel


class Weights(NamedTuple):
    """How an engine's model gets its weights: `load_format` "auto" (the checkpoint's) or "dummy" (random,
    for speed work); `tp`: this process's rank of a tensor-parallel group (its slice of the model and of
    the KV), None for the whole model."""
    load_format: str = "auto"
    tp: TensorParallel | None = None


class Engine:
    def __init__(self, model: LanguageModel, options: EngineOptions | None = None, *, tokenizer: Any = None,
                 **overrides: Any):
        """`overrides`: EngineOptions fields, e.g. `Engine(model, kv_cache_tokens=4096)`."""
        o = self.options = replace(options or EngineOptions(), **overrides)
        self.rows: int = o.max_running if o.max_running is not None else DECODE_ROWS    # decode rows
        self.wide_rows: int = o.wide_rows if o.wide_rows is not None else self.rows    # ... of many generations
        o = self.options = replace(o, max_running=self.rows, wide_rows=self.wide_rows)
        if o.kv_cache_tokens is None or o.max_tokens_per_batch is None:
            raise ValueError("EngineOptions' sizes are left to fit: engine.build.fit decides them")
        self.batch_tokens: int = o.max_tokens_per_batch
        self.cfg, self.tokenizer = model.cfg, tokenizer
        self.model_runner = ModelRunner(model, o)
        self.model, self.device, self.pool = model, self.model_runner.device, self.model_runner.pool
        self.attn, self.graphs = self.model_runner.attn, self.model_runner.graphs
        self.tree = RadixTree(self.pool.free) if o.cache else None
        self.sampler = Sampler(self.cfg, self.device, tokenizer=tokenizer, masks=o.masks,
                               jump_forward=o.jump_forward, max_rows=max(self.rows, self.wide_rows))

    @classmethod
    def from_pretrained(cls, path: str | Path, options: EngineOptions | None = None, *,
                        device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                        tokenizer: Any = None, weights: Weights = Weights(), **overrides: Any) -> "Engine":
        """An engine over the checkpoint folder `path` (see `Weights`): our network for the model_types
        it implements, else transformers' model (model/fallback.py)."""
        from lmbatch.model.weights import init_dummy, load_weights

        load_format, tp = weights
        options = replace(options or EngineOptions(), **overrides)
        cfg = model_config(path)
        model: LanguageModel
        if tp is not None:
            model = Transformer.empty(shard_config(cfg, tp.size), device, dtype, tp)
            init_dummy(model) if load_format == "dummy" else load_weights(model, path, full=cfg)
        elif cfg.runtime == "transformers":
            from lmbatch.model.fallback import HFCausalLM
            model = HFCausalLM.load(path, device, dtype, random_weights=load_format == "dummy")
        else:
            model = Transformer.empty(cfg, device, dtype)
            fp8_gemm = bool(options.fp8_gemm)      # fitted: engine/build.py
            init_dummy(model) if load_format == "dummy" else load_weights(model, path, fp8_gemm=fp8_gemm)
        return cls(model.eval(), options, tokenizer=tokenizer)

    def warm_up(self, tokens: int = 16, graphs: bool = True) -> None:
        """Compile kernels and load libraries now, not in the first real batch, and with `graphs`
        capture the decode graphs now rather than at the first decode step (see ModelRunner)."""
        self.model_runner.warm_up(tokens)
        if graphs:
            self.model_runner.capture_graphs()

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

    data_parallel = 1       # one engine (BatchEngine)
    open_stream = True      # `stream` takes `feed`
    tensor_parallel = 1     # its model on one device (a worker's rank of a split model is driven by its group)

    def optimal_unique_tokens(self) -> int | None:
        return None

    def load_report(self) -> list[dict[str, float | int]]:
        return []

    def close(self) -> None:
        """Nothing to end: the model and its pool go with the process."""

    # ---- runs ------------------------------------------------------------------------------------
    def score(self, requests: Sequence[ScoreRequest], **kw: Any) -> tuple[list[ScoreResult], RunStats]:
        return cast("tuple[list[ScoreResult], RunStats]", self.run(requests, **kw))

    def generate(self, requests: Sequence[GenerateRequest], **kw: Any) -> tuple[list[GenerateResult], RunStats]:
        return cast("tuple[list[GenerateResult], RunStats]", self.run(requests, **kw))

    def run(self, requests: Sequence[Request], *, schedule: str = "dfs", seed: int = 0,
            progress: Progress | None = None) -> tuple[list[Result], RunStats]:
        """Every result, in the order of `requests`, and the run's counts (`stream`, drained)."""
        return drain(self.stream(requests, schedule=schedule, seed=seed, progress=progress))

    def stream(self, requests: Sequence[Request], **args: Unpack[StreamArgs]) -> Iterator[Handover]:
        """Execute every request in the plan's order (`plan_requests(requests, schedule, seed)` unless
        made already), handing results over as `handover_due()` asks (see `protocol.Handover`).

        `progress(i, stats)` is called as request i's last prompt token is issued (scoring) or as its
        generation ends, and as `progress(-1, stats)` between decode steps (`stats.decoding_tokens`).
        `groups` (a program's calls on one device) changes nothing on one engine.

        With `feed` the stream is open: requests join it while it runs (engine/stream.py)."""
        try:
            with torch.inference_mode():
                yield from Stream(self, requests, args).run()
        finally:
            if self.model_runner.threads is not None:
                self.model_runner.threads.restore()       # the process's own thread setting back
