"""A built-in task's workload as the host prepared it (instances, every first-stage call's token ids,
the first wave's plan, the dry run's figures), kept on disk so that the same workload is not loaded,
tokenized and planned again: full MMLU's host work is seconds, reading it back a fraction of one.

An entry's name is a hash of everything that decides its content: the task and the options that
shape its prompts, plan and checks (shots, limit, subjects, seed, chat template options, thinking,
--truncate-left, jump-forward, schedule), the task's data files, the model folder's tokenizer and
config files (by content), the model's context length and vocabulary, lmbatch's own source and
the versions of the libraries that make the tokenizer. What is read back is trusted only whole: a
file is a header (its format, key and the payload's size and SHA-256) and the payload; anything
else (truncated, altered, another version's) is made again, with a one-line notice.

`lmbatch lm-eval` keeps each loglikelihood call's requests the same way (`store_scores`): their token
ids and plan, under a hash of the requests' text, the backend's tokenization options and the same
model files and code, so a repeat of an lm-eval command tokenizes and plans nothing.

    ~/.cache/lmbatch/workloads/<key>.pkl    ($LMBATCH_CACHE, else $XDG_CACHE_HOME/lmbatch)
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import pickle
import sys
from dataclasses import dataclass
from functools import lru_cache
from itertools import chain
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from lmbatch.cache import atomic_write, cache_dir
from lmbatch.frontend.calls import KnownIds
from lmbatch.frontend.workload import Instance
from lmbatch.model.identity import WEIGHT_SUFFIXES
from lmbatch.requests import ScoreRequest
from lmbatch.scheduler.planner import Plan, plan_from_arrays, plan_to_arrays

FORMAT = b"LMBWORK1"
KEEP = 16                   # entries kept; the least recently written go


@dataclass
class Snapshot:
    """A task's prepared workload: its instances, the token ids of every first-stage call (by the
    program's number and the call's, with a digest of the call's text), the first wave's plan where it
    is made before the engine (every first-stage call a select), and the dry run's figures."""
    instances: list[Instance]
    known: KnownIds
    plan: Plan | None
    figures: dict[str, Any]


def _hash_files(h: Any, files: list[Path]) -> None:
    for f in files:
        h.update(b"\0" + f.name.encode() + b"\0")
        with open(f, "rb") as fh:
            while block := fh.read(1 << 20):
                h.update(block)


def hash_source(h: Any, packages: Sequence[str]) -> None:
    """Feed `h` every .py file of the installed `packages` (lmbatch's, whose folders map in), path and text."""
    for pkg in packages:
        spec = importlib.util.find_spec(pkg)
        assert spec is not None and spec.submodule_search_locations is not None, pkg
        root = Path(list(spec.submodule_search_locations)[0])
        for f in sorted(root.rglob("*.py")):
            h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes())


@lru_cache(maxsize=1)
def code_version() -> str:
    """lmbatch's version and a hash of its installed source (prompts and tokenization are code)."""
    import lmbatch

    h = hashlib.sha256(lmbatch.__version__.encode())
    hash_source(h, ("lmbatch", "lmbatch.programs", "lmbatch.scheduler"))     # programs/, scheduler/ map in
    for lib in ("tokenizers", "transformers"):
        h.update(f"\0{lib}={importlib.metadata.version(lib)}".encode())
    return h.hexdigest()


def key(options: dict[str, Any], data_files: list[Path], model_dir: Path) -> str:
    """The entry's name: `options` (the workload's own, JSON-able), the data files' and the model folder's
    small files' content, and `code_version`."""
    h = hashlib.sha256(json.dumps(options, sort_keys=True, default=str).encode())
    _hash_files(h, data_files)
    _hash_files(h, sorted(f for f in model_dir.iterdir()
                          if f.is_file() and not f.name.endswith(WEIGHT_SUFFIXES) and f.stat().st_size <= 64 << 20))
    h.update(code_version().encode())
    return h.hexdigest()[:40]


def path_of(name: str) -> Path:
    return cache_dir() / "workloads" / f"{name}.pkl"


def _encode(snap: Snapshot) -> dict[str, Any]:
    """The snapshot with its token ids as flat arrays (fast to write and read) rather than lists."""
    keys = sorted(snap.known)
    segments: list[list[int]] = []
    kinds, counts, digests = [], [], []
    for k in keys:
        digest, ids = snap.known[k]
        digests.append(digest)
        if isinstance(ids, tuple):          # a select: its context, then each choice's continuation
            kinds.append(1)
            segments += [ids[0], *ids[1]]
            counts.append(1 + len(ids[1]))
        else:
            kinds.append(0)
            segments.append(ids)
            counts.append(1)
    lens = np.fromiter(map(len, segments), np.int64, len(segments))
    flat = np.concatenate([np.asarray(s, np.int32) for s in segments]) if segments else np.zeros(0, np.int32)
    return {"instances": snap.instances, "keys": np.asarray(keys, dtype=np.int64).reshape(-1, 2),
            "kinds": np.asarray(kinds, np.int8), "counts": np.asarray(counts, np.int64), "lens": lens, "flat": flat,
            "digests": b"".join(digests), "plan": None if snap.plan is None else plan_to_arrays(snap.plan),
            "figures": snap.figures}


def _decode(d: dict[str, Any]) -> Snapshot:
    flat, ends = d["flat"].tolist(), np.cumsum(d["lens"]).tolist()
    known: KnownIds = {}
    digests, s = d["digests"], 0
    for n, ((number, seq), kind, count) in enumerate(zip(d["keys"].tolist(), d["kinds"].tolist(),
                                                         d["counts"].tolist())):
        parts = [flat[(ends[s + k - 1] if s + k else 0):ends[s + k]] for k in range(count)]
        s += count
        known[(number, seq)] = (digests[16 * n:16 * n + 16], (parts[0], parts[1:]) if kind == 1 else parts[0])
    plan = None if d["plan"] is None else plan_from_arrays(d["plan"])
    return Snapshot(d["instances"], known, plan, d["figures"])


def store(path: Path, snap: Snapshot, temporary: bool = False) -> bool:
    """Write the entry (to a temporary name, then renamed: a reader sees a whole file or none); keep the
    KEEP most recent. A cache that cannot be written is said and left alone: False. A `temporary` file
    (not in the cache) is only written."""
    return write_entry(path, _encode(snap), temporary, note={"figures": snap.figures})


def load(path: Path) -> Snapshot | None:
    """The entry at `path`, or None: absent, or not whole (then it goes, with a one-line notice)."""
    data = read_entry(path)
    return None if data is None else _decode(data)


def store_scores(path: Path, requests: Sequence[ScoreRequest], plan: Plan | None) -> bool:
    """An lm-eval call's loglikelihood requests as token ids, and their plan (None: planned by the engine's
    workers), as `store` writes an entry. A context list that several requests share (one question's
    choices) is written once, and read back as one list again."""
    at: dict[int, int] = {}         # id of a context list -> its place in `contexts`
    contexts: list[list[int]] = []
    which: list[int] = []
    for r in requests:
        i = at.setdefault(id(r.context), len(contexts))
        if i == len(contexts):
            contexts.append(r.context)
        which.append(i)
    return write_entry(path, {"contexts": _flat(contexts), "continuations": _flat([r.continuation for r in requests]),
                         "which": np.asarray(which, np.int64), "plan": None if plan is None else plan_to_arrays(plan)})


def _flat(lists: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    lens = np.fromiter(map(len, lists), np.int64, len(lists))
    return lens, np.fromiter(chain.from_iterable(lists), np.int32, int(lens.sum()))


def _lists(lens: np.ndarray, flat: np.ndarray) -> list[list[int]]:
    ids, ends = flat.tolist(), np.cumsum(lens).tolist()
    return [ids[end - n:end] for n, end in zip(lens.tolist(), ends)]


def load_scores(path: Path) -> tuple[list[ScoreRequest], Plan | None] | None:
    """What `store_scores` wrote, or None (as `load`)."""
    d = read_entry(path)
    if not isinstance(d, dict) or not {"contexts", "continuations", "which", "plan"} <= d.keys():
        return None
    contexts = _lists(*d["contexts"])
    requests = [ScoreRequest(contexts[i], cont) for i, cont in zip(d["which"].tolist(), _lists(*d["continuations"]))]
    return requests, None if d["plan"] is None else plan_from_arrays(d["plan"])


def _write_parts(path: Path, *parts: bytes) -> None:
    with open(path, "wb") as fh:
        for part in parts:
            fh.write(part)


@dataclass(frozen=True)
class Store:
    """A cache folder's rules: how many entries it keeps, its name and what it keeps (for messages)."""
    keep: int
    cache: str
    keeps: str


WORKLOADS = Store(KEEP, "workload", "prepared workloads")


def write_entry(path: Path, obj: dict[str, Any], temporary: bool = False, store: Store = WORKLOADS,
                note: Any = None) -> bool:
    """`obj` pickled under a header (format, payload size and SHA-256, and `note`: what `read_note` gives
    without reading the rest), to a temporary name, then renamed: a reader sees a whole file or none. The
    `store.keep` most recent entries of its folder stay. A folder that cannot be written is said (naming
    the store) and left alone: False. A `temporary` file (not in a cache) is only written."""
    keep, cache, keeps = store.keep, store.cache, store.keeps
    payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    header = json.dumps({"bytes": len(payload), "sha256": hashlib.sha256(payload).hexdigest(),
                         "note": note}).encode()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda tmp: _write_parts(tmp, FORMAT + len(header).to_bytes(4, "little") + header, payload))
        if not temporary:
            entries = sorted(path.parent.glob("*.pkl"), key=lambda f: f.stat().st_mtime)
            for old in entries[:-keep]:
                old.unlink(missing_ok=True)
        return True
    except OSError as e:
        if not temporary:
            print(f"lmbatch: the {cache} cache {path.parent} is not writable ({e.strerror or e}); set "
                  f"LMBATCH_CACHE to a writable folder to keep {keeps}", file=sys.stderr)
        return False


def read_note(path: Path) -> Any:
    """The note an entry's header holds (None: no entry, or none there), its payload not read or checked."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(12)
            if head[:8] != FORMAT:
                return None
            return json.loads(fh.read(int.from_bytes(head[8:12], "little"))).get("note")
    except (OSError, ValueError):
        return None


def read_entry(path: Path, what: str = "cached workload", again: str = "preparing it again") -> Any:
    """What `write_entry` wrote at `path`, or None: absent, or not whole (then it goes, with a one-line notice
    naming `what` it is and what happens `again`)."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    try:
        if data[:8] != FORMAT:
            raise ValueError("not an lmbatch workload file of this version")
        n = int.from_bytes(data[8:12], "little")
        header = json.loads(data[12:12 + n])
        payload = data[12 + n:]
        if len(payload) != header["bytes"] or hashlib.sha256(payload).hexdigest() != header["sha256"]:
            raise ValueError("truncated or altered")
        return pickle.loads(payload)
    except Exception as e:  # noqa: BLE001  whatever is wrong with it, it is made again
        print(f"lmbatch: {what} {path.name} is unreadable ({type(e).__name__}: {e}); {again}", file=sys.stderr)
        path.unlink(missing_ok=True)
        return None
