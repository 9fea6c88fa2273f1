"""The lm-eval backend's engine: its spec from lm-eval's model args, and its load started before lm-eval
is imported. `lmbatch lm-eval` reads `--model_args` and `--device` from the command line first
(`start_early`), so the model's weights, kernels and graphs load on their own thread while lm-eval
imports (seconds: torch, transformers, datasets) and builds its tasks; `LMBatch` takes that loader
when its model args come to the same spec (`loader_for`), and otherwise starts its own.

Decode graphs are captured ahead only for a run whose tasks generate (`tasks_generate`, called by
`lmbatch lm-eval` once lm-eval's index tells it): capturing them is seconds of the model thread's Python,
which a loglikelihood run would pay beside lm-eval's task building for nothing. Where nobody says (the
Python API), they are captured at the first decode step."""
from __future__ import annotations

import atexit
import weakref
from pathlib import Path
from typing import Any

from lmbatch.engine.options import EngineOptions, EngineSpec
from lmbatch.run.loading import ModelLoader

_EARLY: dict[EngineSpec, ModelLoader] = {}
_GENERATES = [False]        # the run's tasks generate: loaders capture decode graphs once built
# loaders whose thread the process waits for at exit (one ending while that thread is inside torch would
# abort); weak, so a backend that is done with its loader frees its engine (weights, KV pool)
_LOADERS: weakref.WeakSet[ModelLoader] = weakref.WeakSet()


def _join_loaders() -> None:
    for loader in list(_LOADERS):
        loader.thread.join()


atexit.register(_join_loaders)


def engine_spec(model_dir: str | Path, args: dict[str, Any]) -> EngineSpec:
    """The engine model args ask for (values as lm-eval passes them: strings from the command line,
    or typed), before fitting."""
    def number(key: str) -> int | None:
        v = args.get(key)
        return int(v) if v not in (None, "", "None") else None

    dtype = args.get("dtype")
    return EngineSpec(str(model_dir), str(args.get("device") or "auto"),
                      str(dtype) if dtype not in (None, "auto", "None") else None,
                      EngineOptions(kv_cache_tokens=number("kv_cache_tokens"),
                                    max_tokens_per_batch=number("max_tokens_per_batch"),
                                    attention=str(args.get("attention") or "auto"),
                                    deterministic=str(args.get("deterministic")).lower() in ("true", "1"),
                                    threads=number("threads")),
                      data_parallel=str(args.get("data_parallel", "auto")),
                      tensor_parallel=str(args.get("tensor_parallel", "auto")),
                      ray_address=args.get("ray_address") or None, graphs_ahead=False)


def _started(spec: EngineSpec, tokenizer: Any, user_pool: bool) -> ModelLoader:
    loader = ModelLoader(spec, tokenizer, user_pool, graphs=_GENERATES[0])     # its helpers started from the first
    _LOADERS.add(loader)        # waited for at exit (a capture may follow the load)
    return loader


def tasks_generate() -> None:
    """The run's tasks generate text (or may: `lmbatch lm-eval` could not tell): the model's loader,
    started or still to start, captures the decode graphs as soon as its engine is built."""
    _GENERATES[0] = True
    for loader in _EARLY.values():
        loader.capture_graphs()


def start_early(argv: list[str]) -> None:
    """Starts loading the model an `lmbatch lm-eval` command line asks for (`--model lmbatch` or none,
    `--model_args k=v,...`, `--device`), if it can be told from the arguments alone; anything it cannot
    read is left to lm-eval and `LMBatch` (which check and report it)."""
    from lmbatch.model.checkpoint import resolve_model
    from lmbatch.model.tokenizer import LazyTokenizer

    opts: dict[str, str] = {}
    for i, a in enumerate(argv):
        for name in ("--model", "--model_args", "--device"):
            if a == name and i + 1 < len(argv):
                opts[name] = argv[i + 1]
            elif a.startswith(name + "="):
                opts[name] = a.split("=", 1)[1]
    if opts.get("--model", "lmbatch") != "lmbatch" or opts.get("--model_args", "").lstrip().startswith("{"):
        return
    args = {k: v for k, _, v in (kv.partition("=") for kv in opts.get("--model_args", "").split(",") if kv)}
    if "device" in args and "--device" in opts and args["device"] != opts["--device"]:
        return      # two devices: `lmbatch lm-eval` refuses them
    if "--device" in opts:
        args["device"] = opts["--device"]
    try:
        model_dir = resolve_model(args.get("pretrained") or None)
        spec = engine_spec(model_dir, args)
    except Exception:  # noqa: BLE001  a bad value: lm-eval and LMBatch say what is wrong
        return
    _EARLY[spec] = _started(spec, LazyTokenizer.of(model_dir), user_pool=spec.options.kv_cache_tokens is not None)


def loader_for(spec: EngineSpec, tokenizer: Any) -> ModelLoader:
    """The loader started early for this spec, else a new one (an early one for another spec is ended
    first: one model's memory at a time)."""
    loader = _EARLY.pop(spec, None)
    for other in list(_EARLY.values()):
        other.thread.join()
        if other.loaded is not None:
            other.loaded.engine.close()
    _EARLY.clear()
    return loader or _started(spec, tokenizer, user_pool=spec.options.kv_cache_tokens is not None)
