"""`lmbatch run`: load a task's instances, plan and execute them, write the run directory.

What a user waits for is the whole command, so every phase is timed from the process's start
(`summary.json` `time_s`), and on a GPU the model is loaded (CUDA started, weights read, kernels
warmed, decode graphs captured) on a background thread while the host loads the data, tokenizes and
plans. `--dry-run` stops before any model work and prints the plan's figures.
"""
from __future__ import annotations

import datetime as dt
import gc
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, cast

import lmbatch
from lmbatch.errors import Interrupted, UserError, first_line
from lmbatch.frontend.registry import get_workload
from lmbatch.frontend.workload import LoadArgs, Workload
from lmbatch.timing import Phases, largest

DTYPES = ("float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
CPU_BATCH_TOKENS = 4096


def _option(default: Any, help: str, flag: str | None = None) -> Any:
    """A RunOptions field with its `lmbatch run` help. `flag` is the option's spelling where it is not
    --field-name; a true-by-default bool field with the flag --no-field-name is set false by giving it."""
    return field(default=default, metadata={"help": help, "flag": flag})


@dataclass
class RunOptions:
    """The options of one `lmbatch run`, each declared once, here: `lmbatch.cli` makes the command's
    parameters from these fields, in this order, with their defaults and the help in their metadata.
    `_check` and `_device` validate them."""

    task: str = field(metadata={"help": "Task name (see `lmbatch tasks`) or a program file path/to/file.py.",
                                "argument": True})
    shots: int = _option(0, "Few-shot examples per prompt (mmlu: 0 to 5; json and tot-gsm8k: 0).")
    model: str | None = _option(None, "Local HF folder or hub id; default: the embedded SmolLM2-135M-Instruct.")
    limit: int | None = _option(None, "First N instances (per subject for mmlu, as lm-eval's --limit).")
    subjects: list[str] | None = _option(None, "Only these MMLU subjects (repeatable).")
    device: str = _option("auto", "auto (CUDA when a GPU is visible, else CPU), cpu or cuda.")
    dtype: str | None = _option(None, "float32 (CPU default), bfloat16 (CUDA default) or float16.")
    max_tokens_per_batch: int | None = _option(     # None: fitted to the device (see _batch_tokens)
        None, "Token budget of one forward batch (default: 4096 on CPU; on CUDA up to 16384, fitted to the model "
              "and free memory).")
    kv_cache_tokens: int | None = _option(None, "KV pool size in tokens (default: 4 GiB on CPU; on CUDA half the "
                                                "free memory, at most 131072 tokens).")
    data_parallel: str = _option("1", "Worker processes, each with its own copy of the model on its own device, "
                                      "each running whole subtrees of the radix tree: a number, or auto (every "
                                      "visible GPU; 1 on CPU).")
    ray_address: str | None = _option(None, "Place the workers on this Ray cluster (host:port, or auto) instead of "
                                            "local processes.")
    tensor_parallel: int = _option(1, "Devices (processes on CPU) each model is split over: attention heads, MLP "
                                      "and vocabulary slices. Workers times this must not exceed the GPUs.")
    schedule: str = _option("dfs", "dfs (radix-tree order), fcfs or random: the last two for ablations.")
    no_cache: bool = _option(False, "Disable prefix caching (ablation).")
    seed: int = _option(0, "Seed for shots drawing, sampling and --schedule random.")
    out: Path = _option(Path("results"), "Parent directory of run directories.")
    run_id: str | None = _option(None, "Run directory name (default: task-shots-model-time).")
    overwrite: bool = _option(False, "Replace an existing run directory (an incomplete one with other settings too; "
                                     "one with the same settings is resumed).")
    checkpoint_s: float = _option(30.0, "Seconds of work between result parts written while the run executes (also "
                                        "one per wave): at most what a crash or Ctrl-C loses.")
    truncate_left: bool = _option(False, "Drop the oldest tokens of prompts longer than the model's context.")
    save_token_ids: bool = _option(False, "Store each request's token ids in requests.parquet.")
    quiet: bool = _option(False, "No progress bar or closing line.")
    apply_chat_template: bool = _option(False, "mmlu, hellaswag: render prompts through the model's chat template, "
                                               "as lm-eval's --apply_chat_template does.")
    system_instruction: str | None = _option(None, "mmlu, hellaswag: a system message before the prompt (lm-eval's "
                                                   "--system_instruction).")
    fewshot_as_multiturn: bool = _option(False, "With --apply-chat-template: each few-shot example as its own user and "
                                                "assistant turns (lm-eval's --fewshot_as_multiturn).")
    think_budget: int | None = _option(None, "Thinking models: every gen first thinks, unconstrained, up to this many "
                                             "tokens; its constraint applies after </think>.")
    think_end: str | None = _option(None, "With --think-budget: the end-of-thinking marker (default: </think>, where "
                                          "the tokenizer or its chat template has it).")
    jump_forward: bool = _option(True, "Decode grammar-forced text token by token (ablation).", "--no-jump-forward")
    dry_run: bool = _option(False, "Load, tokenize and plan only; print the plan's figures as JSON (no weights "
                                   "loaded, nothing written).")


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(Path(lmbatch.__file__).parent), "rev-parse", "HEAD"],
                             capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _check(o: RunOptions, w: Workload) -> None:
    """Every option a user can get wrong, before any work."""
    if w.max_shots is not None and (o.shots < 0 or o.shots > w.max_shots):
        raise UserError(f"--shots {o.shots} is out of range: {w.name} takes 0 to {w.max_shots} few-shot examples")
    if o.shots < 0:
        raise UserError("--shots must be at least 0")
    if o.shots > 0 and w.shot_pool is not None and o.shots >= (pool := w.shot_pool()):
        raise UserError(f"--shots {o.shots} needs more than the {pool} {w.shot_pool_name}")
    if o.subjects:
        if w.subjects is None:
            raise UserError(f"--subjects applies to mmlu only, not to {w.name}")
        valid = w.subjects()
        for subject in o.subjects:
            if subject not in valid:
                raise UserError(f"unknown MMLU subject {subject!r}; valid: {', '.join(valid)}")
    if o.limit is not None and o.limit < 1:
        raise UserError("--limit must be at least 1")
    if o.device not in DEVICES:
        raise UserError(f"--device {o.device}: use auto, cpu or cuda")
    if o.dtype is not None and o.dtype not in DTYPES:
        raise UserError(f"--dtype {o.dtype}: use one of {', '.join(DTYPES)}")
    if o.max_tokens_per_batch is not None and o.max_tokens_per_batch < 1:
        raise UserError("--max-tokens-per-batch must be at least 1")
    if (o.apply_chat_template or o.system_instruction is not None or o.fewshot_as_multiturn) and not w.chat:
        raise UserError(f"--apply-chat-template, --system-instruction and --fewshot-as-multiturn apply to mmlu and "
                        f"hellaswag, not {w.name} (a program renders its own messages with s.chat)")
    if o.fewshot_as_multiturn and not o.apply_chat_template:
        raise UserError("--fewshot-as-multiturn needs --apply-chat-template")
    if o.think_end is not None and o.think_budget is None:
        raise UserError("--think-end goes with --think-budget")
    if o.think_budget is not None and o.think_budget < 0:
        raise UserError("--think-budget must be at least 0")
    if not o.checkpoint_s > 0:
        raise UserError("--checkpoint-s must be more than 0")
    if o.kv_cache_tokens is not None and o.kv_cache_tokens < 1:
        raise UserError("--kv-cache-tokens must be at least 1")
    if o.data_parallel != "auto" and not (o.data_parallel.isdigit() and int(o.data_parallel) >= 1):
        raise UserError(f"--data-parallel {o.data_parallel}: use a number of workers (at least 1) or auto")
    if o.tensor_parallel < 1:
        raise UserError("--tensor-parallel must be at least 1")
    from lmbatch.scheduler.planner import SCHEDULES
    if o.schedule not in SCHEDULES:
        raise UserError(f"--schedule {o.schedule}: use one of {', '.join(SCHEDULES)}")


def pick_device(device: str, dtype: str | None) -> tuple[str, str]:
    """(device, dtype name): auto is CUDA when a GPU is visible; float32 on CPU, bfloat16 on CUDA."""
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA GPU is visible here")
    dtype = dtype or ("float32" if device == "cpu" else "bfloat16")
    if device == "cpu" and dtype == "float16":
        raise UserError("--dtype float16 on CPU: use float32 (or bfloat16, ~100x slower on most CPUs)")
    return device, dtype


def kv_tokens(wanted: int | None, cfg, device: str, dtype_name: str) -> int:
    """Default pool: 4 GiB of KV on CPU; on CUDA half the free memory, at most 131072 tokens (DFS
    needs only its working set, and a compact pool measured faster). Checked against the longest
    request once the prompts are tokenized (`_check_pool`)."""
    if wanted is not None:
        return wanted
    import torch

    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * torch.finfo(getattr(torch, dtype_name)).bits // 8
    budget = 4 << 30 if device == "cpu" else torch.cuda.mem_get_info()[0] // 2
    return min(budget // per_token, 1 << 20 if device == "cpu" else 1 << 17)


def batch_tokens(wanted: int | None, cfg, device: str, dtype_name: str) -> int:
    """Token budget of one forward batch: 4096 on CPU; on CUDA the largest power of two up to
    16384 whose activations (the MLP's gate/up and the attention projections of every token) take
    at most a tenth of the free memory: bigger batches keep the GPU's matmuls efficient."""
    if wanted is not None:
        return wanted
    if device == "cpu":
        return CPU_BATCH_TOKENS
    import torch

    width = 3 * cfg.intermediate_size + 4 * cfg.hidden_size + (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    per_token = width * torch.finfo(getattr(torch, dtype_name)).bits // 8
    budget = 16384
    while budget > 1024 and budget * per_token > torch.cuda.mem_get_info()[0] // 10:
        budget //= 2
    return budget


class Loaded(NamedTuple):
    engine: Any
    device: str
    dtype: str
    batch_tokens: int
    kv_tokens: int
    tokenizer_matches: bool      # the encoder's (cached) tokenizer is the transformers tokenizer's own


class _Loader(threading.Thread):
    """Builds the engine on a background thread while the main thread loads data, tokenizes and
    plans: torch's import, CUDA's start, the model config, weights, warmed kernels and captured
    decode graphs. Its errors (a user's, too) are raised where the main thread takes the result."""

    def __init__(self, o: RunOptions, model_dir: Path, encoder):
        super().__init__(name="lmbatch-model-load", daemon=True)
        self.o, self.model_dir, self.encoder = o, model_dir, encoder
        self.loaded: Loaded | None = None
        self.workers = 1
        self.error: BaseException | None = None
        self.seconds = 0.0
        self.start()

    def run(self) -> None:
        t = time.perf_counter()
        try:
            with lmbatch.IMPORT_LOCK:       # what both threads use of transformers, before the main one may
                from transformers import AutoConfig, PreTrainedTokenizerBase  # noqa: F401

                from lmbatch.model.config import ModelConfig

            device, dtype_name = pick_device(self.o.device, self.o.dtype)
            cfg = ModelConfig.from_dir(self.model_dir)
            kv = kv_tokens(self.o.kv_cache_tokens, cfg, device, dtype_name)
            batch = batch_tokens(self.o.max_tokens_per_batch, cfg, device, dtype_name)
            self.workers = data_parallel_size(self.o.data_parallel, device, self.o.tensor_parallel, self.o.ray_address)
            engine = _build_engine(self.o, self.model_dir, device, dtype_name, self.encoder, kv, batch, self.workers)
            self.loaded = Loaded(engine, device, dtype_name, batch, kv, self.encoder.matches_hf())
        except BaseException as e:  # noqa: BLE001  re-raised on the main thread
            self.error = e
        self.seconds = time.perf_counter() - t

    def result(self, longest: int) -> Loaded:
        """The engine, its pool grown (rebuilt) if the longest request needs more."""
        self.join()
        if self.error is not None:
            raise self.error
        assert self.loaded is not None
        ld = self.loaded
        need = _check_pool(self.o, ld.kv_tokens, ld.batch_tokens, longest)
        if need > ld.kv_tokens:      # rare (prompts near the model's context): the small pool goes first
            ld.engine.close()
            self.loaded, ld = None, ld._replace(engine=None, kv_tokens=need)
            ld = ld._replace(engine=_build_engine(self.o, self.model_dir, ld.device, ld.dtype, self.encoder, need,
                                                  ld.batch_tokens, self.workers))
            self.loaded = ld
        return ld


def data_parallel_size(wanted: str, device: str, tp: int = 1, ray_address: str | None = None) -> int:
    """Workers of --data-parallel: auto is every visible GPU (of the Ray cluster, with `ray_address`)
    over --tensor-parallel (1 on CPU); on CUDA each worker needs its own `tp` GPUs."""
    if device != "cuda":
        return 1 if wanted == "auto" else int(wanted)
    if ray_address is not None:
        from lmbatch.engine.cluster import cluster_gpus
        visible = cluster_gpus(ray_address)
    else:
        import torch
        visible = torch.cuda.device_count()
    n = max(1, visible // tp) if wanted == "auto" else int(wanted)
    if n * tp > visible:
        what = f"--data-parallel {wanted}" + (f" x --tensor-parallel {tp}" if tp > 1 else "")
        raise UserError(f"{what}: {n * tp} GPUs needed, {visible} visible")
    return n


def _gpus(n: int) -> list[str]:
    """The CUDA_VISIBLE_DEVICES entry of each of n workers: the first n of what this process sees."""
    seen = os.environ.get("CUDA_VISIBLE_DEVICES")
    names = [s.strip() for s in seen.split(",")] if seen else [str(k) for k in range(n)]
    return names[:n]


def _build_engine(o: RunOptions, model_dir: Path, device: str, dtype_name: str, encoder, kv_tokens: int,
                  batch_tokens: int, workers: int = 1):
    return make_engine(model_dir, device, dtype_name, kv_tokens, batch_tokens, encoder.hf, cache=not o.no_cache,
                       jump_forward=o.jump_forward, workers=workers, tensor_parallel=o.tensor_parallel,
                       ray_address=o.ray_address, relay_s=min(1.0, o.checkpoint_s))


def make_engine(model_dir: Path, device: str, dtype_name: str, kv_tokens: int, batch_tokens: int, tokenizer, *,
                cache: bool = True, jump_forward: bool = True, workers: int = 1, tensor_parallel: int = 1,
                ray_address: str | None = None, relay_s: float = 1.0, load_format: str = "auto"):
    """An engine in this process, or `workers` of `tensor_parallel` processes each (ParallelEngine),
    on this machine or placed by the Ray cluster at `ray_address`; warmed up."""
    import torch

    from lmbatch.engine import Engine, EngineOptions

    if workers > 1 or tensor_parallel > 1 or ray_address is not None:
        from lmbatch.engine.parallel import ParallelEngine
        from lmbatch.engine.worker import WorkerSpec
        from lmbatch.model.config import ModelConfig

        cfg = ModelConfig.from_dir(model_dir)
        procs = workers * tensor_parallel
        spec = WorkerSpec(str(model_dir), device, dtype_name, kv_tokens, batch_tokens, cache=cache,
                          jump_forward=jump_forward, vocab_size=cfg.vocab_size,
                          threads=max(1, (os.cpu_count() or 1) // procs) if device == "cpu" else None,
                          relay_s=relay_s, tensor_parallel=tensor_parallel, load_format=load_format)
        return ParallelEngine(spec, workers, cfg, _gpus(procs) if device == "cuda" and not ray_address else None,
                              ray_address=ray_address)
    options = EngineOptions(kv_cache_tokens=kv_tokens, max_tokens_per_batch=batch_tokens, cache=cache,
                            jump_forward=jump_forward)
    engine = Engine.from_pretrained(model_dir, options, device=device, dtype=getattr(torch, dtype_name),
                                    tokenizer=tokenizer, load_format=load_format)
    engine.warm_up()
    return engine


def _check_pool(o: RunOptions, kv_tokens: int, batch_tokens: int, longest: int) -> int:
    """The pool must hold the longest request plus one batch; a default pool grows to that."""
    need = longest + batch_tokens
    if kv_tokens >= need:
        return kv_tokens
    if o.kv_cache_tokens is not None:
        raise UserError(f"--kv-cache-tokens {o.kv_cache_tokens} is too small: the longest prompt ({longest}) "
                        f"plus one batch ({batch_tokens}) needs {need}")
    return need


def run(o: RunOptions) -> Path | dict[str, Any]:
    """Run a task; returns its run directory, or with `dry_run` the plan's figures.

    Python's cycle collector rescans every live container each time their number grows by a
    quarter; the host phases build millions (instances, prompts, token lists) and that scanning
    took about a third of their time (full MMLU's dry run on a 2-core CPU: ~14.8 s with it, ~8.8 s
    without). They run without it; what they built is frozen (never scanned again) before model
    work, which runs with the collector (generation may leave cycles that hold device memory)."""
    collect = gc.isenabled()
    gc.disable()
    stop = _Stop()
    try:
        with stop:
            return _run(o, collect, stop)
    except KeyboardInterrupt:
        raise Interrupted(stop.kept()) from None
    finally:
        gc.unfreeze()
        if collect:
            gc.enable()


class _Stop:
    """SIGINT (Ctrl-C) and SIGTERM during a run. While it executes, the first signal stops it at its
    next handover: the finished instances are written as a part and the run raises `Interrupted`.
    Before that, it raises KeyboardInterrupt at once (nothing of this attempt to keep). A second
    signal exits at once: what is on disk is whole parts."""

    def __init__(self) -> None:
        self.asked = False
        self.executing = False
        self.rundir: Any = None
        self._old: dict[int, Any] = {}

    def __enter__(self) -> "_Stop":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)

    def _handle(self, signum: int, frame: object) -> None:
        if self.asked:
            print("interrupted again: stopped at once (the results on disk are whole parts; re-run the same "
                  "command to resume)", file=sys.stderr, flush=True)
            os._exit(130)
        self.asked = True
        if not self.executing:
            raise KeyboardInterrupt

    def kept(self) -> str:
        """The line a stopped run ends with."""
        rd = self.rundir
        if rd is None or not rd.kept:
            return "nothing written (no instance had finished)"
        of = f" of {rd.total}" if rd.total else ""
        return f"{len(rd.kept)}{of} instances kept; {rd.rerun} to resume"


class _Parts:
    """The interpreter's checkpoints: finished instances go to the run directory as parts, at least
    every wave and every `checkpoint_s` seconds of work, and at once when a stop was asked for."""

    def __init__(self, o: RunOptions, w: Workload, rundir, interp, stop: _Stop):
        self.o, self.w, self.rundir, self.interp, self.stop = o, w, rundir, interp, stop
        self.next = time.perf_counter() + o.checkpoint_s

    def due(self) -> bool:
        return self.stop.asked or time.perf_counter() >= self.next

    def save(self, runs: list) -> None:
        self.next = time.perf_counter() + self.o.checkpoint_s     # due again in checkpoint_s, parts or none
        if not runs:
            if self.stop.asked:
                raise Interrupted(self.stop.kept())
            return
        rows = _instance_rows(self.w, runs)
        by_run = self.interp.tally.rows_by_run
        reqs = [r for run in runs for r in by_run.pop(run.index, [])]
        if not self.o.save_token_ids:
            reqs = [{k: v for k, v in r.items() if k != "token_ids"} for r in reqs]
        for row, run in zip(rows, runs):
            row["number"] = run.number
        self.rundir.write_part(rows, reqs)
        if self.stop.asked:
            raise Interrupted(self.stop.kept())


def _check_out(out: Path) -> None:
    """The parent of run directories can take one, before any work: the results are written last."""
    import tempfile

    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file, not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".lmbatch-probe-"):
            pass
    except OSError as e:
        raise UserError(f"--out {out} is not writable: {e.strerror or e}") from None


def _fingerprint(o: RunOptions, w: Workload, model_dir: Path) -> dict[str, Any]:
    """What decides a run's results (a resumed run must have the same): the task and its options,
    the model's files, lmbatch's version. The dtype is checked once the device is known."""
    from lmbatch.rundir import model_identity

    fp: dict[str, Any] = {"task": w.name, "shots": o.shots, "limit": o.limit, "subjects": o.subjects, "seed": o.seed,
                          "truncate_left": o.truncate_left, "jump_forward": o.jump_forward,
                          "save_token_ids": o.save_token_ids, "think_budget": o.think_budget, "think_end": o.think_end,
                          "apply_chat_template": o.apply_chat_template, "system_instruction": o.system_instruction,
                          "fewshot_as_multiturn": o.fewshot_as_multiturn,
                          "lmbatch_version": lmbatch.__version__,
                          "model": model_identity(model_dir)}
    if o.task.endswith(".py"):
        fp["program"] = hashlib.sha256(Path(o.task).read_bytes()).hexdigest()
    return fp


def _model_files(o: RunOptions, w: Workload, clock: Phases, stop: _Stop):
    """(model folder, run directory, text encoder, model shape), checked."""
    from lmbatch.frontend.tokenize import TextEncoder
    from lmbatch.model.checkpoint import resolve_model
    from lmbatch.model.config import ModelConfig

    with clock("model_files"):
        model_dir = resolve_model(o.model)      # the embedded model is converted on first use
    final = Path(o.out) / (o.run_id or "{}-{}shot-{}-{}".format(w.name, o.shots, model_dir.name,
                                                              dt.datetime.now().strftime("%Y%m%d-%H%M%S")))
    rundir = None
    if not o.dry_run:
        from lmbatch.rundir import RunDir

        _check_out(Path(o.out))
        with clock("model_files"):      # a complete run needs --overwrite; an incomplete one resumes
            rundir = stop.rundir = RunDir(final, _fingerprint(o, w, model_dir), o.overwrite, o.save_token_ids,
                                            named=o.run_id is not None)
    with clock("model_files"):
        encoder = TextEncoder.for_model(model_dir)
        try:
            shape = ModelConfig.shape_from_json(model_dir)
        except ValueError as e:     # a supported model_type with a variant we do not run (e.g. its RoPE)
            raise UserError(f"model at {model_dir}: {first_line(e)}") from None
        except AttributeError as e:  # no attention shape (e.g. a state-space model)
            raise UserError(f"model at {model_dir} has no attention shape lmbatch's KV cache can hold ({e}): "
                            "lmbatch runs decoder-only attention models") from None
    return model_dir, rundir, encoder, shape


def _runtime(cfg) -> str:
    """Which forward pass ran: "native qwen3" (network.py) or "transformers fallback gpt_neox"."""
    return f"{'native' if cfg.runtime == 'native' else cfg.runtime + ' fallback'} {cfg.model_type}"


def _run(o: RunOptions, collect: bool, stop: _Stop) -> Path | dict[str, Any]:
    clock = Phases()
    w = get_workload(o.task)
    _check(o, w)
    model_dir, rundir, encoder, shape = _model_files(o, w, clock, stop)
    if o.tensor_parallel > 1:
        from lmbatch.model.tensor_parallel import shard_config
        try:
            shard_config(shape, o.tensor_parallel)
        except ValueError as e:
            raise UserError(f"--tensor-parallel {o.tensor_parallel}: {first_line(e)}") from None
    loader = None if o.dry_run else _Loader(o, model_dir, encoder)
    try:
        return _run_with(o, w, collect, clock, model_dir, rundir, encoder, shape, loader, stop)
    except Exception:
        if loader is not None:      # an error while the model loads: let it finish (a thread killed
            loader.join()           # inside torch at exit aborts the process: no message, exit -6)
        raise
    finally:
        if loader is not None and loader.loaded is not None:
            loader.loaded.engine.close()    # data-parallel workers end with the run


def _run_with(o: RunOptions, w: Workload, collect: bool, clock: Phases, model_dir: Path, rundir, encoder,
              shape, loader: _Loader | None, stop: _Stop) -> Path | dict[str, Any]:
    from lmbatch.frontend.tokenize import TextEncoder, tokenizer_cache_file

    say = (lambda text: None) if o.quiet or o.dry_run else (lambda text: print(f"lmbatch: {text}", file=sys.stderr))
    if rundir is not None and rundir.resuming:
        say(f"resuming {rundir.path}: {len(rundir.kept)} instances kept from earlier attempts")
    say(f"{w.name}: loading and tokenizing the instances" + (", the model loading meanwhile" if loader else ""))
    instances, interp = _prepare(o, w, encoder, shape, clock, rundir)
    if loader is None:
        return _dry_run(o, w, model_dir, shape, instances, interp, clock)
    say(f"{len(interp.runs)} instances to run, {len(interp.ready)} first-stage calls: planning")
    interp.plan_ahead()                          # while the model loads
    if loader.is_alive():
        say(f"waiting for the model ({model_dir.name})")
    with clock("load"):
        loaded = loader.result(interp.longest_ready())
    kept = rundir.check_dtype(loaded.dtype, o.overwrite)      # False: --overwrite of another dtype's run
    if not loaded.tokenizer_matches:     # the cached tokenizer is not AutoTokenizer's: tokenize again
        tokenizer_cache_file(model_dir).unlink(missing_ok=True)
        encoder = TextEncoder.from_hf(encoder.hf)
    if not kept or not loaded.tokenizer_matches:
        instances, interp = _prepare(o, w, encoder, shape, clock, rundir)
    engine = loaded.engine
    gc.freeze()
    if collect:
        gc.enable()
    tokenized = interp.tokenize_s
    from lmbatch.progress import TokenProgress

    interp.progress = TokenProgress("execute", disable=o.quiet)
    interp.checkpoints = _Parts(o, w, rundir, interp, stop)
    stop.executing = True
    try:
        interp.execute(engine)
    finally:        # a stop's line starts a line of its own, under the bar
        stop.executing = False
        interp.progress.close()
    if stop.asked:
        raise Interrupted(stop.kept())
    if len(rundir.kept) != len(instances):
        raise RuntimeError(f"{len(instances) - len(rundir.kept)} of {len(instances)} instances were not written")
    clock.add("tokenize", interp.tokenize_s - tokenized)
    clock.add("plan", interp.stats.plan_s)
    clock.add("execute", interp.stats.execute_s)
    return _complete(o, w, rundir, model_dir, loaded, loader.seconds, interp, clock)


def _complete(o: RunOptions, w: Workload, rundir, model_dir: Path, loaded: Loaded, load_background: float, interp,
              clock: Phases) -> Path:
    """Write the run's final files from its parts (RunDir.complete), and say what it did."""
    engine = loaded.engine
    t_write = time.perf_counter()

    def summarize(rows: list[dict], record: dict[str, Any]) -> dict[str, Any]:
        for r in rows:
            r["metrics"] = dict(r["metrics"])       # a Parquet map reads back as pairs
        clock.add("write", time.perf_counter() - t_write)
        summary = _summary(o, w, rundir.path.name, model_dir, loaded.device, loaded.dtype, rows, interp,
                           clock.total(), loaded.batch_tokens, loaded.kv_tokens, load_background, engine.cfg)
        attempt = len(record["attempts"])
        summary["counts"]["resumed_instances"] = sum(r["attempt"] < attempt for r in rows)
        summary["attempts"] = record["attempts"]
        summary["throughput"] = _throughput(interp.stats, len(interp.runs))
        summary["data_parallel"] = _data_parallel(engine, interp.stats)
        return summary

    summary: dict[str, Any] = {}
    rundir.complete(lambda rows, record: summary.update(summarize(rows, record)) or summary)
    if not o.quiet:
        acc = "" if summary["accuracy"] is None else f"accuracy {summary['accuracy']:.4f}  "
        counts = summary["counts"]
        failed, resumed = counts["failed_instances"], counts["resumed_instances"]
        t = summary["time_s"]
        print(f"{counts['instances']} instances" + (f" ({resumed} from earlier attempts)" if resumed else "")
              + f"  {acc}hit rate {summary['hit_rate']:.4f} (optimum "
              f"{summary['optimal_hit_rate']:.4f})  wall {t['total']:.1f}s ({largest(t)})"
              + (f"  {failed} FAILED (see the error column)" if failed else "")
              + f"  {_runtime(engine.cfg)}  -> {rundir.path}", file=sys.stderr)
    return cast(Path, rundir.path)


def _prepare(o: RunOptions, w: Workload, encoder, shape, clock: Phases, rundir=None):
    """The task's instances and an interpreter holding the first-stage calls of every program to run
    (of a resumed run, those of the instances its parts do not hold yet), tokenized."""
    from lmbatch.frontend.chat import ChatOptions, has_template
    from lmbatch.frontend.interpreter import Interpreter

    with clock("data"):
        chat = ChatOptions(o.apply_chat_template, o.system_instruction, o.fewshot_as_multiturn)
        if chat.apply and not has_template(encoder.hf):
            raise UserError("--apply-chat-template: the model's tokenizer has no chat template")
        instances = w.instances(LoadArgs(encoder, o.shots, o.limit, o.subjects, o.seed, chat))
        if not instances:
            raise UserError(f"{w.name} has no instances to run")
        numbers = list(range(len(instances)))
        if rundir is not None:
            rundir.check_instances([inst.id for inst in instances])
            numbers = [k for k in numbers if k not in rundir.kept]
        # a context length of 0: the config names none (ALiBi models run through transformers, e.g. BLOOM)
        interp = Interpreter(encoder, max_len=shape.max_position_embeddings or 1 << 30, schedule=o.schedule,
                             seed=o.seed, truncate_left=o.truncate_left,
                             vocab_size=shape.vocab_size, jump_forward=o.jump_forward, think_budget=o.think_budget,
                             think_end=o.think_end)
        interp.start(w.program, [instances[k] for k in numbers], numbers)   # first-stage calls, before model work
    clock.seconds["data"] -= interp.tokenize_s
    clock.add("tokenize", interp.tokenize_s)
    return instances, interp


def estimate_flops(cfg, unique_tokens: int, attended_keys: int, logit_rows: int) -> float:
    """Model FLOPs of the planned prefill: the linear layers for every computed token (of an MoE layer
    the experts it is routed to), attention (QK and AV) over each computed token's keys, and the LM head
    at the positions that need logits."""
    d, q = cfg.hidden_size, cfg.num_heads * cfg.head_dim
    attention = cfg.num_layers * 4 * q * attended_keys
    return 2.0 * cfg.active_linear_params() * unique_tokens + attention + 2.0 * d * cfg.vocab_size * logit_rows


def _dry_run(o: RunOptions, w: Workload, model_dir: Path, cfg, instances, interp, clock: Phases) -> dict[str, Any]:
    """The plan's figures for every first-stage call (later stages depend on generated text)."""
    from lmbatch.requests import ScoreRequest
    from lmbatch.scheduler.planner import summarize

    with clock("plan"):
        requests = interp.first_requests()
        scored = [isinstance(r, ScoreRequest) for r in requests]
        plan = summarize([r.prompt for r in requests], scored,
                         [len(r.continuation) if s else 1 for r, s in zip(requests, scored)])
    return {
        "task": w.name, "model": str(model_dir), "shots": o.shots, "instances": len(instances),
        "calls": len(interp.ready), "requests": plan.requests, "executed_requests": plan.executed,
        "prompt_tokens": plan.prompt_tokens, "unique_tokens": plan.unique_tokens,
        "optimal_hit_rate": plan.optimal_hit_rate,
        "flops": estimate_flops(cfg, plan.unique_tokens, plan.attended_keys, plan.logit_rows),
        "time_s": clock.total(),
    }


def _jsonable(v):
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    return v if isinstance(v, (str, int, float, bool)) or v is None else str(v)


def _instance_rows(w: Workload, runs) -> list[dict]:
    rows = []
    for run in runs:
        s, inst, error, metrics = run.state, run.instance, run.error, {}
        if error is None and w.score is not None:
            try:
                metrics = {k: float(v) for k, v in w.score(inst, s).items()}
            except Exception as e:  # the user's scoring code: kept with its instance
                error = f"score: {type(e).__name__}: {e}"
        ans = s.meta(w.answer) if w.answer and w.answer in s and run.error is None else None
        t = run.tokens
        rows.append(dict(task=w.name, subject=inst.subject, id=inst.id,
                         prediction=None if ans is None else str(ans["index"]),     # comparable with gold
                         gold=None if inst.gold is None else str(inst.gold),
                         correct=bool(metrics["acc"]) if "acc" in metrics else None,
                         logprobs=[] if ans is None else ans["logprobs"],
                         is_greedy=[] if ans is None else ans["is_greedy"],
                         metrics=metrics, outputs=json.dumps(_jsonable(s.variables())), error=error,
                         prompt_tokens=t.prompt_tokens, cached_tokens=t.cached_tokens,
                         computed_tokens=t.computed_tokens, decode_tokens=t.decode_tokens,
                         inputs=json.dumps(_jsonable(inst.inputs))))
    return rows


def _mean(values) -> float | None:
    values = list(values)
    return sum(values) / len(values) if values else None


def _summary(o: RunOptions, w: Workload, run_id: str, model_dir: Path, device: str, dtype_name: str,
             rows: list[dict], interp, time_s: dict[str, float], batch_tokens: int, kv_tokens: int,
             load_background: float | None, cfg) -> dict[str, Any]:
    stats = interp.stats
    ok = [r for r in rows if r["error"] is None]
    names = sorted({k for r in ok for k in r["metrics"]})
    by_subject = defaultdict(list)
    for r in ok:
        if r["subject"] and "acc" in r["metrics"]:
            by_subject[r["subject"]].append(r["metrics"]["acc"])
    options = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(o).items()}
    return {
        "run_id": run_id,
        "task": w.name,
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "lmbatch_version": lmbatch.__version__,
        "git_commit": _git_commit(),
        "model": str(model_dir),
        "device": device,
        "dtype": dtype_name,
        "model_type": cfg.model_type,
        "model_runtime": cfg.runtime,       # "native": our network; "transformers": the fallback
        "max_tokens_per_batch": batch_tokens,
        "kv_cache_tokens": kv_tokens,
        "options": options,
        "counts": {"instances": len(rows), "failed_instances": len(rows) - len(ok),
                   "calls": sum(c.calls for c in interp.stages.values()), "requests": stats.requests,
                   "executed_requests": stats.executed, "waves": interp.waves,
                   "truncated_calls": interp.truncated},
        "accuracy": _mean(r["metrics"]["acc"] for r in ok if "acc" in r["metrics"]),
        "metrics": {k: _mean(r["metrics"][k] for r in ok if k in r["metrics"]) for k in names},
        "accuracy_by_subject": {s: sum(v) / len(v) for s, v in sorted(by_subject.items())},
        "tokens": {"prompt": stats.prompt_tokens, "cached": stats.cached_tokens, "computed": stats.computed_tokens,
                   "unique": stats.unique_tokens, "decode": stats.decode_tokens,
                   "thinking": interp.tally.think_tokens},
        "hit_rate": stats.hit_rate,
        "optimal_hit_rate": stats.optimal_hit_rate,
        "prompt_tree_optimal_hit_rate": interp.prompt_tree_optimal_hit_rate,
        "stages": {str(k): v.as_dict() for k, v in sorted(interp.stages.items())},
        "evicted_tokens": stats.evicted_tokens,
        "forward_batches": stats.forward_batches,
        # phases from the process's start; "load" is what the run waited for the model, and
        # "load_background" what building it took on its thread (overlapping data and tokenize)
        "time_s": time_s if load_background is None else {**time_s, "load_background": load_background},
        "throughput": _throughput(stats, len(rows)),
    }


def _data_parallel(engine, stats) -> dict[str, Any]:
    """Workers and the devices each spans; the fewest tokens they had to compute between them (each
    its own parts' optimum) and how many of those more than one worker computed (the prefixes their
    parts share): the best hit rate they reach together."""
    unique = engine.optimal_unique_tokens() if hasattr(engine, "optimal_unique_tokens") else stats.unique_tokens
    return {"workers": engine.data_parallel, "tensor_parallel": engine.tensor_parallel,
            "duplicated_tokens": unique - stats.unique_tokens,
            "optimal_hit_rate": 1 - unique / stats.prompt_tokens if stats.prompt_tokens else 0.0}


def _throughput(stats, programs: int) -> dict[str, float]:
    """Rates over the execution of this attempt (a resumed run's programs are those it ran)."""
    ex = max(stats.execute_s, 1e-9)
    return {"programs_per_s": programs / ex, "prompt_tokens_per_s": stats.prompt_tokens / ex,
            "computed_tokens_per_s": stats.computed_tokens / ex, "decode_tokens_per_s": stats.decode_tokens / ex}
