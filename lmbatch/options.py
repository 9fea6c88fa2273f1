"""The options of `lmbatch run`, each declared once, grouped by what they decide (`RunOptions`: the
workload's, the engine's and the output's records; the command's parameters are made from their fields),
what of them decides a run's workload (`deciding`), and their checks against the task, made before any
work (`check`)."""
from __future__ import annotations

import unicodedata
from dataclasses import Field, dataclass, field, fields
from pathlib import Path, PureWindowsPath
from typing import Any

from lmbatch.engine.build import ATTENTION, DEVICES, DTYPES
from lmbatch.engine.devices import check_count
from lmbatch.engine.options import EngineOptions, EngineSpec
from lmbatch.errors import UserError
from lmbatch.frontend.workload import Workload


def _option(default: Any, help: str, flag: str | None = None) -> Any:
    """A RunOptions field with its `lmbatch run` help. `flag` is the option's spelling where it is not
    --field-name; a true-by-default bool field with the flag --no-field-name is set false by giving it."""
    return field(default=default, metadata={"help": help, "flag": flag})


@dataclass
class WorkloadOptions:
    """What decides a run's workload, and so what its scores mean: the task, which instances, their prompts
    (shots, chat rendering, thinking, truncation) and the seed. Each field but `task` is in the run's
    fingerprint, the workload cache's key and what `lmbatch report --compare` requires of two runs
    (`deciding`); the task is there as the workload's name."""

    task: str = field(metadata={"help": "Task name (see `lmbatch tasks`) or a program file path/to/file.py.",
                                "argument": True})
    shots: int = _option(0, "Few-shot examples per prompt (mmlu: 0 to 5; hellaswag: any, drawn from validation; "
                            "json, tot-gsm8k: 0; OLMES tasks hold their 5 curated ones: leave it out; a suite: "
                            "for its tasks that take it).")
    limit: int | None = _option(None, "First N instances (per subject for mmlu, as lm-eval's --limit).")
    subjects: list[str] | None = _option(None, "Only these MMLU subjects (repeatable).")
    seed: int = _option(0, "Seed for shots drawing, sampling and --schedule random.")
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
    truncate_left: bool = _option(False, "Drop the oldest tokens of prompts longer than the model's context.")

    def __post_init__(self) -> None:
        if self.subjects:       # a subject given twice is one subject (its questions would run twice)
            self.subjects = list(dict.fromkeys(self.subjects))


# the workload options that decide a run beside its task (summary.json's "options" holds them by these names)
DECIDING = tuple(f.name for f in fields(WorkloadOptions) if f.name != "task")


def deciding(w: WorkloadOptions) -> dict[str, Any]:
    """The options of `DECIDING` and their values: what the run's fingerprint, the workload cache's key and
    `lmbatch report --compare` hold a run's workload to, beside its task."""
    return {name: getattr(w, name) for name in DECIDING}


@dataclass
class EngineChoice:
    """What runs the workload: the model, where and in what precision, the engine's budgets, parallelism,
    kernels and order; the fingerprint holds the model (by content), `jump_forward` and `deterministic`, the
    dtype is checked on resume, the rest may differ between attempts of one run."""

    model: str | None = _option(None, "Local HF folder or hub id; default: the embedded SmolLM2-135M-Instruct.")
    device: str = _option("auto", "auto (CUDA when a GPU is visible, else CPU), cpu or cuda.")
    dtype: str | None = _option(None, "float32 (CPU default), bfloat16 (CUDA default) or float16.")
    threads: int | None = _option(None, "CPU: torch threads of every forward batch (default: the cores other "
                                        "processes leave free, 1 for a batch of few tokens).")
    attention: str = _option("auto", "Attention kernels: auto (Triton on CUDA, FlashInfer where its kernels for the "
                                     "model are built already; torch on CPU), flashinfer, triton, cascade (Triton, "
                                     "decode reading prefixes that rows share once a step) or torch.")
    max_tokens_per_batch: int | None = _option(
        None, "Token budget of one forward batch (default: 4096 on CPU; on CUDA up to 16384, fitted to the model "
              "and free memory).")
    kv_cache_tokens: int | None = _option(None, "KV pool size in tokens (default: 4 GiB on CPU; on CUDA half the "
                                                "free memory, at most 1048576 tokens).")
    data_parallel: str = _option("auto", "Worker processes, each with its own copy of the model on its own device, "
                                         "each running whole subtrees of the radix tree: a number, or auto (every "
                                         "visible GPU over --tensor-parallel; 1 on CPU).")
    ray_address: str | None = _option(None, "Place the workers on this Ray cluster (host:port, or auto) instead of "
                                            "local processes.")
    tensor_parallel: str = _option("auto", "Devices (processes on CPU) each model is split over: attention heads, "
                                           "MLP and vocabulary slices; auto: 1 where the model fits one GPU, else the "
                                           "fewest that hold it. Workers times this must not exceed the GPUs.")
    schedule: str = _option("dfs", "dfs (radix-tree order), fcfs or random: the last two for ablations.")
    deterministic: bool = _option(False, "Every logprob and token the same, bit for bit, whatever the batch budget, "
                                         "pool, cache, workers, schedule, resume point or suite (README: what it "
                                         "costs, what tensor parallelism changes).")
    no_cache: bool = _option(False, "Disable prefix caching (ablation).")
    jump_forward: bool = _option(True, "Decode grammar-forced text token by token (ablation).", "--no-jump-forward")


@dataclass
class OutputOptions:
    """Where and how a run writes what it finds, and what it says meanwhile: none of it changes a score
    (`save_token_ids`, a column of requests.parquet, is in the fingerprint: a resumed run's parts have it
    or not)."""

    out: Path = _option(Path("results"), "Parent directory of run directories.")
    run_id: str | None = _option(None, "Run directory, one folder name inside --out (default: "
                                       "TASK-Kshot-MODEL-YYYYMMDD-HHMMSS); an incomplete one with the same settings "
                                       "is resumed.")
    overwrite: bool = _option(False, "Replace an existing run directory (an incomplete one with other settings too; "
                                     "one with the same settings is resumed).")
    checkpoint_s: float = _option(30.0, "Seconds of work between result parts written while the run executes (also "
                                        "one per wave): at most what a crash or Ctrl-C loses.")
    save_token_ids: bool = _option(False, "Store each request's token ids in requests.parquet.")
    quiet: bool = _option(False, "No progress bar, phase lines or closing line.")
    workload_cache: bool = _option(True, "Load, tokenize and plan the task again rather than take its cached "
                                         "workload (kept per task, options, data and tokenizer).",
                                   "--no-workload-cache")
    dry_run: bool = _option(False, "Load, tokenize and plan only; print the plan's figures as JSON (no weights "
                                   "loaded, nothing written).")


RECORDS: dict[str, type] = {"workload": WorkloadOptions, "engine": EngineChoice, "output": OutputOptions}
# every `lmbatch run` option in the order its --help lists them and summary.json's "options" holds them
ORDER = ("task", "shots", "model", "limit", "subjects", "device", "dtype", "threads", "attention",
         "max_tokens_per_batch", "kv_cache_tokens", "data_parallel", "ray_address", "tensor_parallel", "schedule",
         "deterministic", "no_cache", "seed", "out", "run_id", "overwrite", "checkpoint_s", "truncate_left",
         "save_token_ids", "quiet", "apply_chat_template", "system_instruction", "fewshot_as_multiturn",
         "think_budget", "think_end", "jump_forward", "workload_cache", "dry_run")


def option_fields() -> list[tuple[str, Field[Any]]]:
    """Each option's record (RECORDS' key) and field, in ORDER."""
    found = {f.name: (record, f) for record, cls in RECORDS.items() for f in fields(cls)}
    assert sorted(found) == sorted(ORDER), "ORDER names every option of RECORDS once"
    return [found[name] for name in ORDER]


@dataclass
class RunOptions:
    """The options of one `lmbatch run`, by what they decide: `lmbatch.cli` makes the command's parameters
    from the records' fields (`option_fields`), with their defaults and the help in their metadata."""

    workload: WorkloadOptions
    engine: EngineChoice = field(default_factory=EngineChoice)
    output: OutputOptions = field(default_factory=OutputOptions)

    @classmethod
    def of(cls, **options: Any) -> RunOptions:
        """RunOptions from the options by name (`lmbatch run`'s, `task` among them)."""
        where = {f.name: record for record, f in option_fields()}
        unknown = sorted(set(options) - set(where))
        if unknown:
            raise TypeError(f"not an option of lmbatch run: {', '.join(unknown)}")
        parts = {record: {k: v for k, v in options.items() if where[k] == record} for record in RECORDS}
        return cls(WorkloadOptions(**parts["workload"]), EngineChoice(**parts["engine"]),
                   OutputOptions(**parts["output"]))

    def flat(self) -> dict[str, Any]:
        """Every option by name, in ORDER."""
        return {f.name: getattr(getattr(self, record), f.name) for record, f in option_fields()}


RUN_ID_MAX = 200    # bytes of a run id: room for the `.NAME.old-PID` a replaced run is kept as (a name's limit is 255)


def run_id_problem(name: str) -> str | None:
    """What makes `name` unfit as a run id, which must be one folder name inside --out; None if it is fit."""
    if not name.strip():
        return "is empty"
    bad = [c for c in name if unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp")]
    if bad:
        return f"has a control character ({ascii(bad[0])})"
    if name.startswith(("/", "\\")) or PureWindowsPath(name).drive:
        return "is an absolute path (or names a drive)"
    if name in (".", ".."):
        return f"is {name!r}, a place rather than a folder name"
    if ".." in name.replace("\\", "/").split("/"):
        return "climbs out of --out ('..')"
    if "/" in name or "\\" in name:
        return "has a path separator ('/' or '\\'): nested folders are not run ids"
    if name.startswith("."):
        return "starts with '.' (a hidden name: lmbatch's own temporary folders have those)"
    if len(name.encode("utf-8", "surrogateescape")) > RUN_ID_MAX:
        return f"is {len(name.encode('utf-8', 'surrogateescape'))} bytes long, more than {RUN_ID_MAX}"
    return None


def check(o: RunOptions, w: Workload) -> None:
    """Every option a user can get wrong, before any work."""
    from lmbatch.scheduler.planner import SCHEDULES

    e = o.engine
    _check_task_options(o.workload, w, e.jump_forward)
    if e.model is not None and not e.model.strip():     # Path('') is '.', the current folder
        raise UserError(f"--model {e.model!r} is empty: name a model folder or hub id, or leave --model out for the "
                        "embedded model")
    if o.output.run_id is not None and (problem := run_id_problem(o.output.run_id)) is not None:
        raise UserError(f"--run-id {o.output.run_id!r} {problem}: a run id is one folder name inside --out")
    if o.workload.limit is not None and o.workload.limit < 1:
        raise UserError("--limit must be at least 1")
    if e.device not in DEVICES:
        raise UserError(f"--device {e.device}: use auto, cpu or cuda")
    if e.dtype is not None and e.dtype not in DTYPES:
        raise UserError(f"--dtype {e.dtype}: use one of {', '.join(DTYPES)}")
    if e.attention not in ATTENTION:
        raise UserError(f"--attention {e.attention}: use one of {', '.join(ATTENTION)}")
    if e.max_tokens_per_batch is not None and e.max_tokens_per_batch < 1:
        raise UserError("--max-tokens-per-batch must be at least 1")
    if not o.output.checkpoint_s > 0:
        raise UserError("--checkpoint-s must be more than 0")
    if e.kv_cache_tokens is not None and e.kv_cache_tokens < 1:
        raise UserError("--kv-cache-tokens must be at least 1")
    if e.threads is not None and e.threads < 1:
        raise UserError(f"--threads {e.threads}: use a number of threads (at least 1), or leave it out")
    check_count("--data-parallel", e.data_parallel)
    check_count("--tensor-parallel", e.tensor_parallel)
    if e.schedule not in SCHEDULES:
        raise UserError(f"--schedule {e.schedule}: use one of {', '.join(SCHEDULES)}")


def _check_shots(shots: int, w: Workload) -> None:
    """--shots against the task; a suite's against each of its tasks that takes --shots (the others hold
    their own examples), and refused where none does."""
    if w.tasks is not None:
        free = [t for t in w.tasks.values() if t.fixed_shots is None]
        for t in free:
            _check_shots(shots, t)
        if free or shots in (0, w.fixed_shots):
            return
        raise UserError(f"--shots {shots}: every task of {w.name} holds its own few-shot examples (OLMES's "
                        "curated 5; a suite's MMLU 5): leave --shots out")
    if w.fixed_shots is not None and shots not in (0, w.fixed_shots):
        raise UserError(f"--shots {shots}: {w.name} runs {w.fixed_shots}-shot (its prompts hold their examples "
                        "whatever --shots says): leave --shots out")
    if w.max_shots is not None and (shots < 0 or shots > w.max_shots):
        raise UserError(f"--shots {shots} is out of range: {w.name} takes 0 to {w.max_shots} few-shot examples")
    if shots < 0:
        raise UserError("--shots must be at least 0")
    if shots > 0 and w.shot_pool is not None and shots >= (pool := w.shot_pool()):
        raise UserError(f"--shots {shots} needs more than the {pool} {w.shot_pool_name}")


def _check_task_options(o: WorkloadOptions, w: Workload, jump_forward: bool) -> None:
    """The options that must fit the task: shots, subjects, chat and thinking options (an option that
    would do nothing for the task is refused rather than ignored; for a suite, subjects must fit one of
    its tasks, chat options all of them)."""
    _check_shots(o.shots, w)
    if o.subjects:
        if w.subjects is None:
            raise UserError(f"--subjects applies to mmlu only, not to {w.name}")
        valid = w.subjects()
        for subject in o.subjects:
            if subject not in valid:
                raise UserError(f"unknown MMLU subject {subject!r}; valid: {', '.join(valid)}")
    if (o.apply_chat_template or o.system_instruction is not None or o.fewshot_as_multiturn) and not w.chat:
        raise UserError(f"--apply-chat-template, --system-instruction and --fewshot-as-multiturn apply to mmlu and "
                        f"hellaswag, not {w.name} (a program renders its own messages with s.chat)")
    if o.fewshot_as_multiturn and not o.apply_chat_template:
        raise UserError("--fewshot-as-multiturn needs --apply-chat-template")
    if o.think_end is not None and o.think_budget is None:
        raise UserError("--think-end goes with --think-budget")
    if o.think_budget is not None and o.think_budget < 0:
        raise UserError("--think-budget must be at least 0")
    if not w.generates:
        given = [flag for flag, on in (("--think-budget", o.think_budget is not None),
                                       ("--think-end", o.think_end is not None),
                                       ("--no-jump-forward", not jump_forward)) if on]
        if given:
            raise UserError(f"{given[0]} does nothing for {w.name}, which generates no text (it only scores "
                            "choices): leave it out")


def engine_spec(o: RunOptions, model_dir: Path, generates: bool, stages: int = 1) -> EngineSpec:
    """The engine the run asks for; what it leaves open is fitted once the device is known (build.fit).
    A workload that `generates` has its decode graphs captured while the host prepares it; its `stages`
    (`Workload.stages`) go to `--data-parallel auto` (engine/devices.py)."""
    e = o.engine
    options = EngineOptions(kv_cache_tokens=e.kv_cache_tokens, max_tokens_per_batch=e.max_tokens_per_batch,
                            attention=e.attention, cache=not e.no_cache, jump_forward=e.jump_forward,
                            deterministic=e.deterministic, threads=e.threads)
    return EngineSpec(str(model_dir), e.device, e.dtype, options, data_parallel=e.data_parallel,
                      tensor_parallel=e.tensor_parallel, ray_address=e.ray_address,
                      relay_s=min(1.0, o.output.checkpoint_s), graphs_ahead=generates, stages=stages)
