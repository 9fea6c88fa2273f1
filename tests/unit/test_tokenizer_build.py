"""`build_tokenizer` (lmbatch/model/tokenizer.py) makes, without importing transformers, the tokenizer that
`AutoTokenizer.from_pretrained(folder)` holds: the same ids for every text, with and without special tokens.

Why this needs a test of its own: transformers 5 does not load a folder's tokenizer.json as it stands. It picks
a class from tokenizer_config.json and config.json, and some classes (Qwen2Tokenizer, LlamaTokenizer,
GemmaTokenizer, GPT2Tokenizer, GPTNeoXTokenizer) rebuild the tokenizer from the vocabulary and merges with
their own normalizer and pre-tokenizer; it then adds special and added tokens with flags taken from several
files. `build_tokenizer` mirrors those rules, so it is right only where it picks the same class and the same
tokens. Here small tokenizers are trained for each family (byte-level BPE with and without Qwen2's regex,
SentencePiece-style BPE with byte fallback in Llama's and Gemma's layouts) and put in folders that send
AutoTokenizer down every path build_tokenizer mirrors: as-is TokenizersBackend, each rebuilt class, the
class overrides by model_type, special-token and added-token variants. For each folder (and for the
project's own test tokenizer and the embedded model's) the ids of a few hundred varied texts must equal
AutoTokenizer's; the class build_tokenizer picks must be AutoTokenizer's; and for folders where loading
tokenizer.json as it stands gives other ids, that is checked too, so these tests fail when the rules are
not followed. Folders build_tokenizer does not know how to make must raise `Fallback` (transformers then
makes the tokenizer), as must any transformers version outside `VALIDATED`; and build_tokenizer must not
import transformers (importing it takes seconds).
"""
from __future__ import annotations

import importlib.metadata
import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from lmbatch.model import tokenizer_build as tokmod
from lmbatch.model.checkpoint import resolve_model
from lmbatch.model.tokenizer_build import Fallback, build_tokenizer, choose_class

REPO = Path(__file__).resolve().parents[2]
QWEN_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


# ---- small trained tokenizers ---------------------------------------------------------------------------
def corpus() -> list[str]:
    rng = random.Random(1)
    words = ("the of and to in is was for on that with as by at from city river population landmark name answer "
             "question true false yes no capital country north south museum park bridge tower one two three four "
             "five because which what who where when how many number Hello World don't it's we're café naïve résumé "
             "Zürich über straße déjà vu").split()
    lines = []
    for _ in range(1500):
        s = " ".join(rng.choice(words) for _ in range(rng.randint(3, 14)))
        if rng.random() < 0.3:
            s += f" {rng.randint(0, 10**6)}"
        if rng.random() < 0.2:
            s = s.upper()
        lines.append(s.capitalize() + rng.choice(".?!:,;") + rng.choice(["", "\n", "\n\n", "  "]))
    lines += [f'{{"name": "{rng.choice(words)}", "n": {rng.randint(0, 999)}}}\n' for _ in range(100)]
    lines += ["def f(x):\n    return x + 1\n", "\tindent\ttabs\n", "a  b   c    d"] * 10
    return lines


def byte_level(regex: str | None, nfc: bool, specials_in_model: bool) -> dict:
    """A byte-level BPE tokenizer.json: Qwen2's layout (regex Split + ByteLevel, NFC, special tokens added after
    the vocabulary) or GPT-2's (ByteLevel with its own regex, special tokens the first ids of the vocabulary)."""
    tok = Tokenizer(models.BPE())
    if regex:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(regex), behavior="isolated"),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1200, special_tokens=list(QWEN_SPECIALS) if specials_in_model else [],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus(), trainer)
    if not specials_in_model:
        tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in QWEN_SPECIALS])
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return json.loads(tok.to_str())


def sentencepiece_like() -> dict[str, dict]:
    """SentencePiece-style BPE tokenizer.jsons with byte fallback, trained once: "llama" (Prepend + Replace
    normalizer, no pre-tokenizer, "<s>" template), "gemma2" (Replace normalizer, no pre-tokenizer) and
    "gemma3" (with a Split(" ") pre-tokenizer), both with Gemma's special tokens first and a "<bos>" template."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    tok.train_from_iterator(corpus(), trainers.BpeTrainer(vocab_size=1000, show_progress=False, limit_alphabet=200))
    trained = json.loads(tok.to_str())["model"]
    out = {}
    for kind in ("llama", "gemma2", "gemma3"):
        specials = ["<unk>", "<s>", "</s>"] if kind == "llama" else ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
        vocab = {t: i for i, t in enumerate(specials + [f"<0x{i:02X}>" for i in range(256)])}
        for t, _ in sorted(trained["vocab"].items(), key=lambda kv: kv[1]):
            vocab.setdefault(t, len(vocab))
        bos = "<s>" if kind == "llama" else "<bos>"
        spec = {
            "version": "1.0", "truncation": None, "padding": None,
            "added_tokens": [{"id": vocab[s], "content": s, "single_word": False, "lstrip": False, "rstrip": False,
                              "normalized": False, "special": True} for s in specials],
            "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
            "pre_tokenizer": None,
            "post_processor": {
                "type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                         {"SpecialToken": {"id": bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {bos: {"id": bos, "ids": [vocab[bos]], "tokens": [bos]}}},
            "decoder": {"type": "Sequence", "decoders": [
                {"type": "Replace", "pattern": {"String": "▁"}, "content": " "}, {"type": "ByteFallback"},
                {"type": "Fuse"}] + ([{"type": "Strip", "content": " ", "start": 1, "stop": 0}]
                                     if kind == "llama" else [])},
            "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                      "vocab": vocab, "merges": trained["merges"]},
        }
        if kind == "llama":
            spec["normalizer"] = {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "▁"},
                                                                      dict(spec["normalizer"])]}
        if kind == "gemma3":
            spec["pre_tokenizer"] = {"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious",
                                     "invert": False}
        Tokenizer.from_str(json.dumps(spec))  # valid
        out[kind] = spec
    return out


def source_specs() -> dict[str, dict]:
    """The tokenizer.jsons the folders use, by name; "qwen_gap": Qwen's with an id gap before <|im_end|>,
    "qwen_trunc": Qwen's with truncation and padding saved in it."""
    qwen = byte_level(QWEN_RE, nfc=True, specials_in_model=False)
    specs = {"qwen": qwen, "gpt2": byte_level(None, nfc=False, specials_in_model=True), **sentencepiece_like()}
    gap = json.loads(json.dumps(qwen))
    for t in gap["added_tokens"]:
        if t["content"] == "<|im_end|>":
            t["id"] += 5
    specs["qwen_gap"] = gap
    specs["qwen_trunc"] = {**qwen, "truncation": {"direction": "Right", "max_length": 8, "strategy": "LongestFirst",
                                                  "stride": 0},
                           "padding": {"strategy": {"Fixed": 64}, "direction": "Right", "pad_to_multiple_of": None,
                                       "pad_id": 0, "pad_type_id": 0, "pad_token": "<|endoftext|>"}}
    return specs


# ---- the folders -----------------------------------------------------------------------------------------
def added_decoder(spec: dict) -> dict:
    """tokenizer_config.json's added_tokens_decoder, as save_pretrained writes it, from tokenizer.json's."""
    return {str(t["id"]): {k: t[k] for k in ("content", "lstrip", "normalized", "rstrip", "single_word", "special")}
            for t in spec["added_tokens"]}


def odd_flags(decoder: dict) -> dict:
    """added_tokens_decoder with other flags than tokenizer.json's (transformers takes these)."""
    for v in decoder.values():
        if v["content"] == "<|im_end|>":
            v.update(lstrip=True, rstrip=True)
        if v["content"] == "<|im_start|>":
            v.update(normalized=True, special=False, single_word=True)
    return decoder


def write_folder(path: Path, spec: dict, tc: dict, model_type: str | None, stm: dict | None = None,
                 decoder: str | None = None) -> Path:
    """A tokenizer folder: tokenizer.json, tokenizer_config.json (decoder "plain": with added_tokens_decoder;
    "odd": with other flags), config.json (none where model_type is None), special_tokens_map.json."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False), encoding="utf-8")
    tc = dict(tc)
    if decoder:
        tc["added_tokens_decoder"] = odd_flags(added_decoder(spec)) if decoder == "odd" else added_decoder(spec)
    (path / "tokenizer_config.json").write_text(json.dumps(tc, indent=1))
    if model_type is not None:
        (path / "config.json").write_text(json.dumps({"model_type": model_type, "architectures": ["X"]}))
    if stm is not None:
        (path / "special_tokens_map.json").write_text(json.dumps(stm, indent=1))
    return path


QTC = {"tokenizer_class": "Qwen2Tokenizer", "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
       "unk_token": None, "errors": "replace", "split_special_tokens": False, "add_prefix_space": False,
       "additional_special_tokens": ["<|im_start|>", "<|im_end|>"]}
LTC = {"tokenizer_class": "LlamaTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
       "add_bos_token": True, "add_eos_token": False, "legacy": False, "pad_token": None}
GTC = {"tokenizer_class": "GemmaTokenizer", "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
       "unk_token": "<unk>", "add_bos_token": True, "add_eos_token": False,
       "additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]}
PTTF = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>"}
AS_IS = "TokenizersBackend"

# name: (tokenizer.json, tokenizer_config.json, config.json's model_type, the class AutoTokenizer picks, extras)
RECIPES: dict[str, tuple[str, dict, str | None, str, dict]] = {
    # tokenizer.json as it stands
    "pttf_llama_qwenjson": ("qwen", PTTF, "llama", AS_IS, {}),
    "pttf_noconfig_gpt2json": ("gpt2", {**PTTF, "bos_token": "<|im_start|>"}, None, AS_IS, {}),
    "pttf_llama_spjson": ("llama", {**PTTF, "bos_token": "<s>", "eos_token": "</s>"}, "llama", AS_IS, {}),
    "noclass_llama_spjson": ("llama", {"bos_token": "<s>"}, "llama", AS_IS, {}),
    "pttf_unknown_type": ("gpt2", PTTF, "foo", AS_IS, {}),
    "pttf_qwen3moe_gpt2json": ("gpt2", PTTF, "qwen3_moe", AS_IS, {}),
    "pttf_gemma2_gemmajson": ("gemma2", {**PTTF, "bos_token": "<bos>", "eos_token": "<eos>"}, "gemma2", AS_IS, {}),
    "llamatok_bytelevel_json": ("qwen", {"tokenizer_class": "LlamaTokenizerFast", "bos_token": "<|im_start|>",
                                         "eos_token": "<|im_end|>"}, "llama", AS_IS, {}),
    "llamatok_mistral_spjson": ("llama", LTC, "mistral", AS_IS, {"decoder": "plain"}),
    "llamatok_internlm2_spjson": ("llama", {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>"}, "internlm2",
                                  AS_IS, {}),
    "olmo2_gpt2tok": ("gpt2", {"tokenizer_class": "GPT2Tokenizer", "bos_token": "<|endoftext|>",
                               "eos_token": "<|endoftext|>", "pad_token": "<|im_end|>"}, "olmo2", AS_IS, {}),
    "phi3_llamatok_new_pad": ("llama", {**LTC, "tokenizer_class": "LlamaTokenizer", "pad_token": "<|endoftext|>"},
                              "phi3", AS_IS, {}),
    "split_special_tokens": ("qwen", {**PTTF, "split_special_tokens": True}, "qwen3", AS_IS, {}),
    "new_named_specials": ("gpt2", {**PTTF, "bos_token": "<BOS>", "mask_token": "<mask>", "image_token": "<image>",
                                    "additional_special_tokens": ["<extra_0>", "<|im_start|>"]}, "llama", AS_IS, {}),
    "added_decoder_flags": ("qwen", PTTF, "llama", AS_IS, {"decoder": "odd"}),
    "addedtoken_dict_bos": ("gpt2", {**PTTF, "bos_token": {"__type": "AddedToken", "content": "<NEWBOS>",
                                                           "lstrip": True, "rstrip": False, "normalized": False,
                                                           "single_word": False, "special": True}}, "llama", AS_IS, {}),
    "pttf_id_gap": ("qwen_gap", PTTF, "llama", AS_IS, {}),
    "pttf_trunc_pad": ("qwen_trunc", PTTF, "llama", AS_IS, {}),
    # rebuilt from the vocabulary and merges by the class
    "qwen2_qwenjson": ("qwen", QTC, "qwen2", "Qwen2Tokenizer", {"decoder": "plain"}),
    "qwen2_pttf_gpt2json": ("gpt2", PTTF, "qwen2", "Qwen2Tokenizer", {}),
    "qwen3_qwen2tok_gpt2json": ("gpt2", QTC, "qwen3", "Qwen2Tokenizer", {}),
    "qwen2_noconfig": ("qwen", QTC, None, "Qwen2Tokenizer", {}),
    "qwen2_noclass_stm": ("qwen", {"eos_token": "<|im_end|>"}, "qwen2", "Qwen2Tokenizer",
                          {"stm": {"eos_token": {"content": "<|im_end|>", "lstrip": False, "normalized": False,
                                                 "rstrip": False, "single_word": False},
                                   "pad_token": "<|endoftext|>",
                                   "additional_special_tokens": ["<|im_start|>", "<|im_end|>"]}}),
    "qwen2_flags": ("qwen", {"tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|im_end|>",
                             "additional_special_tokens": ["<|im_start|>"]}, "qwen2", "Qwen2Tokenizer",
                    {"decoder": "odd"}),
    "qwen2_id_gap": ("qwen_gap", {"tokenizer_class": "Qwen2Tokenizer"}, "qwen2", "Qwen2Tokenizer", {}),
    "qwen2_trunc_pad": ("qwen_trunc", {"tokenizer_class": "Qwen2Tokenizer"}, "qwen2", "Qwen2Tokenizer", {}),
    "llama_legacy_false": ("llama", LTC, "llama", "LlamaTokenizer", {"decoder": "plain"}),
    "llama_legacy_true": ("llama", {**LTC, "tokenizer_class": "LlamaTokenizer", "legacy": True}, "llama",
                          "LlamaTokenizer", {}),
    "llama_no_prefix_space": ("llama", {**LTC, "add_prefix_space": False}, "llama", "LlamaTokenizer", {}),
    "llamatok_qwen3_spjson": ("llama", LTC, "qwen3", "LlamaTokenizer", {}),
    "llamatok_gemma2json": ("gemma2", {**LTC, "bos_token": "<bos>", "eos_token": "<eos>"}, "gemma2",
                            "LlamaTokenizer", {}),
    "llamatok_gemmajson_legacy_true": ("gemma2", {"tokenizer_class": "LlamaTokenizer", "legacy": True,
                                                  "bos_token": "<bos>", "unk_token": "<unk>"}, "llama",
                                       "LlamaTokenizer", {}),
    "gemma2_gemmatok": ("gemma2", GTC, "gemma2", "GemmaTokenizer", {}),
    "gemma3_gemmatokfast": ("gemma3", {**GTC, "tokenizer_class": "GemmaTokenizerFast",
                                       "boi_token": "<start_of_image>"}, "gemma3_text", "GemmaTokenizer",
                            {"decoder": "plain"}),
    "gemma2_noclass": ("gemma2", {}, "gemma2", "GemmaTokenizer", {}),
    "gpt2_gpt2tok": ("gpt2", {"tokenizer_class": "GPT2Tokenizer", "add_prefix_space": False}, "gpt2",
                     "GPT2Tokenizer", {}),
    "gpt2_add_prefix_space": ("gpt2", {"tokenizer_class": "GPT2Tokenizer", "add_prefix_space": True}, "gpt2",
                              "GPT2Tokenizer", {}),
    "gpt2tokfast_llama_qwenjson": ("qwen", {"tokenizer_class": "GPT2TokenizerFast", "eos_token": "<|im_end|>"},
                                   "llama", "GPT2Tokenizer", {}),
    "olmo_gptneox": ("gpt2", {"tokenizer_class": "GPTNeoXTokenizer"}, "olmo", "GPTNeoXTokenizer", {}),
}
# folders where tokenizer.json loaded as it stands gives other ids than AutoTokenizer's
PLAIN_DIFFERS = ["qwen2_pttf_gpt2json", "gemma2_gemmatok", "llama_legacy_false", "phi3_llamatok_new_pad"]


@pytest.fixture(scope="session")
def specs() -> dict[str, dict]:
    return source_specs()


@pytest.fixture(scope="session")
def folders(specs, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tokenizer_folders")
    out = {}
    for name, (src, tc, model_type, _, extra) in RECIPES.items():
        out[name] = write_folder(root / name, specs[src], tc, model_type, **extra)
    return out


# ---- texts -----------------------------------------------------------------------------------------------
SPECIAL_STRS = ["<s>", "</s>", "<unk>", "<bos>", "<eos>", "<pad>", "<mask>", "<|endoftext|>", "<|im_start|>",
                "<|im_end|>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<BOS>", "<NEWBOS>", "<image>",
                "<extra_0>", "<|padding|>", "<0x41>", "▁"]


def texts(n: int = 300, seed: int = 0) -> list[str]:
    """Fixed edge cases, then random mixes of words, whitespace runs, digits, unicode (NFC and NFD forms of
    the same letters, full-width forms, emoji with modifiers) and special-token strings."""
    rng = random.Random(seed)
    pieces = ["Hello", "world", "don't", "DON'T", "We'RE", "it's", "café", "cafe\u0301", "naïve", "nai\u0308ve",
              "Zürich", "Zu\u0308rich", "Å", "A\u030a", "straße", "日本語のテキスト", "中文", "😀", "👍🏽", "émoji🎉",
              "Ω≈ç√", "ﬁ", "１２３", "123", "4567890", "3.14159", "$100", "(x)", "{\"a\": 1}", "def f(x):", "return",
              "<div>", "a_b", "tab\there", "\t", "\n", "\n\n", "\r\n", " ", "  ", "   ", "    ", "!!!", "...", "?",
              "--", "’", "“quoted”", "x\u200by", "\u00a0", "the", "population", "Answer:", "B", "1 + 2 = ",
              "\u3000", "ŉ", "İstanbul", "ǅ"]
    out = ["", " ", "  ", "\n", " \n ", "\t", "a", " a", "  a", "\na", "Hello world", " Hello world",
           "Hello  world ", "<s>Hello", "Hello</s>", "<s> Hello", " <s>",
           "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", " <|im_end|> ", "<|im_start|> x",
           "<bos><start_of_turn>user\nHi<end_of_turn>\n", "x<mask>y", "a <pad> b", "1234567", "<BOS>z",
           "<image><image>", " <NEWBOS> a", "e\u0301\u0301", "ＡＢＣ", "\u2028", "a\u0000b", "café cafe\u0301"]
    while len(out) < n:
        parts = []
        for _ in range(rng.randint(1, 12)):
            r = rng.random()
            if r < 0.08:
                parts.append(rng.choice(SPECIAL_STRS))
            elif r < 0.2:
                parts.append(rng.choice([" ", "  ", "\n", "\t", "\n\n", "   \n"]))
            else:
                parts.append(rng.choice(pieces))
            if rng.random() < 0.6:
                parts.append(" ")
        s = "".join(parts)
        out.append(" " + s if rng.random() < 0.3 else s)
    return out


TEXTS = texts()


# ---- comparing -------------------------------------------------------------------------------------------
def auto_tokenizer(folder: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def first_difference(tok: Tokenizer, hf, texts_: list[str], special: bool) -> str | None:
    """None where `tok` gives AutoTokenizer's ids for every text, else the first text that differs."""
    for t in texts_:
        mine, ref = tok.encode(t, add_special_tokens=special).ids, hf.encode(t, add_special_tokens=special)
        if mine != ref:
            return f"add_special_tokens={special}, text {t!r}:\n  build_tokenizer {mine}\n  AutoTokenizer   {ref}"
    return None


def assert_same_ids(folder: Path, expected_class: str | None = None):
    hf = auto_tokenizer(folder)
    if expected_class is not None:
        assert type(hf).__name__ == expected_class, "the recipe no longer sends AutoTokenizer down this path"
    tok = build_tokenizer(folder)
    assert (diff := first_difference(tok, hf, TEXTS, special=False)) is None, diff
    assert (diff := first_difference(tok, hf, TEXTS[:80], special=True)) is None, diff
    return tok, hf


@pytest.mark.parametrize("name", list(RECIPES))
def test_same_ids_as_auto_tokenizer(name, folders):
    folder = folders[name]
    expected = RECIPES[name][3]
    tc = json.loads((folder / "tokenizer_config.json").read_text())
    cfg = json.loads((folder / "config.json").read_text()) if (folder / "config.json").is_file() else {}
    assert choose_class(folder, tc, cfg) == expected
    assert_same_ids(folder, expected)


def test_small_test_tokenizer(tmp_path):
    """tests/conftest.py's tokenizer as saved (no config.json), and under a llama and a qwen2 config.json (the
    latter rebuilt with Qwen2's pre-tokenizer)."""
    from conftest import make_small_tokenizer

    make_small_tokenizer(tmp_path / "plain")
    assert_same_ids(tmp_path / "plain", AS_IS)
    for model_type, cls in (("llama", AS_IS), ("qwen2", "Qwen2Tokenizer")):
        shutil.copytree(tmp_path / "plain", tmp_path / model_type)
        (tmp_path / model_type / "config.json").write_text(json.dumps({"model_type": model_type}))
        assert_same_ids(tmp_path / model_type, cls)


def test_tiny_tok_folder(tiny_tok):
    assert_same_ids(tiny_tok)


def test_embedded_model():
    assert_same_ids(resolve_model(None))


@pytest.mark.parametrize("name", PLAIN_DIFFERS)
def test_plain_tokenizer_json_differs(name, folders):
    """Loading tokenizer.json as it stands is not enough here: build_tokenizer's work shows (its ids are
    AutoTokenizer's, by test_same_ids_as_auto_tokenizer)."""
    plain = Tokenizer.from_file(str(folders[name] / "tokenizer.json"))
    hf = auto_tokenizer(folders[name])
    assert first_difference(plain, hf, TEXTS, special=False) is not None


def test_digits_qwen2_over_gpt2_json(folders):
    """One difference spelled out: Qwen2's pre-tokenizer splits digits one by one, GPT-2's keeps runs."""
    folder = folders["qwen2_pttf_gpt2json"]
    plain, built = Tokenizer.from_file(str(folder / "tokenizer.json")), build_tokenizer(folder)
    assert len(built.encode("1234567", add_special_tokens=False).ids) == 7
    assert len(plain.encode("1234567", add_special_tokens=False).ids) < 7


# ---- Fallback --------------------------------------------------------------------------------------------
def copy_folder(src: Path, dst: Path, **tc_update) -> Path:
    shutil.copytree(src, dst)
    tc = json.loads((dst / "tokenizer_config.json").read_text())
    (dst / "tokenizer_config.json").write_text(json.dumps({**tc, **tc_update}))
    return dst


def test_fallback_without_tokenizer_json(folders, tmp_path):
    folder = copy_folder(folders["qwen2_qwenjson"], tmp_path / "f")
    (folder / "tokenizer.json").unlink()
    with pytest.raises(Fallback):
        build_tokenizer(folder)


def test_fallback_with_auto_map(folders, tmp_path):
    folder = copy_folder(folders["pttf_llama_qwenjson"], tmp_path / "f",
                         auto_map={"AutoTokenizer": ["tok.MyTokenizer", None]})
    with pytest.raises(Fallback, match="auto_map"):
        build_tokenizer(folder)


def test_fallback_other_cases(folders, tmp_path):
    """A rebuilt class under a model_type this does not know; a legacy added_tokens.json."""
    unknown = copy_folder(folders["pttf_unknown_type"], tmp_path / "unknown", tokenizer_class="Qwen2Tokenizer")
    with pytest.raises(Fallback):
        build_tokenizer(unknown)
    legacy = copy_folder(folders["pttf_llama_qwenjson"], tmp_path / "legacy")
    (legacy / "added_tokens.json").write_text(json.dumps({"<new>": 2000}))
    with pytest.raises(Fallback):
        build_tokenizer(legacy)


def fake_transformers_version(monkeypatch, version: str | None):
    real = importlib.metadata.version

    def version_of(name: str) -> str:
        if name != "transformers":
            return real(name)
        if version is None:
            raise importlib.metadata.PackageNotFoundError(name)
        return version

    monkeypatch.setattr(importlib.metadata, "version", version_of)


@pytest.mark.parametrize("version", ["4.57.3", "5.25.0", "6.0.0", "five", None])
def test_fallback_for_unvalidated_transformers(version, folders, monkeypatch):
    fake_transformers_version(monkeypatch, version)
    with pytest.raises(Fallback, match="version"):
        build_tokenizer(folders["pttf_llama_qwenjson"])


def test_validated_versions_build(folders, monkeypatch):
    low, high = tokmod.VALIDATED
    assert low <= tuple(int(x) for x in importlib.metadata.version("transformers").split(".")[:2]) <= high, \
        "the installed transformers is not one build_tokenizer mirrors: check these tests pass, then widen VALIDATED"
    for version in (f"{low[0]}.{low[1]}.0", f"{high[0]}.{high[1]}.9"):
        fake_transformers_version(monkeypatch, version)
        build_tokenizer(folders["pttf_llama_qwenjson"])


# ---- no transformers -------------------------------------------------------------------------------------
def test_does_not_import_transformers(folders):
    """In a fresh interpreter: an as-is folder and a rebuilt one, with AutoTokenizer's ids."""
    names = ["pttf_llama_qwenjson", "qwen2_pttf_gpt2json"]
    code = ("import json, sys\n"
            "from lmbatch.model.tokenizer_build import build_tokenizer\n"
            "ids = [build_tokenizer(f).encode(sys.argv[1], add_special_tokens=False).ids for f in sys.argv[2:]]\n"
            "print(json.dumps({'transformers': 'transformers' in sys.modules, 'ids': ids}))\n")
    text = "Hello 1234567 <|im_end|>\n"
    run = subprocess.run([sys.executable, "-c", code, text, *(str(folders[n]) for n in names)], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    assert result["transformers"] is False
    assert result["ids"] == [auto_tokenizer(folders[n]).encode(text, add_special_tokens=False) for n in names]
