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

import json
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import lm_eval.models  # noqa: F401  (lm-eval's own names first: it loads them only into an empty registry)
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model

from lmbatch.errors import UserError, first_line
from lmbatch.lm_eval.index import building, index_built_once
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


def cache_templates() -> None:
    """lm-eval compiles a task's jinja template again for every document it renders
    (`lm_eval.utils.apply_template`: a quarter of building MMLU 5-shot's requests). Here each template
    string is compiled once and rendered by the same environment, so every prompt is the same text.
    `lmbatch lm-eval` does this; Python API users may call it before `simple_evaluate`."""
    from functools import lru_cache

    from lm_eval import utils

    if getattr(utils.apply_template, "lmbatch_cached", False):
        return
    compiled = lru_cache(maxsize=4096)(utils.env.from_string)

    def apply_template(template: str, doc: dict) -> str:
        return compiled(template).render(**doc)

    apply_template.lmbatch_cached = True        # type: ignore[attr-defined]
    utils.apply_template = apply_template


def main(args: list[str]) -> int:
    """`lmbatch lm-eval ARGS`: lm-eval's own command line with `--model lmbatch` (unless another model
    is named), then lmbatch's figures beside lm-eval's results (`lmbatch_*.json` in --output_path)
    and in a closing line. What can be checked before lm-eval starts is (`check_run`): a bad input is a
    UserError of one line, not lm-eval's traceback."""
    from lm_eval._cli import HarnessCLI
    from lm_eval.utils import setup_logging

    start = time.perf_counter()
    args = _command_line(args)
    sys.argv = ["lm-eval", *args]
    cli = HarnessCLI()
    ns = cli.parse_args()
    with index_built_once() as checked, _tasks_name_their_data():
        if getattr(ns, "command", None) == "run":
            if building():      # lm-eval's index is being built elsewhere: imports the run needs meanwhile
                _import_for_run()
            if ns.model == "lmbatch":
                one_device(ns)
            if check_run(ns):
                from lmbatch.lm_eval.engine import tasks_generate

                tasks_generate()
        checked()
        setup_logging()
        cache_templates()
        with _env_info_ahead(getattr(ns, "command", None) == "run"):
            cli.execute(ns)
    if not INSTANCES:
        return 0
    report = INSTANCES[-1].report()
    report["time_s"]["total"] = time.perf_counter() - start
    out = _output_dir(args)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        path = out / time.strftime("lmbatch_%Y%m%dT%H%M%S.json")
        path.write_text(json.dumps(report, indent=2) + "\n")
    kept, t = report["scores_from_cache"], report["time_s"]
    ran = "" if kept == report["requests"] else \
        (f"  hit rate {report['hit_rate']:.4f} (optimum {report['optimal_hit_rate']:.4f})  computed "
         f"{report['tokens']['computed']:,} of {report['tokens']['prompt']:,} prompt tokens")
    print(f"lmbatch: {report['requests']} requests" + (f", {kept} scores from the score cache (score_cache=false "
          f"computes them)" if kept else "") + f"{ran}  wall {t['total']:.1f}s (model load {t['load_background']:.1f} "
          f"in the background, waited {t.get('load_waited', 0.0):.1f}; execute {t.get('execute', 0.0):.1f})",
          file=sys.stderr)
    return 0


def _import_for_run() -> None:
    """What a run imports anyway (lm-eval's evaluator, tasks and its HF tokenizer classes)."""
    import lm_eval.api.task  # noqa: F401
    import lm_eval.evaluator  # noqa: F401
    from transformers import AutoTokenizer  # noqa: F401


def _command_line(args: list[str]) -> list[str]:
    """lm-eval's arguments for `lmbatch lm-eval ARGS`: its `run` unless another command is named (`ls`,
    `validate`), and for `run`, `--model lmbatch` unless another model is named."""
    command, rest = (args[0], args[1:]) if args and args[0] in ("run", "ls", "validate") else ("run", args)
    if command == "run" and not any(a in ("--model", "-M") or a.startswith("--model=") for a in rest):
        rest = ["--model", "lmbatch", *rest]
    return [command, *rest]


# ---- `lmbatch lm-eval run`'s inputs, checked before lm-eval starts ------------------------------------
def _alternatives(values: Sequence[str]) -> str:
    return ", ".join(values[:-1]) + " or " + values[-1]


def _whole(value: Any, least: int) -> bool:
    """A whole number of at least `least`, as lm-eval parses it from --model_args (42, or a quoted "42")."""
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    return type(value) is int and value >= least


def check_model_args(args: dict[str, Any]) -> None:
    """The model_args lmbatch takes, as `LMBatch` gets them (None: not given): a UserError naming the
    argument and what it takes, before any work."""
    from lmbatch.engine.build import ATTENTION, DEVICES, DTYPES
    from lmbatch.scheduler.planner import SCHEDULES

    def bad(name: str, takes: str) -> UserError:
        value = args[name]      # lm-eval reads "-5" as -5.0
        shown = int(value) if isinstance(value, float) and value.is_integer() else value
        return UserError(f"--model_args {name}={shown}: {takes}")

    choices = {"dtype": ("auto", *DTYPES), "device": DEVICES, "attention": ATTENTION, "schedule": SCHEDULES}
    for name, allowed in choices.items():
        if args.get(name) is not None and args[name] not in allowed:
            raise bad(name, f"use {_alternatives(allowed)}")
    for name in ("max_length", "max_tokens_per_batch", "kv_cache_tokens", "threads"):
        if args.get(name) is not None and not _whole(args[name], 1):
            raise bad(name, "use a whole number, at least 1")
    for name, what in (("data_parallel", "a number of workers"), ("tensor_parallel", "a number of devices")):
        if args.get(name) is not None and args[name] != "auto" and not _whole(args[name], 1):
            raise bad(name, f"use {what} (at least 1) or auto")
    if args.get("prefix_token_id") is not None and not _whole(args["prefix_token_id"], 0):
        raise bad("prefix_token_id", "use a token id (a whole number, at least 0)")
    for name in ("add_bos_token", "score_cache", "deterministic"):
        if args.get(name) not in (None, True, False):
            raise bad(name, "use true or false")


def check_dtype_on_device(dtype: Any, device: Any) -> None:
    """`dtype=float16` where the model would run on the CPU (`device` cpu, or auto without a visible GPU):
    a UserError naming the model_arg, before any work (the engine's own check names `lmbatch run`'s --dtype,
    and comes once the model loads)."""
    from lmbatch.engine.devices import visible_gpus

    if str(dtype) != "float16" or str(device or "auto") not in ("cpu", "auto"):
        return
    if str(device or "auto") == "cpu" or visible_gpus().visible == 0:
        where = "on CPU" if str(device or "auto") == "cpu" else "on CPU (no GPU is visible here)"
        raise UserError(f"--model_args dtype=float16 {where}: use dtype=float32 (or bfloat16, ~100x slower on "
                        "most CPUs)")


def one_device(ns: Any) -> None:
    """The model's device, from `--model_args device=` or `--device` (both: the same one), as --device:
    lm-eval hands the model its --device beside the model args (cuda:0 where none is given, GPU or not),
    so one named in the model args moves to --device; neither is auto. Two different ones: a UserError."""
    args = ns.model_args if isinstance(ns.model_args, dict) else {}
    if "device" in args:
        device = args.pop("device")
        check_model_args({"device": device})
        if ns.device is not None and str(ns.device) != str(device):
            raise UserError(f"--model_args device={device} and --device {ns.device}: two devices; give one")
        ns.device = str(device)
    elif ns.device is None:
        ns.device = "auto"


def check_run(ns: Any) -> bool:
    """`lmbatch lm-eval run`'s inputs (lm-eval's parsed arguments), each bad one a UserError of one line
    (lm-eval would raise its ValueError or a ConnectionError deep inside, or lmbatch an error of its own
    after lm-eval's start): lmbatch's model_args and its model folder, that tasks are named, that lm-eval
    knows them, and, offline, that their data is at hand. Returns whether a task may generate text
    (True where the tasks cannot be told from lm-eval's index: a config file, task files, Python tasks)."""
    model_args = dict(ns.model_args or {})
    if ns.model == "lmbatch":
        passed = {"batch_size": True, "max_batch_size": ns.max_batch_size is not None}
        for key in (k for k, given in passed.items() if given and k in model_args):
            raise UserError(f"--model_args {key}={model_args[key]}: lm-eval gives the model its {key} itself: "
                            f"give it as --{key} only")
        if ns.device is not None and ns.device not in ("auto", "cpu", "cuda"):
            raise UserError(f"--device {ns.device}: lmbatch runs on auto, cpu or cuda")
        check_model_args(model_args)
        check_dtype_on_device(model_args.get("dtype"), ns.device or model_args.get("device"))
    if not ns.tasks:
        if ns.config:       # tasks may come from the config file: lm-eval reads it
            return True
        raise UserError("give --tasks: lm-eval task, group or tag names, comma-separated "
                        "(`lmbatch lm-eval ls tasks` lists them)")
    if ns.model == "lmbatch":
        _check_pretrained(model_args.get("pretrained"))
    return _check_tasks([t for task in ns.tasks for t in str(task).split(",") if t], ns.include_path)


def _check_pretrained(pretrained: Any) -> None:
    """The model folder `pretrained=` names (the embedded model where none is): checked as `lmbatch run`
    checks it, before lm-eval starts; a hub id is left to `LMBatch` (it downloads)."""
    from lmbatch.model.checkpoint import check_tokenizer_files, names_hub_model, resolve_model

    if pretrained is not None and names_hub_model(str(pretrained)):
        return
    check_tokenizer_files(resolve_model(None if pretrained is None else str(pretrained)))


def _check_tasks(names: list[str], include_path: str | None) -> bool:
    """Every task name is one lm-eval's index has (a task, group or tag, or a glob of them), or a task
    file; offline, every task's data is local. Returns whether a task may generate (`_may_generate`)."""
    import difflib
    import glob

    from lm_eval.tasks import TaskManager

    for name in names:
        if name.endswith(".yaml") and not glob.glob(name):
            raise UserError(f"--tasks {name}: no such task file")
    if len(names) == 1 and Path(names[0]).is_dir():
        return True     # a folder of task files (unless a task has its name): lm-eval reads it
    files = [n for n in names if n.endswith(".yaml")]
    names = [n for n in names if not n.endswith(".yaml")]
    if not names:
        return True
    manager = TaskManager(include_path=include_path)
    for name in names:
        if not manager.match_tasks([name]):
            close = difflib.get_close_matches(name, manager.all_tasks, n=3)
            raise UserError(f"--tasks {name}: lm-eval has no task, group or tag of that name"
                            + (f" (close: {', '.join(close)})" if close else "")
                            + ("" if include_path else "; tasks of your own go in a folder given as --include_path"))
    offline = next((v for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
                    if os.environ.get(v, "").upper() in ("1", "ON", "YES", "TRUE")), None)
    if offline:
        for asked, task, dataset in _hub_datasets(manager, names):
            if not _in_local_cache(dataset):
                of = "" if asked == task else f" (of {asked})"
                raise UserError(f"--tasks {asked}: lm-eval task {task}{of} reads {dataset} from the Hugging Face "
                                f"Hub, which is not in the local cache, and {offline} is set: run it once online, "
                                f"or use tasks over local files (lmbatch lm-eval-tasks DIR writes "
                                f"mmlu_offline, hellaswag_offline and gsm8k_offline for --include_path)")
    return bool(files) or _may_generate(manager, names)


def _leaves(manager: Any, names: list[str]) -> Iterator[tuple[str, str, str, dict[str, Any]]]:
    """(name asked for, task, kind, config) of every task the names stand for, groups and tags expanded
    through lm-eval's index: kind TASK, PY_TASK (a Python class) or UNKNOWN, which stands for what the
    index does not resolve (a task given inline with its own output type, whose settings are yielded as
    they stand, or a name the index lacks)."""
    index = manager.task_index
    stack: list[tuple[str, Any]] = [(n, m) for n in names for m in manager.match_tasks([n])]
    seen: set[str] = set()
    while stack:
        asked, item = stack.pop()
        if isinstance(item, dict):          # a group's member given with overrides, or a group or task inline
            if "output_type" in item:
                yield asked, str(item.get("task")), "UNKNOWN", item
            stack += [(asked, m) for m in _members(item.get("task"))]
            continue
        if not isinstance(item, str) or item in seen:
            continue
        seen.add(item)
        entry = index.get(item)
        if entry is None:
            yield asked, item, "UNKNOWN", {}
            continue
        kind, cfg = entry.kind.name, entry.cfg or {}
        if kind == "GROUP":
            stack += [(asked, m) for m in _members(cfg.get("task"))]
        elif kind == "TAG":
            stack += [(asked, m) for m in sorted(entry.tags)]
        else:
            yield asked, item, kind, cfg


def _may_generate(manager: Any, names: list[str]) -> bool:
    """Whether a task the names stand for generates text (lm-eval's `output_type` generate_until, also
    its default), or may: a task the index does not resolve, or one of a Python class."""
    return any(kind != "TASK" or cfg.get("class") or cfg.get("output_type", "generate_until") == "generate_until"
               for _, _, kind, cfg in _leaves(manager, names))


def _hub_datasets(manager: Any, names: list[str]) -> Iterator[tuple[str, str, str]]:
    """(name asked for, task, dataset) of every task the names stand for whose dataset_path is a Hugging
    Face Hub dataset: neither one of `datasets`' packaged builders (json, arrow, ...) nor a local path;
    tasks of Python classes or custom loaders are not looked into."""
    from datasets.packaged_modules import _PACKAGED_DATASETS_MODULES

    for asked, task, kind, cfg in _leaves(manager, names):
        if kind == "TASK" and not ({"class", "custom_dataset"} & set(cfg)):
            path = cfg.get("dataset_path")
            if isinstance(path, str) and path not in _PACKAGED_DATASETS_MODULES and not Path(path).exists():
                yield asked, task, path


def _members(task: Any) -> list[Any]:
    return list(task) if isinstance(task, list) else [task] if task else []


def _in_local_cache(dataset: str) -> bool:
    """Whether a Hub dataset has been fetched here before (`datasets`' cache or the hub's)."""
    import datasets.config
    from huggingface_hub import constants

    return (Path(datasets.config.HF_DATASETS_CACHE) / dataset.replace("/", "___")).is_dir() or \
        (Path(constants.HF_HUB_CACHE) / ("datasets--" + dataset.replace("/", "--"))).is_dir()


@contextmanager
def _env_info_ahead(run: bool) -> Iterator[None]:
    """lm-eval's results carry torch's environment report (`add_env_info` calls `get_pretty_env_info`:
    `pip list`, `nvidia-smi` and more in subprocesses, seconds at the end of every run). For a `run`
    it is made on a thread of its own from the start, beside the run's work, and lm-eval's call takes
    it: the same function in the same process, so the same text (or the same error, which lm-eval
    reports in its place)."""
    try:
        from torch.utils import collect_env
    except ImportError:
        run = False
    if not run:
        yield
        return
    own = collect_env.get_pretty_env_info
    made: dict[str, Any] = {}

    def make() -> None:
        try:
            made["info"] = own()
        except Exception as e:  # noqa: BLE001  raised again where lm-eval calls it (it reports the error)
            made["error"] = e

    thread = threading.Thread(target=make, name="lmbatch-env-info", daemon=True)
    thread.start()

    def get_pretty_env_info() -> str:
        thread.join()
        if "error" in made:
            raise made["error"]
        return str(made["info"])

    collect_env.get_pretty_env_info = get_pretty_env_info
    try:
        yield
    finally:
        collect_env.get_pretty_env_info = own
        thread.join()       # not left inside torch or a subprocess when the process ends


@contextmanager
def _tasks_name_their_data() -> Iterator[None]:
    """While lm-eval runs, a task whose data cannot be read (the Hub unreachable or offline, a data file
    missing: an OSError, ConnectionError included) is a UserError of one line naming the task and its
    dataset, not lm-eval's traceback. What cannot be checked up front; any other error is left as it is."""
    from lm_eval.api.task import ConfigurableTask

    own = ConfigurableTask.download

    def download(self: Any, *args: Any, **kwargs: Any) -> None:
        try:
            local = _local_arrow(self.config, kwargs.get("dataset_kwargs", args[0] if args else None))
            if local is not None:
                self.dataset = local
            else:
                own(self, *args, **kwargs)
        except OSError as e:
            c = self.config
            raise UserError(f"lm-eval task {c.task}: its data ({c.dataset_path}"
                            f"{', ' + str(c.dataset_name) if c.dataset_name else ''}) cannot be loaded: "
                            f"{type(e).__name__}: {first_line(e)}") from None

    ConfigurableTask.download = download
    try:
        yield
    finally:
        ConfigurableTask.download = own


def _local_arrow(config: Any, dataset_kwargs: Any) -> Any:
    """A task's data when it is local Arrow files only (`dataset_path: arrow`, `data_files` naming a file
    per split, no other option; as `write_offline_tasks` writes them): each file read straight into
    memory (`Dataset.from_file`), the same rows and features `datasets.load_dataset` would give
    without copying them into its cache first (57 loads for MMLU). Else None: lm-eval loads it."""
    if config.dataset_path != "arrow" or config.dataset_name or callable(config.custom_dataset):
        return None
    kw = dict(dataset_kwargs or {})
    files = kw.pop("data_files", None)
    if kw or not isinstance(files, dict) or not files:
        return None
    if not all(isinstance(f, str) and f.endswith(".arrow") and Path(f).is_file() for f in files.values()):
        return None
    import datasets

    return datasets.DatasetDict({split: datasets.Dataset.from_file(f, in_memory=True) for split, f in files.items()})


def _output_dir(args: list[str]) -> Path | None:
    for i, a in enumerate(args):
        value = a.split("=", 1)[1] if a.startswith("--output_path=") else (
            args[i + 1] if a in ("--output_path", "-o") and i + 1 < len(args) else None)
        if value:
            path = Path(value)
            return path.parent if path.suffix == ".json" else path
    return None
