"""lm-evaluation-harness backend: lm-eval's requests of one call, all tasks together, run as one batch
on the lmbatch engine (one radix tree, DFS order, each shared prefix's KV computed once).

lm-eval hands a backend every request of a type at once (`loglikelihood`, `loglikelihood_rolling`,
`generate_until`): the whole-batch-up-front shape the planner needs. Token ids are made as lm-eval's
HF backend makes them (`tok_encode` with its BOS rule, `TemplateLM._encode_pair`, the empty-context
prefix token, left truncation to `max_length`), so contexts and continuations are the ids
`--model hf` scores; only how they are computed differs. `batch_size` and `max_batch_size` are
accepted and change nothing: every request of a call is one batch.

    from lm_eval import simple_evaluate
    from lmbatch.lm_eval.backend import LMBatch
    simple_evaluate(model=LMBatch(pretrained="path/or/hub-id"), tasks=["hellaswag"])
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import lm_eval.models  # noqa: F401  (lm-eval's own names first: it loads them only into an empty registry)
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model

from lmbatch.lm_eval.checks import (
    check_dtype_on_device,
    check_model_args,
)
from lmbatch.lm_eval.offline import write_offline_tasks as write_offline_tasks  # its old home
from lmbatch.lm_eval.tokens import PairTokenizer
from lmbatch.requests import RunStats, optimal_hit_rate
from lmbatch.scheduler.planner import plan_requests

if TYPE_CHECKING:
    from lm_eval.api.instance import Instance

    from lmbatch.engine.protocol import BatchEngine
    from lmbatch.run.loading import Loaded
    from lmbatch.scheduler.planner import Plan

log = logging.getLogger(__name__)
DEFAULT_MAX_GEN_TOKS = 256      # lm-eval's HF backend's default
INSTANCES: list[LMBatch] = []   # the backend made last in this process (lm-eval makes its model itself); one
# only: each holds its engine's weights and KV pool, and a process that evaluates again keeps the new one


@register_model("lmbatch")
class LMBatch(TemplateLM):
    """`--model lmbatch --model_args pretrained=DIR,dtype=...,device=...` (plus lmbatch's own
    `max_tokens_per_batch`, `kv_cache_tokens`, `schedule`, and `data_parallel`, `tensor_parallel`,
    `ray_address` as `lmbatch run` has them: each call's batch is cut along whole subtrees, never
    handed out round-robin; `score_cache`: false computes a loglikelihood call's scores even where
    the same call on the same model files and numerics kept them, caches/scores.py; `deterministic`, as
    `lmbatch run --deterministic`; and `threads`, as `lmbatch run --threads`)."""

    backend = "causal"

    def __init__(self, pretrained: str | None = None, dtype: str | None = None, device: str = "auto",
                 max_length: int | None = None, add_bos_token: bool | None = None,
                 prefix_token_id: int | None = None, max_tokens_per_batch: int | None = None,
                 kv_cache_tokens: int | None = None, schedule: str = "dfs", batch_size: Any = None,
                 max_batch_size: Any = None, data_parallel: int | str = "auto", tensor_parallel: int | str = "auto",
                 ray_address: str | None = None, attention: str = "auto", score_cache: bool = True,
                 think_end_token: str | int | None = None, deterministic: bool = False, threads: int | None = None,
                 **unused: Any):
        super().__init__()
        start = time.perf_counter()
        from transformers import AutoTokenizer

        from lmbatch.engine.build import pick_device
        from lmbatch.engine.devices import layout
        from lmbatch.lm_eval.engine import engine_spec, loader_for
        from lmbatch.lm_eval.generate import think_end
        from lmbatch.model.checkpoint import check_tokenizer_files, model_config, resolve_model

        check_model_args({"dtype": dtype, "device": device, "max_length": max_length, "add_bos_token": add_bos_token,
                          "prefix_token_id": prefix_token_id, "max_tokens_per_batch": max_tokens_per_batch,
                          "kv_cache_tokens": kv_cache_tokens, "schedule": schedule, "data_parallel": data_parallel,
                          "tensor_parallel": tensor_parallel, "attention": attention, "score_cache": score_cache,
                          "deterministic": deterministic, "threads": threads})
        if batch_size not in (None, 1, "1") or max_batch_size is not None:
            log.info("lmbatch: batch_size/max_batch_size have no effect: each call's requests run as one batch, "
                     "in token-budgeted forward passes, and scores do not depend on batching")
        if unused:
            log.warning("lmbatch: model_args not used: %s", ", ".join(sorted(unused)))
        check_dtype_on_device(dtype, device)
        model_dir = resolve_model(pretrained)      # checked by our own code before transformers reads it
        numerics = pick_device(str(device or "auto"), dtype if dtype not in (None, "auto") else None)  # errors now
        check_tokenizer_files(model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        # the model loads on a thread of its own (as for `lmbatch run`) while lm-eval builds its tasks:
        # started by `lmbatch lm-eval` before lm-eval's imports where it could be (lm_eval/engine.py), else
        # here (lm-eval makes its model before its tasks); the first call takes the engine (`loaded`)
        spec = engine_spec(model_dir, {"device": device, "dtype": dtype, "kv_cache_tokens": kv_cache_tokens,
                                       "max_tokens_per_batch": max_tokens_per_batch, "attention": attention,
                                       "data_parallel": data_parallel, "tensor_parallel": tensor_parallel,
                                       "ray_address": ray_address, "deterministic": deterministic,
                                       "threads": threads})
        self._loader = loader_for(spec, self.tokenizer)
        self._engine: Loaded | None = None
        self._model_dir = Path(model_dir)
        self.tokens = PairTokenizer(self.tokenizer, add_bos_token, prefix_token_id,
                                    int(max_length) if max_length else _context_length(model_dir, self.tokenizer))
        self.schedule = schedule
        self.think_end_token = think_end(think_end_token)   # generated text: only what follows it
        # a call's scores are kept (caches/scores.py) under its requests and these (the workers' and devices'
        # counts as auto decides them here: each worker's batches decide the last bits): not for workers elsewhere
        self._numerics = (*numerics, {"engine": repr(spec), "schedule": schedule,
                                      "layout": layout(spec, model_config(model_dir))[:2]}) \
            if score_cache and ray_address is None else None
        self.kept_scores = 0        # scores read from the score cache
        self.stats = RunStats()     # every call's counts, for the run's report
        self.seconds: dict[str, float] = {"setup": time.perf_counter() - start}
        INSTANCES[:] = [self]

    @property
    def loaded(self) -> Loaded:
        """The engine (waited for on first use: the longest request lm-eval can send is max_length + 1
        tokens), the backend it runs and the model side's seconds by step."""
        if self._engine is None:
            t = time.perf_counter()
            self._engine = self._loader.result(self.max_length + 1)
            self.seconds["load_waited"] = time.perf_counter() - t
        return self._engine

    @property
    def engine(self) -> BatchEngine:
        return self.loaded.engine

    def close(self) -> None:
        """Ends the engine (data-parallel workers), waiting for a load still under way."""
        self._loader.thread.join()
        if self._loader.loaded is not None:
            self._loader.loaded.engine.close()

    # ---- tokenization, as lm-eval's HF backend does it (lm_eval/tokens.py) ---------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        return self.tokens.prefix_token_id

    @property
    def max_length(self) -> int:
        return self.tokens.max_length

    @property
    def max_gen_toks(self) -> int:
        return DEFAULT_MAX_GEN_TOKS

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None,
                   **kwargs: Any) -> list[int]:
        ids = self.tokens.encode(string, add_special_tokens)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    # ---- chat templates (--apply_chat_template), as lm-eval's HF backend renders them ------------
    @property
    def tokenizer_name(self) -> str:
        return str(self.tokenizer.name_or_path).replace("/", "__")

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        from lmbatch.frontend.chat import apply_template

        return apply_template(self.tokenizer, chat_history, add_generation_prompt)

    def tok_decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))

    # ---- the three request types ------------------------------------------------------------------
    def _run(self, requests: list, disable_tqdm: bool = False, plan: Plan | None = None) -> list:
        from lmbatch.engine.protocol import drain
        from lmbatch.run.progress import TokenProgress

        bar = TokenProgress("lmbatch", disable=disable_tqdm or len(requests) < 2)
        results, stats = drain(self.engine.stream(requests, schedule=self.schedule, plan=plan, progress=bar))
        bar.close()
        self.stats.add_run(stats)
        self.stats.unique_tokens += stats.unique_tokens
        for phase, t in (("plan", stats.plan_s), ("execute", stats.execute_s)):
            self.seconds[phase] = self.seconds.get(phase, 0.0) + t
        return results

    def report(self) -> dict[str, Any]:
        """lmbatch's figures for the run so far: hit rate and its optimum over every call's tree,
        tokens computed vs prompt tokens, seconds by phase."""
        st = self.stats
        return {"requests": st.requests + self.kept_scores, "scores_from_cache": self.kept_scores,
                "executed_requests": st.executed, "hit_rate": st.hit_rate,
                "optimal_hit_rate": optimal_hit_rate(st.unique_tokens, st.prompt_tokens),
                "tokens": {"prompt": st.prompt_tokens, "cached": st.cached_tokens, "computed": st.computed_tokens,
                           "unique": st.unique_tokens, "decode": st.decode_tokens},
                "model": str(self.engine.cfg.model_type), "model_runtime": self.engine.cfg.runtime,
                "attention": {"backend": self.loaded.attention.name, "why": self.loaded.attention.why},
                "device": self.loaded.spec.device, "data_parallel": self.engine.data_parallel,
                "tensor_parallel": self.engine.tensor_parallel, "layout": self.loaded.layout,
                "workers_load": self.engine.load_report(),
                "time_s": {**self.seconds, **self.loaded.seconds}}

    def loglikelihood(self, requests: list[Instance], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """`TemplateLM.loglikelihood`'s token ids, made in bulk (`PairTokenizer.score_requests`; lm-eval
        encodes two long texts per request one by one). The ids and the plan are kept in the workload
        cache under the requests' text: a repeat of the call tokenizes and plans nothing. The scores are
        kept too (caches/scores.py): a repeat on the same model files and numerics computes nothing."""
        from lmbatch.caches import scores as score_cache
        from lmbatch.caches import workloads as workload_cache

        start = time.perf_counter()
        pairs = [req.args for req in requests]
        name = self.tokens.cache_key(pairs, self.schedule, self._model_dir)
        scores_at = None if self._numerics is None else \
            score_cache.path_of(score_cache.key(name, self._model_dir, *self._numerics))
        kept = None if scores_at is None else score_cache.load(scores_at, len(pairs))
        if kept is not None:
            self.kept_scores += len(kept)
            log.info("lmbatch: %d loglikelihood scores read from the score cache (computed before with the same "
                     "model files and numerics; score_cache=false computes them again)", len(kept))
            self.seconds["prepare"] = self.seconds.get("prepare", 0.0) + time.perf_counter() - start
            return self._answered(pairs, kept)
        entry = workload_cache.path_of(name)
        cached = workload_cache.load_scores(entry)
        plan: Plan | None
        if cached is None:
            t = time.perf_counter()
            reqs = self.tokens.score_requests(pairs)
            self.seconds["tokenize"] = self.seconds.get("tokenize", 0.0) + time.perf_counter() - t
            # one engine runs the plan made here; data-parallel workers are given its chunks in its order
            plan = plan_requests(reqs, self.schedule)
            workload_cache.store_scores(entry, reqs, plan)
        else:
            reqs, plan = cached
        self.seconds["prepare"] = self.seconds.get("prepare", 0.0) + time.perf_counter() - start
        out = [(r.logprob, r.is_greedy) for r in self._run(reqs, disable_tqdm, plan)]
        if scores_at is not None:
            score_cache.store(scores_at, out)
        return self._answered(pairs, out)

    def _answered(self, pairs: list[tuple[str, str]], out: list[tuple[float, bool]]) -> list[tuple[float, bool]]:
        for key, answer in zip(pairs, out):
            self.cache_hook.add_partial("loglikelihood", key, answer)
        return out

    def _loglikelihood_tokens(self, requests: Sequence[tuple[tuple[str, str] | None, list[int], list[int]]],
                              disable_tqdm: bool = False, **kwargs: Any) -> list[tuple[float, bool]]:
        """(logprob, is_greedy) of each (context, continuation) pair of token ids (cut as `PairTokenizer.cut`)."""
        results = self._run(self.tokens.cut([(context, continuation) for _, context, continuation in requests]),
                            disable_tqdm)
        out = [(r.logprob, r.is_greedy) for r in results]
        for (key, _, _), answer in zip(requests, out):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return out

    def loglikelihood_rolling(self, requests: list[Instance], disable_tqdm: bool = False) -> list[float]:
        """Each text's loglikelihood over lm-eval's disjoint rolling windows; the windows of every
        text go to the engine together."""
        from lm_eval import utils

        windows, owner = [], []
        for i, (text,) in enumerate(req.args for req in requests):
            for context, pred in map(utils.make_disjoint_window, utils.get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, context, pred))
                owner.append(i)
        scores = self._loglikelihood_tokens(windows, disable_tqdm)
        totals = [0.0] * len(requests)
        for i, (logprob, _) in zip(owner, scores):
            totals[i] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        """Each context continued until a stop string (the task's `until` and the EOS text) or
        `max_gen_toks`; greedy unless the task samples, each sampled request with a seed of its own
        (its task, document and repeat: lm_eval/generate.py). The text is cut at the first stop string,
        after the thinking part where `think_end_token` is given, as lm-eval's HF backend cuts it."""
        from lmbatch.lm_eval.generate import engine_requests, generated_text

        reqs, stops = engine_requests(self, requests)
        out = []
        for req, res, until in zip(requests, self._run(reqs, disable_tqdm), stops):
            text = generated_text(res.token_ids, self.tok_decode, until, self.think_end_token)
            self.cache_hook.add_partial("generate_until", req.args, text)
            out.append(text)
        return out


def _context_length(model_dir: str | Path, tokenizer: Any) -> int:
    """The model's context as lm-eval's HF backend resolves it (its config's, else the tokenizer's,
    else 2048)."""
    from lm_eval.models.utils import resolve_max_length
    from transformers import AutoConfig

    return int(resolve_max_length(AutoConfig.from_pretrained(str(model_dir)), tokenizer, default=2048))
