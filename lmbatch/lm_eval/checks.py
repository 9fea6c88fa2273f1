"""`lmbatch lm-eval run`'s inputs and `LMBatch`'s model_args, checked before any work: a bad one is a UserError of
one line naming it and what it takes, not lm-eval's traceback minutes later (a task lm-eval does not know, data
it would download offline, a device or dtype the machine lacks)."""
from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Sequence

from lmbatch.errors import UserError


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
