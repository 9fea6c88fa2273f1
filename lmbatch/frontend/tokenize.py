r"""Prompt text to token ids, fast and exactly as the tokenizer (and lm-eval) would produce them.

A batch's prompts repeat most of their text: the few-shot examples of every question of a subject,
a question's context in each of its choices. `TextEncoder` tokenizes each distinct *segment* once
and joins the segments' ids, with the `tokenizers` library directly (no per-text conversion in
transformers).

Where a text may be cut. The byte-level BPE tokenizers this is used with (GPT-2's and
Llama-3/Qwen2's pre-tokenizer patterns) first split a text into pre-tokens by a regex, then merge
bytes only within a pre-token. Two kinds of position always end a pre-token, whatever follows:
- c where text[c-1] is a newline and text[c] an ASCII letter or digit ("line" cuts). No pattern
  carries a newline into a letter, digit or punctuation match, and the whitespace matches stop at
  the first non-space. Only the split *inside* a whitespace run before c depends on what follows
  (`\s+(?!\S)` keeps the last newline apart when a non-space follows, takes it at the end of the
  text), so a segment that a cut ends is tokenized with one letter appended, whose single token is
  dropped.
- c where text[c-1] is not whitespace and text[c:c+2] is a space then an ASCII letter or digit
  (used where a continuation meets its context, and to cut a new segment into words, each distinct
  word tokenized once). Letter, digit and punctuation matches stop at a
  space, and the match at c (" word") takes its leading space from text[c] alone.
A pre-token starting at c is decided by text[c:] alone, since no pattern takes a newline or a
non-space into the start of a letter match. So tokens(a + b) == tokens(a) + tokens(b) at such a cut.
`TextEncoder` cuts only for tokenizers whose normalizer and pre-tokenizer are of those kinds and
none of whose added tokens holds a newline; any other tokenizer encodes whole texts (still each
distinct text once). Tests compare the result with whole-text tokenization on every MMLU and
HellaSwag prompt and on random texts.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import re
from pathlib import Path
from typing import Any, Iterable, Sequence, TypeAlias

# a line cut: after a newline, before an ASCII letter or digit (found by its newline: a pattern that starts
# with a lookbehind is tried at every position, several times slower on long prompts)
_CUT = re.compile(r"\n(?=[A-Za-z0-9])")
# a space cut (where the ids of the text before it and after it join to those of the whole)
_WORD_CUT = re.compile(r"(?<=\S)(?= [A-Za-z0-9])")
_ALNUM = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789")
_FOLLOW = "A"       # appended to a segment that a line cut ends; its one token is dropped
_SAFE_NORMALIZERS = (None, "NFC")
# a text to encode: ids of its start known already (a list of its own), its segments ended by line cuts, its last
Parts: TypeAlias = tuple[list[int], list[str], list[str]]


def choice_texts(context: str, continuations: Sequence[str]) -> tuple[str, list[str]]:
    """The texts lm-eval's `_encode_pair` encodes for a context and its continuations: the context
    without its trailing whitespace (which moves onto each continuation) and each whole text."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces > 0:
        continuations = [context[-n_spaces:] + c for c in continuations]
        context = context[:-n_spaces]
    return context, [context + c for c in continuations]


def split_choices(ctx: list[int], wholes: list[list[int]]) -> tuple[list[int], list[list[int]]]:
    """lm-eval's split: the context's ids, and each whole's ids past the context's length."""
    if not ctx:
        raise ValueError("empty context: lm-eval would use a prefix token here, lmbatch does not")
    return list(ctx), [list(w[len(ctx):]) for w in wholes]


def _splittable(spec: dict) -> bool:
    """Whether the tokenizer.json describes a tokenizer for which the cut rule above holds."""
    norm = spec.get("normalizer")
    if (norm or {}).get("type") not in _SAFE_NORMALIZERS:
        return False
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    kinds = [s.get("type") for s in steps]
    if kinds == ["ByteLevel"]:
        byte_level = steps[0]
        if not byte_level.get("use_regex", True):
            return False
    elif kinds == ["Split", "ByteLevel"]:
        split, byte_level = steps
        pattern = (split.get("pattern") or {}).get("Regex", "")
        # Llama-3 / Qwen2's pattern: letters take one leading non-newline char, punctuation takes
        # trailing newlines; checked as the known pattern rather than trusted in general
        if "[^\\r\\n\\p{L}\\p{N}]?\\p{L}+" not in pattern or split.get("behavior") != "Isolated" \
                or byte_level.get("use_regex", True):
            return False
    else:
        return False
    if byte_level.get("add_prefix_space", False):
        return False
    if (spec.get("model") or {}).get("type") != "BPE":
        return False
    return not any("\n" in t.get("content", "") for t in spec.get("added_tokens", []))


_CACHED_TOKENIZERS = 32


def tokenizer_cache_file(model_dir: Path) -> Path:
    """Where the tokenizer AutoTokenizer makes of this folder is cached: keyed by the folder's path
    (AutoTokenizer consults it), its files other than weights, and the versions of transformers and
    tokenizers, which together decide what AutoTokenizer builds."""
    from lmbatch.cache import cache_dir
    from lmbatch.model.identity import WEIGHT_SUFFIXES

    h = hashlib.sha256(str(model_dir.resolve()).encode())
    for lib in ("transformers", "tokenizers"):
        h.update(f"\0{lib}={importlib.metadata.version(lib)}".encode())
    for f in sorted(model_dir.iterdir()):
        if f.is_file() and not f.name.endswith(WEIGHT_SUFFIXES):
            h.update(b"\0" + f.name.encode() + b"\0" + f.read_bytes())
    return cache_dir() / "tokenizers" / f"{h.hexdigest()[:40]}.json"


class KnownPrefixes:
    """Token ids of texts encoded lately, up to each one's last line cut. A program's next call's text
    begins with its last one's (the last prompt, its output, more), so it takes those ids and only its
    rest is split and joined (a text's segments up to a cut are the same in any text they begin). Kept
    for the last two rounds (`next_round`: each wave's calls): about a wave's texts, no more. Off until the
    first round starts (the interpreter's calls): a caller that encodes texts of one kind (lm-eval's
    requests) neither keeps them nor looks them up."""

    TRIES = 4           # a text's line cuts looked up, from its end
    MOST = 1 << 15      # entries a round holds before it counts as ended

    def __init__(self) -> None:
        self.on = False
        self.now: dict[str, tuple[list[int], int]] = {}
        self.last: dict[str, tuple[list[int], int]] = {}

    def next_round(self) -> None:
        self.on = True
        if self.now:
            self.last, self.now = self.now, {}

    def find(self, text: str) -> tuple[list[int], int] | None:
        """(ids of text[:c], c) for the last of text's line cuts c that some text ended at, or None."""
        if not (self.now or self.last):
            return None
        end, tries = len(text), 0
        while tries < self.TRIES:
            c = text.rfind("\n", 0, end) + 1
            if c == 0:
                return None
            if c < len(text) and text[c] in _ALNUM:
                tries += 1
                hit = self.now.get(text[:c]) or self.last.get(text[:c])
                if hit is not None:
                    return hit[0][:hit[1]], c
            end = c - 1
        return None

    def add(self, text: str, cut: int, ids: list[int], k: int) -> None:
        """`ids[:k]` are text[:cut]'s (cut: its last line cut; `ids` are only read)."""
        if cut > 0 and self.on:
            if len(self.now) >= self.MOST:
                self.next_round()
            self.now[text[:cut]] = (ids, k)


class TextEncoder:
    """Token ids of many texts (no special tokens added), each distinct segment tokenized once.

    A text is held as (segments each ended by a line cut, segments ended by a space cut or by the
    text's end); the two kinds are tokenized differently (see the module's docstring), so they have
    a memo each, kept across calls (a run's later waves reuse the few-shot segments)."""

    def __init__(self, tokenizer: Any, hf: Any = None):
        """`tokenizer`: a `tokenizers.Tokenizer`; `hf`: the transformers tokenizer it belongs to
        (decoding, stop strings, grammars, chat templates), or a `LazyTokenizer` that makes it on first use."""
        self.tokenizer = tokenizer
        self.spec = tokenizer.to_str()
        spec = json.loads(self.spec)
        self.splittable = _splittable(spec)
        self.hf_source = hf             # what an engine holds for decoding (transformers' made only where needed)
        self._cut: dict[str, list[int]] = {}
        self._end: dict[str, list[int]] = {}
        self._bos: list[int] | None = None
        # pieces of new segments cut at space cuts (a word cut needs no added token to hold a space)
        self.word_cuts = self.splittable and not any(" " in t.get("content", "") for t in spec.get("added_tokens", []))
        self._words: dict[str, list[int]] = {}
        self._last_cut: dict[str, list[int]] = {}       # the last pieces of segments a line cut ends
        self.prefixes = KnownPrefixes()

    @property
    def hf(self) -> Any:
        """The transformers tokenizer (made now if it stood for one)."""
        from lmbatch.model.tokenizer import real_tokenizer

        return real_tokenizer(self.hf_source)

    @classmethod
    def for_model(cls, model_dir: str | Path) -> "TextEncoder":
        """The tokenizer transformers' `AutoTokenizer` makes of the folder, as lm-eval uses it: not
        necessarily the folder's tokenizer.json as it stands, since transformers may rebuild parts of it
        for the model's type (a qwen2 folder gets Qwen2's pre-tokenizer whatever its tokenizer.json says).

        `model.tokenizer_build.build_tokenizer` makes it without importing transformers (seconds); where it
        cannot, transformers makes it and what it made is cached (`tokenizer_cache_file`), so that later
        runs load it with `tokenizers` alone. The transformers tokenizer itself (`hf`) is made on first use."""
        from lmbatch.cache import atomic_write
        from lmbatch.model.checkpoint import check_tokenizer_files
        from lmbatch.model.tokenizer import LazyTokenizer
        from lmbatch.model.tokenizer_build import Fallback, build_tokenizer

        model_dir = Path(model_dir)
        check_tokenizer_files(model_dir)
        lazy = LazyTokenizer(model_dir)
        try:
            built = build_tokenizer(model_dir)
        except Fallback:
            lazy.use_decoder(None)      # transformers decodes too
        else:
            lazy.use_decoder(built)     # generated text is decoded without transformers (shared: both only read it)
            return cls(built, lazy)
        cached = tokenizer_cache_file(model_dir)
        if cached.is_file():
            from tokenizers import Tokenizer

            try:
                return cls(Tokenizer.from_file(str(cached)), lazy)
            except Exception:  # noqa: BLE001  a damaged entry is made again below
                pass
        enc = cls.from_hf(lazy.get())
        enc.hf_source = lazy
        try:
            cached.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(cached, enc.spec)
            entries = sorted(cached.parent.glob("*.json"), key=lambda f: f.stat().st_mtime)
            for old in entries[:-_CACHED_TOKENIZERS]:      # the least recently made go
                old.unlink(missing_ok=True)
        except OSError:      # a read-only cache: every run builds it
            pass
        return enc

    @classmethod
    def from_hf(cls, hf: Any) -> "TextEncoder":
        """A transformers fast tokenizer's own Rust tokenizer."""
        backend = getattr(hf, "backend_tokenizer", None)
        if backend is None:
            from lmbatch.errors import UserError
            raise UserError(f"{type(hf).__name__} is not a fast tokenizer; lmbatch needs a tokenizer.json")
        return cls(backend, hf)

    def _tokenize(self, memo: dict[str, list[int]], segments: Iterable[str], follow: str = "") -> None:
        """Tokenize the segments memo lacks; with `follow`, each with that letter after it, whose token is
        then dropped. Where the tokenizer allows it, a new segment is cut further at its space cuts (before
        each " word": the module's docstring) and each distinct piece is tokenized once: a batch's texts
        repeat their words far more than their lines (HellaSwag's endings, OLMES's lettered options),
        and looking a word up is many times faster than tokenizing it again."""
        new = [s for s in dict.fromkeys(segments) if s not in memo]
        if not new:
            return
        if not self.word_cuts:
            self._tokenize_whole(memo, new, follow)
            return
        pieces = [_WORD_CUT.split(s) for s in new]
        last = self._last_cut if follow else self._words        # a segment's last piece keeps `follow`
        self._tokenize_whole(self._words, [w for ps in pieces for w in ps[:-1] if w not in self._words])
        self._tokenize_whole(last, [ps[-1] for ps in pieces if ps[-1] not in last], follow)
        words = self._words
        for seg, ps in zip(new, pieces):
            ids: list[int] = []
            for w in ps[:-1]:
                ids += words[w]
            memo[seg] = ids + last[ps[-1]]

    def _tokenize_whole(self, memo: dict[str, list[int]], segments: list[str], follow: str = "") -> None:
        """Tokenize each of `segments` (a distinct text each, or repeated: once) in one multi-threaded call."""
        new = list(dict.fromkeys(segments))
        if not new:
            return
        batch = getattr(self.tokenizer, "encode_batch_fast", self.tokenizer.encode_batch)
        follow_id = self.tokenizer.token_to_id(follow) if follow else None
        for seg, enc in zip(new, batch([s + follow for s in new], add_special_tokens=False)):
            ids = enc.ids
            if follow:
                if ids[-1] != follow_id:
                    raise RuntimeError(f"the tokenizer merged across a line cut after {seg[-40:]!r}")
                ids = ids[:-1]
            memo[seg] = ids

    def _split(self, text: str) -> tuple[list[str], list[str]]:
        if not self.splittable:
            return [], [text]
        if "\n" not in text:       # most continuations
            return [], [text]
        cut, start = [], 0
        for m in _CUT.finditer(text):
            cut.append(text[start:m.end()])
            start = m.end()
        return cut, [text[start:]]

    def _parts(self, text: str) -> Parts:
        """A text as (ids of its start known already, its other segments ended by a line cut, its last)."""
        hit = self.prefixes.find(text) if self.splittable else None
        if hit is None:
            return [], *self._split(text)
        return hit[0], *self._split(text[hit[1]:])

    def _join(self, parts: list[Parts]) -> list[list[int]]:
        self._tokenize(self._cut, (s for _, cut, _ in parts for s in cut), _FOLLOW)
        self._tokenize(self._end, (s for _, _, end in parts for s in end))
        out = []
        for ids, cut, end in parts:     # ids: a list of this part's own
            for s in cut:
                ids += self._cut[s]
            for s in end:
                ids += self._end[s]
            out.append(ids)
        return out

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        """Ids of each text, equal to tokenizing it whole."""
        parts = [self._parts(t) for t in texts]
        out = self._join(parts)
        if self.splittable:
            for t, (_, _, end), ids in zip(texts, parts, out):
                self.prefixes.add(t, len(t) - len(end[0]), ids, len(ids) - len(self._end[end[0]]))
        return out

    def encode_choices(self, pairs: Sequence[tuple[str, Sequence[str]]]) -> list[tuple[list[int], list[list[int]]]]:
        """lm-eval's `_encode_pair` for each (context, continuations): the context's ids and each
        continuation's, the whole text encoded and split at the context's length.

        Only the end of a whole text is tokenized: a continuation " word..." after a context ending
        in a non-space alone (a space cut); otherwise the context's last segment with the
        continuation (a whole text has the context's line cuts up to there, since a cut depends on
        two characters). The ids up to that segment are the context's own."""
        tails: list[Parts]
        contexts, tails, whole_tail, texts = [], [], [], []     # whole_tail: a tail from the context's last segment
        for context, conts in pairs:
            ctx, wholes = choice_texts(context, conts)
            head, cut, end = self._parts(ctx)
            contexts.append((head, cut, end))
            texts.append(ctx)
            last = len(ctx) - len(end[0])
            space_cut = self.splittable and bool(ctx) and not ctx[-1].isspace()
            for w in wholes:
                cont = w[len(ctx):]
                if space_cut and len(cont) > 1 and cont[0] == " " and cont[1] in _ALNUM:
                    tails.append(([], [], [cont]))
                    whole_tail.append(False)
                else:
                    tails.append(([], *self._split(w[last:])))
                    whole_tail.append(True)
        ctx_ids = self._join(contexts)
        tail_ids = self._join(tails)
        out, k = [], 0
        for (_, conts), ids, (_, _, end), ctx in zip(pairs, ctx_ids, contexts, texts):
            if not ids:
                raise ValueError("empty context: lm-eval would use a prefix token here, lmbatch does not")
            keep = len(ids) - len(self._end[end[0]])     # the context's ids before its last segment
            if self.splittable:
                self.prefixes.add(ctx, len(ctx) - len(end[0]), ids, keep)
            out.append((ids, [tail_ids[j][len(ids) - keep:] if whole_tail[j] else tail_ids[j]
                              for j in range(k, k + len(conts))]))
            k += len(conts)
        return out

    @property
    def bos_prefix(self) -> list[int]:
        """The ids the tokenizer puts before a text when it adds special tokens: a BOS for tokenizers that
        add one (Llama's, Gemma's), none for GPT-2-style ones (SmolLM2's, OLMo's, Qwen's)."""
        if self._bos is None:
            whole = self.tokenizer.encode("a", add_special_tokens=True).ids
            plain = self.tokenizer.encode("a", add_special_tokens=False).ids
            at = next((i for i in range(len(whole) - len(plain) + 1) if whole[i:i + len(plain)] == plain), 0)
            self._bos = list(whole[:at])
        return self._bos

    def encode_separate(self, pairs: Sequence[tuple[str, Sequence[str]]]) -> list[tuple[list[int], list[list[int]]]]:
        """OLMo's evaluator's (olmo_eval) token ids for each (context, continuations): the context and each
        continuation encoded on their own, no EOS, `bos_prefix` before the context. Unlike `encode_choices`,
        the context's ids are the same whatever follows, and a continuation's whatever precedes it."""
        contexts = self.encode([c for c, _ in pairs])
        conts = self.encode([x for _, xs in pairs for x in xs])
        out, k = [], 0
        for ctx, (_, xs) in zip(contexts, pairs):
            ids = self.bos_prefix + ctx
            if not ids or not all(conts[k:k + len(xs)]):
                raise ValueError("empty context (with no BOS to stand for it) or empty continuation")
            out.append((ids, conts[k:k + len(xs)]))
            k += len(xs)
        return out

    def clear(self) -> None:
        """Forget memoized segments."""
        for memo in (self._cut, self._end, self._words, self._last_cut):
            memo.clear()
        self.prefixes = KnownPrefixes()

