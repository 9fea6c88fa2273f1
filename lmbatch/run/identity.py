"""What decides a run, in one place: its fingerprint (a resumed run must have the same), its default run id,
and the options that decide its prepared workload (the workload cache's key). All three open with the task
and the options of `options.deciding`."""
from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lmbatch
from lmbatch.model.identity import model_identity
from lmbatch.model.quantization import declared
from lmbatch.options import RunOptions, deciding
from lmbatch.rundir.records import sha256

if TYPE_CHECKING:
    from lmbatch.frontend.workload import Workload
    from lmbatch.model.config import ModelConfig


def _workload(o: RunOptions, w: Workload) -> dict[str, Any]:
    """What decides the prompts and the plan's tokens: the task, its options, jump-forward decoding."""
    return {"task": w.name, **deciding(o.workload), "jump_forward": o.engine.jump_forward}


def fingerprint(o: RunOptions, w: Workload, model_dir: Path) -> dict[str, Any]:
    """What decides a run's results (a resumed run must have the same): the task and its options
    (`options.deciding`), jump-forward decoding, deterministic mode, whether requests keep their token ids,
    the model's files (each by its content: model/identity.py) and, for a quantized checkpoint, its format
    (model/quantization.py), lmbatch's version. The dtype is checked once
    the device is known."""
    fp: dict[str, Any] = {**_workload(o, w), "save_token_ids": o.output.save_token_ids,
                          "lmbatch_version": lmbatch.__version__, "model": model_identity(model_dir)}
    if (quantization := declared(model_dir)) is not None:     # said apart, where a resume finds it differs
        fp["quantization"] = quantization
    if o.engine.deterministic:          # a resume may not mix its bits with another attempt's numerics
        fp["deterministic"] = True
    if o.workload.task.endswith(".py"):
        fp["program"] = sha256(Path(o.workload.task))
    return fp


def default_run_id(w: Workload, shots: int, model_dir: Path) -> str:
    """task-Kshot-MODEL-TIME, one folder name whatever the task's and the model folder's names hold."""
    def safe(text: str, n: int) -> str:
        return "".join(c if c.isalnum() or c in "-_.+" else "_" for c in text)[:n].lstrip(".") or "_"
    return f"{safe(w.name, 60)}-{w.shots(shots)}shot-{safe(model_dir.name, 80)}-{dt.datetime.now():%Y%m%d-%H%M%S}"


def run_id(o: RunOptions, w: Workload, model_dir: Path) -> str:
    """--run-id, else the default (task-shots-model-time)."""
    return o.output.run_id or default_run_id(w, o.workload.shots, model_dir)


def cache_options(o: RunOptions, w: Workload, shape: ModelConfig) -> dict[str, Any]:
    """What decides a workload besides its files (the cache key's options): the task and its options
    (`options.deciding`), and what of the engine and model (its shape) its calls and plan depend on."""
    return {**_workload(o, w), "schedule": o.engine.schedule, "max_len": shape.max_position_embeddings,
            "vocab_size": shape.vocab_size}
