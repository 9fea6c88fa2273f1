"""A model folder's tokenizer, without importing transformers where that can be helped.

Importing transformers takes seconds (it imports torch; on some machines over ten), and a run that
only scores needs nothing but token ids. `build_tokenizer` makes the `tokenizers.Tokenizer` that
transformers' AutoTokenizer would hold (the same ids for every text) from the folder's files, and
`TextDecoder` decodes generated text and stop strings with it as transformers' `decode` would (the same
text for every id sequence); grammars and chat templates use the transformers tokenizer itself, made on
first use (`LazyTokenizer`).
"""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from lmbatch.model.tokenizer_build import Fallback, build_tokenizer, json_object

# what a tokenizer is made of: AutoTokenizer needs at least one of these (tokenizer_config.json names
# the class; the others hold the vocabulary of fast, GPT-2, SentencePiece or WordPiece tokenizers)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model")


def has_tokenizer(folder: str | Path) -> bool:
    return any((Path(folder) / f).is_file() for f in TOKENIZER_FILES)


def load_hf_tokenizer(folder: str | Path) -> Any:
    """`AutoTokenizer.from_pretrained(folder)`, imported under lmbatch.IMPORT_LOCK (see there)."""
    import lmbatch

    with lmbatch.IMPORT_LOCK:
        from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(folder))


class LazyTokenizer:
    """Stands for a folder's transformers tokenizer and makes it on first use: attributes are the
    tokenizer's (`eos_token_id`, ...); `get()` is the tokenizer itself, for code that checks its type
    (xgrammar). `decode` is transformers' `decode`, done by a `TextDecoder` where `build_tokenizer`
    makes the folder's tokenizer: text is decoded without importing transformers (seconds)."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self._tokenizer: Any = None
        self._lock = threading.Lock()
        self._decoder: TextDecoder | None = None
        self._no_decoder = False        # build_tokenizer does not make this folder's: transformers decodes

    def use_decoder(self, tokenizer: Tokenizer | None) -> None:
        """Decode with `tokenizer`: the one `build_tokenizer` made of this folder (a run's encoder has it);
        None: `build_tokenizer` does not make it (Fallback), transformers decodes."""
        with self._lock:
            self._decoder = None if tokenizer is None else TextDecoder.of(self.folder, tokenizer)
            self._no_decoder = tokenizer is None

    def decoder(self) -> TextDecoder | None:
        """The folder's `TextDecoder`, made now if need be (None: transformers decodes this folder's text)."""
        with self._lock:
            if self._decoder is None and not self._no_decoder:
                try:
                    self._decoder = TextDecoder.of(self.folder, build_tokenizer(self.folder))
                except Fallback:
                    self._no_decoder = True
            return self._decoder

    def ready_to_decode(self) -> None:
        """Make what `decode` needs now (a run that generates, on the model's thread: not in its first step)."""
        if self.decoder() is None:
            self.get()

    def decode(self, ids: Any, skip_special_tokens: bool = False, **kwargs: Any) -> Any:
        """transformers' `decode(ids, skip_special_tokens, clean_up_tokenization_spaces=...)`."""
        decoder = self.decoder()
        batched = isinstance(ids, (list, tuple)) and len(ids) > 0 and isinstance(ids[0], (list, tuple))
        if decoder is None or batched or set(kwargs) - {"clean_up_tokenization_spaces"}:
            return self.get().decode(ids, skip_special_tokens=skip_special_tokens, **kwargs)
        return decoder.decode(ids, skip_special_tokens, kwargs.get("clean_up_tokenization_spaces"))

    @classmethod
    def of(cls, folder: str | Path) -> LazyTokenizer | None:
        """None where the folder has no tokenizer files (a bare checkpoint: no text is decoded)."""
        return cls(folder) if has_tokenizer(folder) else None

    @property
    def loaded(self) -> bool:
        return self._tokenizer is not None

    def get(self) -> Any:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = load_hf_tokenizer(self.folder)
            return self._tokenizer

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.get(), name)


def real_tokenizer(tokenizer: Any) -> Any:
    """The transformers tokenizer itself, where `tokenizer` may stand for it (`LazyTokenizer`)."""
    return tokenizer.get() if isinstance(tokenizer, LazyTokenizer) else tokenizer


# ---- decoding as transformers does, without transformers -------------------------------------------------
def clean_up_tokenization(text: str) -> str:
    """transformers' `PreTrainedTokenizerBase.clean_up_tokenization` (spaces before punctuation and
    contractions dropped)."""
    return (text.replace(" .", ".").replace(" ?", "?").replace(" !", "!").replace(" ,", ",").replace(" ' ", "'")
            .replace(" n't", "n't").replace(" 'm", "'m").replace(" 's", "'s").replace(" 've", "'ve")
            .replace(" 're", "'re"))


class TextDecoder:
    """transformers' `tokenizer.decode(ids, skip_special_tokens=..., clean_up_tokenization_spaces=...)`
    for a folder whose tokenizer `build_tokenizer` makes: the classes it makes (TokenizersBackend and the
    rebuilt ones) decode with their `tokenizers.Tokenizer` and then, where clean_up_tokenization_spaces is
    set (tokenizer_config.json; False by default), clean the text up unless the model is BPE (transformers
    5 skips the clean-up for BPE unless told to corrupt the text anyway). tests/unit/test_tokenizer_decode.py
    compares it with transformers' decode on every family's tokenizer."""

    def __init__(self, tokenizer: Tokenizer, clean_up: bool, clean_up_bpe: bool = False):
        self.tokenizer = tokenizer
        self.clean_up = clean_up
        # transformers' clean-up applies to this model type (always where not BPE)
        self.cleans = clean_up_bpe or type(tokenizer.model).__name__ != "BPE"
        self._pieces: list[str] | None = None      # each token's text alone
        self._holding: dict[frozenset[str], frozenset[int]] = {}

    @classmethod
    def of(cls, folder: str | Path, tokenizer: Tokenizer) -> TextDecoder:
        """The decoder of `folder`, whose tokenizer `build_tokenizer` made (`tokenizer`)."""
        tc = json_object(Path(folder) / "tokenizer_config.json")
        return cls(tokenizer, bool(tc.get("clean_up_tokenization_spaces", False)),
                   bool(tc.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)))

    def decode(self, ids: Any, skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool | None = None) -> str:
        if hasattr(ids, "tolist"):        # a tensor or an array, as transformers' to_py_obj takes them
            ids = ids.tolist()
        if isinstance(ids, int):
            ids = [ids]
        text = self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)
        clean = self.clean_up if clean_up_tokenization_spaces is None else clean_up_tokenization_spaces
        return clean_up_tokenization(text) if clean and self.cleans else text

    def tokens_holding(self, chars: frozenset[str]) -> frozenset[int] | None:
        """The token ids whose text alone holds one of `chars`: a text that gains one of them where tokens
        are appended gains it in one of those tokens, for a character of ASCII but the space and no clean-up
        (a byte of its own in every tokenizer, decoded where it stands). None where that does not hold: a
        space (a decoder may strip one at the text's start), a character beyond ASCII (split over tokens),
        or the clean-up (it drops a space as later text decides)."""
        if not chars or (self.clean_up and self.cleans) or any(not c.isascii() or c == " " or len(c) != 1
                                                                for c in chars):
            return None
        held = self._holding.get(chars)
        if held is None:
            if self._pieces is None:
                vocab = self.tokenizer.get_vocab_size(with_added_tokens=True)
                self._pieces = self.tokenizer.decode_batch([[i] for i in range(vocab)], skip_special_tokens=False)
            held = self._holding[chars] = frozenset(i for i, p in enumerate(self._pieces) if any(c in p for c in chars))
        return held
