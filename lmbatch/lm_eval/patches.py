"""What `lmbatch lm-eval` changes of lm-eval's own behaviour, each a patch kept to one place: task templates
compiled once (`cache_templates`), lm-eval's environment report made on a thread while the run starts
(`env_info_ahead`), and a task's data read straight from local Arrow files where it is only those, an
unreadable one a UserError naming the task (`tasks_name_their_data`)."""
from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from lmbatch.errors import UserError, first_line


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


@contextmanager
def env_info_ahead(run: bool) -> Iterator[None]:
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
def tasks_name_their_data() -> Iterator[None]:
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
