"""The tokenizer AutoTokenizer would make for a model folder, made without importing transformers
(`build_tokenizer`): which class AutoTokenizer picks (`choose_class`), the special and added tokens it gives
that class, and the class's own normalizer and pre-tokenizer where it rebuilds tokenizer.json; a
tokenizer.json checked before anything reads it (`check_tokenizer_json`). `Fallback` where this does not
know what transformers would make."""
from __future__ import annotations

import fnmatch
import importlib.util
import json
import os
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE

from lmbatch.errors import first_line
from lmbatch.model.architectures import ARCHITECTURES

# ---- the tokenizer as transformers makes it, without transformers ---------------------------------------
# Mirrors transformers 5's AutoTokenizer.from_pretrained: which class it picks for a folder
# (models/auto/tokenization_auto.py), the special and added tokens it gives that class
# (tokenization_utils_base._from_pretrained, TokenizersBackend.__init__), and whether the class loads
# tokenizer.json as it stands (TokenizersBackend) or rebuilds it from the vocabulary and merges with its
# own normalizer and pre-tokenizer (LlamaTokenizer, Qwen2Tokenizer, GemmaTokenizer, GPT2Tokenizer,
# GPTNeoXTokenizer). A Qwen2 folder, say, gets Qwen2's pre-tokenizer whatever its tokenizer.json says.
GENERIC = {"TokenizersBackend", "PreTrainedTokenizerFast", "PreTrainedTokenizer", "PythonBackend",
           "BloomTokenizer", "BloomTokenizerFast"}


# transformers' mistral-common types besides the native ones (whose entries name their class)
MISTRAL_TYPES = {"ministral", "ministral3", "mistral3", "mistral_large4", "pixtral", "voxtral", "voxtral_realtime"}


# model_type -> TOKENIZER_MAPPING_NAMES entry (transformers 5.24), for the types we know (the native ones:
# their entries in architectures.py); "" = in CONFIG_MAPPING but absent from TOKENIZER_MAPPING_NAMES
# (AutoTokenizer then defaults to TokenizersBackend).
MAPPING = {
    "qwen2_moe": "Qwen2Tokenizer", "qwen3_next": "Qwen2Tokenizer",
    "phimoe": "TokenizersBackend", "olmo3": "TokenizersBackend",
    "olmo": "GPTNeoXTokenizer", "olmoe": "GPTNeoXTokenizer", "gpt_neox": "GPTNeoXTokenizer",
    "gemma": "GemmaTokenizer", "gemma3": "GemmaTokenizer",
    "gpt2": "GPT2Tokenizer", "phi": "GPT2Tokenizer", "starcoder2": "GPT2Tokenizer",
    "granite": "TokenizersBackend", "stablelm": "TokenizersBackend",
    **{t: "MistralCommonBackend" for t in MISTRAL_TYPES},
    **{kind: arch.tokenizer for kind, arch in ARCHITECTURES.items()},
}


# MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS (5.24) with their mapping where it is not TokenizersBackend (nor a
# native entry's `tokenizer`)
INCORRECT = {"arctic", "chatlm", "ernie4_5", "ernie4_5_moe", "fuyu", "h2ovl_chat", "hyperclovax", "hyperclovax_vlm",
             "hyperclovax_vision_v2", "internlm2", "internlm3", "iquestcoder", "jamba", "llava", "llava_next",
             "minicpm3", "minicpmv", "minimax_m2", "modernbert", "modernbert-decoder", "molmo", "molmo2", "nemotron",
             "nvfp4", "opencua", "openvla", "paddleocr_vl", "phi3_v", "phimoe", "qwen3_5",
             "qwen3_5_moe", "qwen3_5_moe_text", "qwen4_exp", "step3_vl", "vipllava", "cohere_asr",
             "camembertv2-base", "siglip2", "smolvlm"} | {kind for kind, arch in ARCHITECTURES.items()
                                                          if arch.hub_tokenizer_wrong}


INCORRECT_MAPPED = {"hyperclovax_vision_v2": "GPT2Tokenizer", "siglip2": "Siglip2Tokenizer",
                    "qwen3_5": "Qwen3_5Tokenizer", "qwen3_5_moe": "Qwen3_5Tokenizer",
                    "qwen3_5_moe_text": "Qwen3_5Tokenizer", "qwen4_exp": "Qwen3_5Tokenizer"}


MODEL_IDS_TO_TOKENIZERS_BACKEND = ["deepseek-ai/deepseek-r1-distill-llama-*", "deepseek-ai/deepseek-coder-*",
                                   "allenai/dolma2-tokenizer", "google/umt5-small", "naver-clova-ix/donut-*",
                                   "salesforce/blip2-opt-*", "salesforce/blip2-flan-t5-*",
                                   "salesforce/instructblip-flan-t5-*", "stepfun-ai/step-3.7-*"]


STD = ["bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"]


# the classes we rebuild, with their __init__ defaults for the named special tokens
REBUILT: dict[str, dict[str, str | None]] = {
    "LlamaTokenizer": {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"},
    "Qwen2Tokenizer": {"unk_token": "<|endoftext|>", "bos_token": None, "eos_token": "<|endoftext|>",
                       "pad_token": "<|endoftext|>"},
    "GemmaTokenizer": {"unk_token": "<unk>", "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
                       "mask_token": "<mask>"},
    "GPT2Tokenizer": {"unk_token": "<|endoftext|>", "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>",
                      "pad_token": None},
    "GPTNeoXTokenizer": {"unk_token": "<|endoftext|>", "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>",
                         "pad_token": "<|padding|>"},
}


QWEN2_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
               r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")


# the transformers versions whose AutoTokenizer this mirrors (tests/unit/test_tokenizer_build.py compares
# the two on the installed one); any other builds the tokenizer with transformers
VALIDATED = ((5, 0), (5, 24))


# the tokenizer.json `check_tokenizer_json` checked last, as loaded (by its path, size and mtime), until
# `build_tokenizer` takes it: a run parses the file once
_CHECKED: dict[tuple[str, int, int], tuple[dict, Tokenizer]] = {}


def _file_key(file: Path) -> tuple[str, int, int]:
    st = file.stat()
    return str(file.resolve()), st.st_size, st.st_mtime_ns


def check_tokenizer_json(file: Path) -> str | None:
    """What is wrong with a tokenizer.json, as a phrase after its name (None: nothing): not UTF-8 JSON,
    not an object, or not a tokenizer the `tokenizers` library loads. Checked before transformers reads
    it (a truncated file there ends in its JSONDecodeError); what it loaded is kept for `build_tokenizer`."""
    try:
        text = file.read_text(encoding="utf-8")
        spec = json.loads(text)
    except OSError as e:
        return f"cannot be read ({e.strerror or e})"
    except ValueError as e:     # not UTF-8, or not JSON (json.JSONDecodeError)
        return f"is not readable JSON ({e})"
    if not isinstance(spec, dict):
        return f"is not a JSON object (it holds a {type(spec).__name__})"
    try:
        tok = Tokenizer.from_str(text)
    except Exception as e:  # noqa: BLE001  the library's one error type for a spec it cannot load
        return f"does not load as a tokenizer ({first_line(e)})"
    _CHECKED.clear()
    _CHECKED[_file_key(file)] = (spec, tok)
    return None


def _load_json_spec(file: Path) -> tuple[dict, Tokenizer | None]:
    """tokenizer.json's content, and the tokenizer it makes where `check_tokenizer_json` loaded it."""
    checked = _CHECKED.pop(_file_key(file), None)
    return checked if checked is not None else (json.loads(file.read_text(encoding="utf-8")), None)


class Fallback(Exception):
    """This folder's tokenizer is not one `build_tokenizer` makes: transformers makes it."""


def json_object(p: Path) -> dict:
    return json.loads(p.read_text(encoding="utf-8")) if p.is_file() else {}


def _class_name(name: str) -> str:
    """tokenizer_class_from_name for the names we know, as the class's __name__."""
    base = name.removesuffix("Fast")
    if name in GENERIC or base in GENERIC:
        return "TokenizersBackend"
    if base in REBUILT:
        return base
    raise Fallback(f"tokenizer class {name}")


def choose_class(folder: Path, tc: dict, cfg: dict) -> str:
    """The class AutoTokenizer.from_pretrained picks (models/auto/tokenization_auto.py, its from_pretrained)."""
    if "auto_map" in tc:
        raise Fallback("auto_map (remote code)")
    mt = cfg.get("model_type") or ""          # no config.json: PreTrainedConfig, model_type ""
    if any(fnmatch.fnmatch(str(folder).lower(), p) for p in MODEL_IDS_TO_TOKENIZERS_BACKEND):
        return "TokenizersBackend"
    mistral_common = importlib.util.find_spec("mistral_common") is not None
    reg = MAPPING.get(mt)
    if reg == "MistralCommonBackend" and not mistral_common:
        reg = "TokenizersBackend"
    if mt in INCORRECT:
        reg = INCORRECT_MAPPED.get(mt, reg or "TokenizersBackend")
    if reg == "MistralCommonBackend" and (folder / "tekken.json").exists():
        raise Fallback("mistral-common + tekken.json")
    if mt == "":
        reg = "TokenizersBackend"                 # ~L1005: TOKENIZER_MAPPING.get(PreTrainedConfig, TokenizersBackend)
    hub = tc.get("tokenizer_class") or cfg.get("tokenizer_class")
    if hub is not None and hub.removesuffix("Fast") == "LlamaTokenizer" and reg != "MistralCommonBackend" \
            and mt not in INCORRECT and '"ByteLevel"' in (folder / "tokenizer.json").read_text(encoding="utf-8"):
        return "TokenizersBackend"                                   # ~L843-862
    if hub is not None and mt != "":
        if reg is None:                                              # model_type unknown to our table
            if _class_name(hub) == "TokenizersBackend":
                return "TokenizersBackend"                           # any outcome of ~L867-915 is TokenizersBackend
            raise Fallback(f"model_type {mt} with {hub}")
        if reg and reg.removesuffix("Fast") != hub.removesuffix("Fast"):   # ~L867-915
            if reg not in ("TokenizersBackend", "MistralCommonBackend"):
                cls = _class_name(reg if mt in INCORRECT else hub)
                if cls != "TokenizersBackend":
                    return cls
            return "TokenizersBackend"
    if tc.get("tokenizer_class"):                                    # ~L975-985
        return _class_name(tc["tokenizer_class"])
    if cfg.get("tokenizer_class"):                                   # ~L986-991
        return _class_name(cfg["tokenizer_class"])
    if reg is None:
        raise Fallback(f"model_type {mt} unknown here")
    return _class_name(reg) if reg and reg != "MistralCommonBackend" else "TokenizersBackend"   # ~L1005-1013


def _to_added(v: Any) -> Any:
    """convert_added_tokens(save=False): {"__type": "AddedToken", ...} -> AddedToken, recursively."""
    if isinstance(v, dict) and v.get("__type") == "AddedToken":
        return AddedToken(**{k: x for k, x in v.items() if k != "__type"})
    if isinstance(v, (list, tuple)):
        return [_to_added(x) for x in v]
    if isinstance(v, dict):
        return {k: _to_added(x) for k, x in v.items()}
    return v


def _kwargs(folder: Path, tc: dict, spec: dict, defaults: dict) -> dict:
    """The special and added tokens TokenizersBackend.__init__ sees (tokenization_utils_base._from_pretrained)."""
    init = dict(tc)
    init.pop("tokenizer_class", None)
    init.pop("add_bos_token", None)          # dropped whenever tokenizer.json exists
    init.pop("add_eos_token", None)
    if "additional_special_tokens" in init and not init.get("extra_special_tokens"):
        init["extra_special_tokens"] = init.pop("additional_special_tokens")
    model_specific = {k: init.pop(k) for k in list(init) if k not in STD and k.endswith("_token")
                      and isinstance(init[k], str)}
    if isinstance(init.get("extra_special_tokens"), dict):
        model_specific.update(init.pop("extra_special_tokens"))
    added = _added_tokens(folder, init, spec, model_specific)
    added_map = {str(t): t for t in added.values()}
    init = _to_added(init)
    for key in STD:
        if key in init and added_map and init[key] is not None:
            init[key] = added_map.get(str(init[key]), init[key])
    for key, value in defaults.items():            # the class __init__'s defaults
        init.setdefault(key, value)
    if "pad_token" not in init and spec.get("padding"):   # TokenizersBackend.__init__: the json padding's token
        init["pad_token"] = spec["padding"]["pad_token"]
    if "additional_special_tokens" in init and "extra_special_tokens" not in init:   # PreTrainedTokenizerBase
        init["extra_special_tokens"] = init.pop("additional_special_tokens")
    special, extra = _special_tokens(init, model_specific)
    return {"special": special, "extra": extra, "added": added, "init": init}


def _added_tokens(folder: Path, init: dict, spec: dict, model_specific: dict) -> dict[int, AddedToken]:
    """The added tokens by id: tokenizer_config's added_tokens_decoder, else tokenizer.json's (and then
    special_tokens_map.json overrides tokenizer_config's named tokens, in `init`)."""
    added: dict[int, AddedToken] = {}
    if "added_tokens_decoder" in init:
        for idx, t in init["added_tokens_decoder"].items():
            added[int(idx)] = AddedToken(**t) if isinstance(t, dict) else t
        return added
    for key, value in json_object(folder / "special_tokens_map.json").items():
        if isinstance(value, dict) and key != "extra_special_tokens":
            value = AddedToken(**{k: x for k, x in value.items() if k != "special"}, special=True)
        elif key == "extra_special_tokens" and isinstance(value, list):
            existing = list(init.get("extra_special_tokens") or [])
            for tok in value:
                tok = AddedToken(**tok, special=True) if isinstance(tok, dict) else tok
                if tok not in existing:
                    existing.append(tok)
            value = existing
        init[key] = value
    if isinstance(init.get("extra_special_tokens"), dict):
        model_specific.update(init.pop("extra_special_tokens"))
    if (folder / "added_tokens.json").is_file():
        raise Fallback("added_tokens.json")      # a rare legacy file: not mirrored
    for t in spec.get("added_tokens", []):
        t = dict(t)
        idx = t.pop("id")
        added[idx] = AddedToken(**t)
    return added


def _special_tokens(init: dict, model_specific: dict) -> tuple[dict[str, Any], list[Any]]:
    """(the named special tokens, the extra ones) as PreTrainedTokenizerBase.__init__ keeps them."""
    special: dict[str, Any] = {}
    for key in STD:
        v = init.get(key)
        if v is None:
            continue
        if not isinstance(v, (str, AddedToken)):
            raise Fallback(f"{key} is {type(v).__name__}")
        special[key] = v
    extra = init.get("extra_special_tokens") or []
    if isinstance(extra, dict):
        model_specific = {**model_specific, **extra}
        extra = []
    auto = {k: v for k, v in init.items() if k not in STD and k.endswith("_token") and isinstance(v, (str, AddedToken))}
    special.update({**auto, **model_specific})
    for v in list(special.values()) + list(extra):
        if not isinstance(v, (str, AddedToken)):
            raise Fallback("a special token that is neither text nor an AddedToken")
    return special, list(extra)


def _rebuild(cls: str, spec: dict, init: dict) -> Tokenizer:
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        raise Fallback("rebuild needs a BPE tokenizer.json")
    merges = []
    for m in model.get("merges", []):
        m = tuple(m.split(" ")) if isinstance(m, str) else tuple(m)
        if len(m) != 2:
            raise Fallback("odd merge")
        merges.append(m)
    vocab = model["vocab"]
    aps = init.get("add_prefix_space")
    if cls == "LlamaTokenizer":
        aps = True if aps is None else aps
        scheme = ("first" if not init.get("legacy", False) else "always") if aps else "never"
        tok = Tokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True, dropout=None))
        tok.normalizer = None
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme, split=False)
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
                                        + ([decoders.Strip(content=" ", left=1)] if aps else []))
    elif cls == "Qwen2Tokenizer":
        tok = Tokenizer(BPE(vocab=vocab, merges=merges, dropout=None, unk_token=None, continuing_subword_prefix="",
                            end_of_word_suffix="", fuse_unk=False, byte_fallback=False))
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=bool(aps), use_regex=False)])
        tok.decoder = decoders.ByteLevel()
    elif cls == "GemmaTokenizer":
        tok = Tokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=True, unk_token=str(init.get("unk_token")),
                            dropout=None, byte_fallback=True))
        tok.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
        tok.normalizer = normalizers.Replace(" ", "▁")
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    elif cls == "GPT2Tokenizer":
        tok = Tokenizer(BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                            end_of_word_suffix="", fuse_unk=False))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=bool(aps))
        tok.decoder = decoders.ByteLevel()
    elif cls == "GPTNeoXTokenizer":
        tok = Tokenizer(BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                            end_of_word_suffix="", fuse_unk=False))
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=bool(aps),
                                                     trim_offsets=init.get("trim_offsets", True))
        tok.decoder = decoders.ByteLevel()
    else:
        raise Fallback(cls)
    # the post-processor comes from tokenizer.json
    minimal = dict(spec, model={**model, "vocab": {}, "merges": []}, added_tokens=[])
    tok.post_processor = Tokenizer.from_str(json.dumps(minimal)).post_processor
    if cls == "GPTNeoXTokenizer":    # its __init__ calls update_post_processor(): add_bos/eos_token were popped
        tok.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1", special_tokens=[])
    return tok


def _validated() -> bool:
    import importlib.metadata

    try:
        parts = importlib.metadata.version("transformers").split(".")
        version = (int(parts[0]), int(parts[1]))
    except (importlib.metadata.PackageNotFoundError, ValueError, IndexError):
        return False
    return VALIDATED[0] <= version <= VALIDATED[1]


def build_tokenizer(folder: str | os.PathLike) -> Tokenizer:
    """The `tokenizers.Tokenizer` that transformers' `AutoTokenizer.from_pretrained(folder)` holds (its
    `backend_tokenizer`: the same ids for any text), made without importing transformers; raises
    `Fallback` where this does not know how transformers would make it."""
    folder = Path(folder)
    if not _validated():
        raise Fallback("transformers' version is not one this mirrors")
    if not (folder / "tokenizer.json").is_file():
        raise Fallback("no tokenizer.json")
    tc, cfg = json_object(folder / "tokenizer_config.json"), json_object(folder / "config.json")
    for key in ("fast_tokenizer_files", "fix_mistral_regex", "gguf_file"):
        if tc.get(key):
            raise Fallback(key)
    cls = choose_class(folder, tc, cfg)
    spec, loaded = _load_json_spec(folder / "tokenizer.json")
    kw = _kwargs(folder, tc, spec, REBUILT.get(cls, {}))
    if cls == "TokenizersBackend":
        tok = loaded if loaded is not None else Tokenizer.from_file(str(folder / "tokenizer.json"))
    else:
        tok = _rebuild(cls, spec, kw["init"])
    # TokenizersBackend.__init__: added_tokens_decoder, then the named and extra special tokens not there yet
    to_add = [t for _, t in sorted(kw["added"].items())]
    present = [tok.get_added_tokens_decoder()[i].content for i in sorted(tok.get_added_tokens_decoder())]
    present += [str(t) for t in to_add]
    for v in list(kw["special"].values()) + kw["extra"]:
        if str(v) not in present and v not in to_add:
            to_add.append(v)
    named = [str(t) for t in kw["special"].values() if t]
    final = []
    for t in to_add:
        if isinstance(t, str):
            t = AddedToken(t, special=True)
        elif not t.special and str(t) in named:
            t.special = True
        final.append(t)
    if final:
        tok.add_tokens(final)
    if cls == "Qwen2Tokenizer":      # the last line of Qwen2Tokenizer.__init__
        seen = list(dict.fromkeys([str(v) for v in kw["special"].values()] + [str(t) for t in kw["extra"]]))
        tok.add_tokens([AddedToken(s, special=True) for s in seen])
    tok.encode_special_tokens = bool(kw["init"].get("split_special_tokens", False))
    tok.no_truncation()
    tok.no_padding()
    # no post-processor: update_post_processor() makes a template that adds nothing (add_bos/eos_token popped)
    if tok.post_processor is None:
        tok.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1", special_tokens=[])
    return tok
