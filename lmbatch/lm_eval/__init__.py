"""lmbatch as lm-evaluation-harness's backend: `backend.LMBatch` and `lmbatch lm-eval`, the engine it loads
early (`engine`), lm-eval's requests as token ids (`tokens`) and generations (`generate`), its task index
(`index`), the offline task files (`offline`, `write_offline_tasks` here too). Its modules import the
third-party `lm_eval` absolutely; importing this package loads none of them (`write_offline_tasks` is looked up
when first asked for)."""
from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "write_offline_tasks":
        from lmbatch.lm_eval.offline import write_offline_tasks

        return write_offline_tasks
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
