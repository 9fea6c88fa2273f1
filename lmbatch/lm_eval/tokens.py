"""lm-eval's requests as token ids, as its HF backend makes them (`TemplateLM._encode_pair`, `tok_encode`),
made in bulk: from each text's end, each distinct segment once (`frontend.tokenize`'s cut rule, where it
holds for the tokenizer), else each distinct whole text once, in batches, by the fast tokenizer; and the
name of a call's entry in the workload cache (the requests' text, the options that shape their ids)."""
from __future__ import annotations

import hashlib
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Literal, Sequence

from lmbatch.frontend.tokenize import TextEncoder
from lmbatch.requests import ScoreRequest

# the steps of transformers' batch call on a fast tokenizer (4.x and 5.x): a class that overrides none of
# them encodes a batch with its `tokenizers.Tokenizer`'s `encode_batch` and nothing else
_CALL_STEPS = ("__call__", "_call_one", "_encode_plus", "_batch_encode_plus", "encode_plus", "batch_encode_plus")


def _batch_backend(tokenizer: Any) -> Any | None:
    """`tokenizer`'s own `tokenizers.Tokenizer` where transformers' batch call gives exactly its
    `encode_batch` ids: a fast tokenizer whose class overrides no step of the call, with no truncation,
    padding or splitting of special tokens set. Its `encode_batch_fast` gives the same ids without
    character offsets, in about half the time (H100 host, 2026-11-26: 68k MMLU texts, 6.1 s against
    transformers' 11.4 s). None otherwise."""
    from transformers import PreTrainedTokenizerFast

    backend: Any = getattr(tokenizer, "_tokenizer", None)
    if not isinstance(tokenizer, PreTrainedTokenizerFast) or not hasattr(backend, "encode_batch_fast"):
        return None
    if any(getattr(type(tokenizer), name, None) is not getattr(PreTrainedTokenizerFast, name, None)
           for name in _CALL_STEPS):
        return None
    if backend.truncation is not None or backend.padding is not None or backend.encode_special_tokens or \
            getattr(tokenizer, "split_special_tokens", False):
        return None
    return backend


@contextmanager
def _threads() -> Iterator[None]:
    """The tokenizer's own threads on for a batch call: lm-eval's CLI turns them off for the whole run
    (TOKENIZERS_PARALLELISM=false, against fork deadlocks), and nothing forks during these calls."""
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "true"
    try:
        yield
    finally:
        if before is None:
            del os.environ["TOKENIZERS_PARALLELISM"]
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = before


class PairTokenizer:
    """The backend's tokenization: `tokenizer` (a transformers fast tokenizer), `add_bos_token` and
    `prefix_token_id` as lm-eval's model args give them, pairs cut to `max_length` + 1 tokens."""

    def __init__(self, tokenizer: Any, add_bos_token: bool | None, prefix_token_id: int | None, max_length: int):
        self.tokenizer, self.add_bos_token, self.max_length = tokenizer, add_bos_token, max_length
        self._segments: tuple[TextEncoder, dict[bool, list[int]]] | None | Literal[False] = False  # False: unknown
        self.custom_prefix_token_id = prefix_token_id
        self.prefix_text = str(tokenizer.decode(self.prefix_token_id))

    @property
    def prefix_token_id(self) -> int:
        """What an empty context is replaced by: the custom prefix, else BOS, else EOS."""
        if self.custom_prefix_token_id is not None:
            return self.custom_prefix_token_id
        bos = self.tokenizer.bos_token_id
        return int(bos if bos is not None else self.tokenizer.eos_token_id)

    def flags(self, string: str, add_special_tokens: bool | None) -> dict[str, bool]:
        """Special tokens as asked, else per `add_bos_token`, else the tokenizer's default, but never a
        second BOS in front of a string that starts with the prefix token's text."""
        flags: dict[str, bool] = {}
        if add_special_tokens is not None:
            flags["add_special_tokens"] = add_special_tokens
        elif self.add_bos_token is not None:
            flags["add_special_tokens"] = self.add_bos_token
        if add_special_tokens is None and string.startswith(self.prefix_text):
            flags["add_special_tokens"] = False
        return flags

    def encode(self, string: str, add_special_tokens: bool | None = None) -> list[int]:
        return list(self.tokenizer.encode(string, **self.flags(string, add_special_tokens)))

    def encode_many(self, strings: dict[tuple[str, bool | None], list[int]]) -> None:
        """Fills `strings` ((text, add_special_tokens) -> ids, as `encode` gives them): the texts of
        one set of flags go to the fast tokenizer as one batch (encoded in parallel, each text once),
        to its own `tokenizers.Tokenizer` where that gives the same ids (`_batch_backend`, and the
        first 16 texts encoded both ways agree), else through transformers' call."""
        groups: dict[tuple[tuple[str, bool], ...], list[tuple[str, bool | None]]] = {}
        for key in strings:
            groups.setdefault(tuple(sorted(self.flags(*key).items())), []).append(key)
        backend: Any = _batch_backend(self.tokenizer)
        with _threads():
            for flags, keys in groups.items():
                texts = [k[0] for k in keys]
                special = dict(flags).get("add_special_tokens", True)
                fast = backend is not None and \
                    [e.ids for e in backend.encode_batch_fast(texts[:16], add_special_tokens=special)] == \
                    self.tokenizer(texts[:16], **dict(flags))["input_ids"]
                for start in range(0, len(keys), 4096):
                    chunk = texts[start:start + 4096]
                    ids = [e.ids for e in backend.encode_batch_fast(chunk, add_special_tokens=special)] if fast \
                        else self.tokenizer(chunk, **dict(flags))["input_ids"]
                    strings.update(zip(keys[start:start + 4096], ids))

    def _by_segments(self) -> tuple[TextEncoder, dict[bool, list[int]]] | None:
        """The tokenizer as a `TextEncoder` that tokenizes only a whole text's end (its cut rule holds
        for this tokenizer), with what special tokens add before a text's ids either way (nothing after
        them); None where that does not hold (the whole texts are encoded then)."""
        if self._segments is False:
            self._segments = None
            backend: Any = _batch_backend(self.tokenizer)
            encoder = None if backend is None else TextEncoder(backend, self.tokenizer)
            if encoder is not None and encoder.splittable:
                prefix = {special: list(backend.encode("", add_special_tokens=special).ids)
                          for special in (True, False)}
                probes = ("a", "Question: 2 + 2?\nAnswer: 4", " x\n\n y")
                if all(backend.encode(t, add_special_tokens=special).ids ==
                       prefix[special] + backend.encode(t, add_special_tokens=False).ids
                       for t in probes for special in (True, False)):
                    self._segments = (encoder, prefix)
        return None if self._segments is False else self._segments

    def _segment_pairs(self, pairs: Sequence[tuple[str, str]]) -> dict[int, tuple[list[int], list[int]]]:
        """`_encode_pair`'s ids of the pairs the segment path takes (`_by_segments`): a non-empty context
        whose whole text gets the special tokens it gets (lm-eval decides them by the text's start); each
        distinct context and its continuations tokenized as `TextEncoder.encode_choices` does, whose ids
        are those of the whole texts split at the context's length. By pair index."""
        fast = self._by_segments()
        if fast is None:
            return {}
        encoder, prefix = fast
        groups: dict[bool, dict[str, list[int]]] = {}
        for i, (context, continuation) in enumerate(pairs):
            head = context.rstrip()
            if not head:
                continue
            special = self.flags(head, None).get("add_special_tokens", True)
            if special != self.flags(context + continuation, None).get("add_special_tokens", True):
                continue
            groups.setdefault(special, {}).setdefault(context, []).append(i)
        out: dict[int, tuple[list[int], list[int]]] = {}
        for special, contexts in groups.items():
            todo = list(contexts.items())
            with _threads():
                encoded = encoder.encode_choices([(context, [pairs[i][1] for i in at]) for context, at in todo])
            for (_, at), (ctx, conts) in zip(todo, encoded):
                ids = prefix[special] + ctx
                out.update((i, (ids, cont)) for i, cont in zip(at, conts))
        return out

    def score_requests(self, pairs: Sequence[tuple[str, str]]) -> list[ScoreRequest]:
        """Each (context, continuation) pair's request: `_encode_pair`'s ids (trailing spaces of the
        context moved to the continuation, the whole text encoded and split at the context's length; an
        empty context replaced by the prefix token), cut as `cut` does. Where the tokenizer allows it
        (`_by_segments`), only each text's end is tokenized, each distinct segment once."""
        known = self._segment_pairs(pairs)
        encoded: dict[tuple[str, bool | None], list[int]] = {}
        texts: list[tuple[str, str | None, str]] = []
        for k, (context, continuation) in enumerate(pairs):
            if k in known:
                texts.append(("", None, ""))        # (its ids are known)
                continue
            if context == "":
                encoded[(continuation, False)] = []
                texts.append((continuation, None, ""))
                continue
            n_spaces = len(context) - len(context.rstrip())
            head, whole = context[:-n_spaces] if n_spaces else context, context + continuation
            encoded[(head, None)] = encoded[(whole, None)] = []
            texts.append((continuation, head, whole))
        self.encode_many(encoded)
        ids = []
        for k, (continuation, maybe_head, whole) in enumerate(texts):
            if k in known:
                ctx, cont = known[k]
            elif maybe_head is None:
                cont = encoded[(continuation, False)]
                ctx, cont = ([self.prefix_token_id], cont) if self.prefix_token_id != cont[0] else (cont[:1], cont[1:])
            else:
                ctx = encoded[(maybe_head, None)]
                cont = encoded[(whole, None)][len(ctx):]
            ids.append((ctx, cont))
        return self.cut(ids)

    def cut(self, pairs: Sequence[tuple[list[int], list[int]]]) -> list[ScoreRequest]:
        """A pair longer than max_length + 1 tokens keeps its last max_length + 1 (the context is cut
        on the left, never below one token)."""
        reqs = []
        for context, continuation in pairs:
            if len(context) + len(continuation) <= self.max_length + 1:
                reqs.append(ScoreRequest(context, continuation))    # uncut: a context shared stays one list
                continue
            whole = (context + continuation)[-(self.max_length + 1):]
            cut = max(len(whole) - len(continuation), 1)
            reqs.append(ScoreRequest(whole[:cut], whole[cut:]))
        return reqs

    def cache_key(self, pairs: Sequence[tuple[str, str]], schedule: str, model_dir: Path) -> str:
        """The workload cache's name for these pairs' requests and plan on this model: their text, the
        tokenization options, the schedule."""
        from lmbatch.caches import workloads as workload_cache

        h = hashlib.sha256()
        for context, continuation in pairs:
            c, k = context.encode(), continuation.encode()
            h.update(len(c).to_bytes(8, "little") + c + len(k).to_bytes(8, "little") + k)
        options = {"kind": "lm-eval loglikelihood", "requests": h.hexdigest(), "add_bos_token": self.add_bos_token,
                   "prefix_token_id": self.prefix_token_id, "max_length": self.max_length, "schedule": schedule}
        return workload_cache.key(options, [], model_dir)
