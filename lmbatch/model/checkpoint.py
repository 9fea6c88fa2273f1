"""Find the model to run: the embedded SmolLM2-135M-Instruct, a local HF folder, or a hub id."""

from __future__ import annotations

import functools
import json
import re
import sys
from pathlib import Path

from lmbatch.errors import UserError, first_line
from lmbatch.model.config import ARCHITECTURES, ModelConfig, config_problem
from lmbatch.model.embedded import embedded_model_dir
from lmbatch.model.names import name_problem, unplaced
from lmbatch.model.quantization import (
    Quantization,
    QuantizationProblem,
    StoredTensor,
    logical_tensors,
    read_quantization,
)
from lmbatch.model.shapes import TensorHeader, shape_problem

EMBEDDED_ALIASES = ("embedded", "smollm2-135m")
SUPPORTED_TYPES = tuple(ARCHITECTURES)    # run by our own network; other causal LMs by transformers
CAUSAL_HEADS = ("ForCausalLM", "LMHeadModel")    # how causal LM classes' names end
HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.txt", "*.model"]
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
# the JSON files of a model folder that lmbatch or transformers reads besides config.json (tokenizer.json
# is checked with the tokenizers library): each must parse, as an object, before anything reads the folder
JSON_FILES = ("generation_config.json", "model.safetensors.index.json", "tokenizer_config.json",
              "special_tokens_map.json", "added_tokens.json", "vocab.json")


def resolve_model(spec: str | None) -> Path:
    """Folder of the model named by spec: None/'embedded'/'smollm2-135m', a local folder, or 'org/name'."""
    if spec is None or spec.strip().lower() in EMBEDDED_ALIASES:
        path = embedded_model_dir()
        _check_folder(path)         # a cache folder may be damaged like any other
        return path
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


def names_hub_model(spec: str) -> bool:
    """Whether `resolve_model(spec)` would look on the Hugging Face hub (no local folder of that name)."""
    return not Path(spec).expanduser().exists() and spec.strip().lower() not in EMBEDDED_ALIASES \
        and _HUB_ID.fullmatch(spec) is not None


def _check_folder(path: Path) -> Path:
    """Return path if it is an HF folder holding a causal LM we can run, else raise UserError: a
    model_type network.py implements, or any other decoder-only LM (run through transformers); its
    config's sizes given and of the right types, every JSON file that lmbatch or transformers reads
    readable, its weights there and whole and, for a native model_type, of the shapes its config gives
    (by their headers), its tokenizer.json one that `tokenizers` loads. Our own checks, cheap, and before
    any other work or library reads the folder: what a run would otherwise find only after loading the
    data, as a dependency's traceback."""
    if not (path / "config.json").is_file():
        raise UserError(f"{path} is not a Hugging Face model folder (no config.json)")
    config = _json_object(path, "config.json")
    kind = config.get("model_type")
    archs = [str(a) for a in (config.get("architectures") or [])]
    if not _is_causal_lm(kind, archs):
        what = "/".join(archs) + (f" ({kind})" if kind else "") if archs else (kind or "model of unknown type")
        raise UserError(f"model at {path} is a {what}: lmbatch runs causal LMs: natively "
                        f"{', '.join(SUPPORTED_TYPES)}; any other decoder-only model through transformers")
    problem = config_problem(config)
    if problem:
        raise UserError(f"model at {path}: config.json: {problem}")
    for name in JSON_FILES:
        if (path / name).is_file():
            _json_object(path, name)
    native = kind in SUPPORTED_TYPES and not _pickles_only(path)
    stored, where = _check_weights(path, native)
    tensors = _as_model_tensors(path, config, stored) if native and where else _headers(stored)
    why = not_native(path, config, tensors, where)
    if why is not None:
        _to_fallback(path, config, why)
    if (path / "tokenizer.json").is_file():
        from lmbatch.model.tokenizer_build import check_tokenizer_json

        problem = check_tokenizer_json(path / "tokenizer.json")
        if problem:
            raise UserError(f"model at {path}: tokenizer.json {problem}")
    return path.resolve()


def _headers(tensors: dict[str, StoredTensor]) -> dict[str, TensorHeader]:
    return {n: TensorHeader(t.shape, t.file) for n, t in tensors.items()}


def _as_model_tensors(path: Path, config: dict, tensors: dict[str, StoredTensor]) -> dict[str, TensorHeader]:
    """A native model's stored tensors as the model's (a quantized checkpoint's weights paired with their scales,
    model/quantization.py), or a UserError naming the tensor and format lmbatch cannot read."""
    quantization = _quantization(path, config)
    try:
        logical = logical_tensors(quantization, tensors, ARCHITECTURES[str(config.get("model_type"))].mxfp4_transposed)
    except QuantizationProblem as e:
        raise UserError(f"model at {path}: {e}") from None
    return _headers(logical)


def _quantization(path: Path, config: dict) -> Quantization | None:
    """The quantization a native model's config.json declares, or a UserError naming what lmbatch cannot read."""
    try:
        return read_quantization(config)
    except QuantizationProblem as e:
        raise UserError(f"model at {path}: config.json: {e}") from None


def _json_object(path: Path, name: str) -> dict:
    """The JSON object in the folder's file `name`, or a UserError naming the file."""
    try:
        data = json.loads((path / name).read_text(encoding="utf-8"))
    except OSError as e:
        raise UserError(f"model at {path}: {name} cannot be read ({e.strerror or e})") from None
    except ValueError as e:     # not UTF-8, or not JSON (json.JSONDecodeError)
        raise UserError(f"model at {path}: {name} is not readable JSON ({e})") from None
    if not isinstance(data, dict):
        raise UserError(f"model at {path}: {name} is not a JSON object (it holds a {type(data).__name__})")
    return data


def _check_weights(path: Path, native: bool) -> tuple[dict[str, StoredTensor], str]:
    """The folder's weights are there and their safetensors headers are whole, before any other work (a
    truncated download would otherwise fail only once the data was loaded and tokenized). Reads headers only;
    returns every tensor's shape and file, and how to name the weights in a message."""
    index = path / "model.safetensors.index.json"
    if index.is_file():         # sharded: the shards the index names, as weights.py loads them
        weight_map = _json_object(path, index.name).get("weight_map")
        if not (isinstance(weight_map, dict) and weight_map and all(isinstance(f, str) for f in weight_map.values())):
            raise UserError(f"model at {path}: {index.name} has no weight_map of tensor names to shard files")
        files = sorted({path / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise UserError(f"model at {path}: {index.name} names shards that are not there: {', '.join(missing)}")
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        # transformers (the fallback) also reads PyTorch pickles; our own network reads safetensors only
        if native or not any(path.glob("pytorch_model*.bin")):
            raise UserError(f"model at {path} has no *.safetensors weights")
        return {}, ""
    tensors: dict[str, StoredTensor] = {}
    for f in files:
        header, problem = read_safetensors_header(f)
        if problem:
            raise UserError(f"model at {path}: {f.name} is not a readable safetensors file ({problem})")
        for name, entry in header.items():
            if name != "__metadata__":
                tensors[name] = StoredTensor(tuple(entry["shape"]), str(entry.get("dtype")), f.name)
    where = files[0].name if len(files) == 1 else f"the shards of {index.name}" if index.is_file() else \
        ", ".join(f.name for f in files)
    return tensors, where


def _pickles_only(path: Path) -> bool:
    return not any(path.glob("*.safetensors")) and not (path / "model.safetensors.index.json").is_file() and \
        any(path.glob("pytorch_model*.bin"))


def not_native(path: Path, config: dict, tensors: dict[str, TensorHeader], where: str) -> str | None:
    """Why lmbatch's own network does not run the folder's model, in a few words naming the model_type, the
    feature or the tensor; None where it does. A native model_type's checkpoint whose shapes disagree with
    its config (shapes.py), that lacks a tensor the network needs, or holds one neither lmbatch's network
    nor transformers' model has a place for is broken (UserError naming both), not one for the fallback.
    A folder without weights (`--load-format dummy`) is judged by its config alone."""
    kind = config.get("model_type")
    if kind not in SUPPORTED_TYPES:
        return f"model_type {kind!r} is not one lmbatch's network implements"
    if not where and _pickles_only(path):
        return "its weights are PyTorch pickles (pytorch_model*.bin), which lmbatch's network does not read"
    try:
        cfg = ModelConfig.from_json(config)
    except ValueError as e:     # a variant of a native model_type we do not run (e.g. its RoPE)
        return first_line(e)
    if not where:               # no weight files: random weights (`--load-format dummy`)
        return None
    problem = shape_problem(cfg, config, tensors, where)
    if problem:
        raise UserError(f"model at {path}: {problem}")
    extra = unplaced(cfg, list(tensors))
    if extra:
        why = _unplaced_why(path, config, extra[0])
        if why is None:
            raise UserError(f"model at {path}: {name_problem(cfg, list(tensors), where)}")
        return why
    problem = name_problem(cfg, list(tensors), where)
    if problem:
        raise UserError(f"model at {path}: {problem}")
    return None


def _unplaced_why(path: Path, config: dict, name: str) -> str | None:
    """Why a tensor lmbatch's network has no place for is one the fallback runs: the checkpoint is quantized in
    a format this network does not load, or transformers' model of the config has the tensor (a feature of the
    model_type lmbatch lacks, such as Llama's MLP biases). None: neither (a stray tensor; the checkpoint is
    broken)."""
    quant = config.get("quantization_config")
    if isinstance(quant, dict):
        return f"{name}: its weights are quantized ({quant.get('quant_method') or 'quantization_config'}), in a " \
               "format lmbatch's network does not load"
    if name in transformers_tensors(path):
        return f"it holds {name}, which transformers' {config.get('model_type')} model of this config.json has " \
               "and lmbatch's network has no place for"
    return None


@functools.cache
def transformers_tensors(path: Path) -> frozenset[str]:
    """The names of the tensors transformers' causal LM of the folder's config has (its state dict, built on
    the meta device: no memory, a few seconds); empty where it cannot build one."""
    import lmbatch

    with lmbatch.IMPORT_LOCK:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(path)))
    except Exception:  # noqa: BLE001  any failure to build it is transformers' own: no tensor is its
        return frozenset()
    return frozenset(model.state_dict())


_NOTICED: set[Path] = set()


def _to_fallback(path: Path, config: dict, why: str) -> None:
    """A model lmbatch's network does not run goes to the transformers fallback, with a one-line notice saying
    why (once per folder and process), where the fallback can run it; else one line saying why neither can."""
    cannot = fallback_problem(config)
    if cannot:
        raise UserError(f"model at {path}: lmbatch's network does not run it ({why}), and the transformers "
                        f"fallback cannot either: {cannot}")
    if path.resolve() not in _NOTICED:
        _NOTICED.add(path.resolve())
        print(f"lmbatch: model at {path} runs on the transformers fallback (slower; no decode graphs or tensor "
              f"parallelism): {why}", file=sys.stderr)


def fallback_problem(config: dict) -> str | None:
    """Why the transformers fallback cannot run a model, known from its config.json before anything loads
    (model/fallback.py checks the rest as it runs), or None."""
    if config.get("kv_lora_rank"):
        return ("its multi-head latent attention caches a latent per token, not keys and values of (kv heads, "
                "head dim), so the fallback's KV pool cannot hold them")
    return None


def model_config(path: str | Path) -> ModelConfig:
    """The config lmbatch runs the folder's model with: its own network's where `not_native` finds nothing,
    else the transformers fallback's shape (as transformers reads the config). For a folder `resolve_model`
    returned (checked); read again by each process that builds the model, to the same decision."""
    path = Path(path)
    config = _json_object(path, "config.json")
    if config.get("model_type") in SUPPORTED_TYPES:
        weights = any(path.glob("*.safetensors")) or (path / "model.safetensors.index.json").is_file()
        stored, where = _check_weights(path, False) if weights else ({}, "")     # none: random weights, or none
        tensors = _as_model_tensors(path, config, stored) if where else {}
        if not_native(path, config, tensors, where) is None:
            return ModelConfig.from_json(config)
    import lmbatch

    with lmbatch.IMPORT_LOCK:
        from transformers import AutoConfig
    hf = AutoConfig.from_pretrained(str(path))
    try:
        return ModelConfig.for_fallback(hf)
    except AttributeError as e:  # no attention shape (e.g. a state-space model)
        raise UserError(f"model at {path} has no attention shape lmbatch's KV cache can hold ({e}): "
                        "lmbatch runs decoder-only attention models") from None


def check_tokenizer_files(path: Path) -> None:
    """Raise UserError if the folder has no tokenizer (transformers' error says so in many lines)."""
    from lmbatch.model.tokenizer import has_tokenizer

    if not has_tokenizer(path):
        raise UserError(f"model at {path} has no tokenizer files (tokenizer.json or tokenizer_config.json)")


SAFETENSORS_MAX_HEADER = 100_000_000    # as the safetensors library limits it


def read_safetensors_header(file: Path) -> tuple[dict, str | None]:
    """A safetensors file's header (tensor name -> dtype, shape, data_offsets) and what is wrong with the
    file's framing (None: nothing), from the header alone: an 8-byte little-endian header length, that
    many bytes of JSON giving each tensor's shape and data offsets, then the data, which must end exactly
    at the end of the file (as the safetensors library checks)."""
    try:
        size = file.stat().st_size
        with file.open("rb") as fh:
            head = fh.read(8)
            if (head + fh.read(16)).startswith(b"version https://git-lfs"):
                return {}, "it is a Git LFS pointer, not the weights: fetch them with `git lfs pull`"
            fh.seek(8)
            if len(head) < 8:
                return {}, f"{size} bytes, too short for a header"
            n = int.from_bytes(head, "little")
            if n > min(size - 8, SAFETENSORS_MAX_HEADER):
                return {}, f"its header length {n} exceeds the file's {size} bytes"
            header = json.loads(fh.read(n))
    except OSError as e:
        return {}, e.strerror or str(e)
    except ValueError:      # not UTF-8, or not JSON
        return {}, "its header is not JSON"
    if not isinstance(header, dict):
        return {}, "its header is not a JSON object"
    end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
                and 0 <= offsets[0] <= offsets[1]):
            return {}, f"tensor {name!r} has no valid data_offsets"
        shape = entry.get("shape")
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
            return {}, f"tensor {name!r} has no valid shape"
        end = max(end, offsets[1])
    if 8 + n + end > size:
        return {}, f"its tensors need {8 + n + end} bytes but the file has {size}: truncated?"
    if 8 + n + end < size:
        return {}, f"it has {size} bytes, {size - 8 - n - end} past the end of its tensors' data"
    return header, None


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
