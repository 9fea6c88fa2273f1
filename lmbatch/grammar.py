"""Constrained decoding over xgrammar: regex / JSON-schema / EBNF grammars, one matcher per request.

A `GrammarCompiler` is built once per run and compiles each distinct constraint once; each generation
request gets its own `Constraint`. Per decode step: `fill_mask` the request's row of a CPU bitmask,
`apply_mask` it to the logits (on their device), sample, `accept` the token. Where the grammar forces
the next characters, `jump_forward` returns them and `retokenize_jump` appends them without decoding.
"""
from __future__ import annotations

import json
import re
from typing import Any, Literal, cast

import numpy as np
import torch
import xgrammar as xgr

# Compact JSON: no free whitespace, no spaces after separators ('{"name":"Paris","population":null}').
JSON_SEPARATORS = (",", ":")
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (?:Check failed: \(.*?\) is false: )?")


def _one_line(err: Exception) -> str:
    """xgrammar's error text without its log prefix, on one line."""
    return " ".join(_LOG_PREFIX.sub("", str(err).strip()).split())


def _schema_text(schema: str | dict[str, Any]) -> str:
    """The schema as compact JSON (the cache key). Keys keep their order: it is the order of the
    generated properties. A string that is not JSON is kept as it is, for xgrammar to reject."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError:
            return cast(str, schema)    # still the string: json.loads raised
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)


# UTF-8 (RFC 3629) as a byte automaton. xgrammar 0.2.8 admits ill-formed UTF-8 inside a character
# class: the overlong 3- and 4-byte forms (E0 80..9F xx, F0 80..8F xx xx) and surrogates (ED A0..BF xx).
# Each decodes to several U+FFFD, so a bounded string overruns its bound. A constraint therefore
# also rejects, and masks out, the tokens that would make its text ill-formed.
# States: 0 between characters; 1-3 that many continuation bytes to go; 4-7 the restricted second
# byte after E0, ED, F0, F4; 8 ill-formed (absorbing).
_ILL = 8


def _utf8_bytes() -> np.ndarray:
    t = np.full((9, 256), _ILL, dtype=np.int8)
    t[0, :0x80] = 0
    t[0, 0xC2:0xE0] = 1
    t[0, 0xE0], t[0, 0xE1:0xED], t[0, 0xED], t[0, 0xEE:0xF0] = 4, 2, 5, 2
    t[0, 0xF0], t[0, 0xF1:0xF4], t[0, 0xF4] = 6, 3, 7
    for state, after in ((1, 0), (2, 1), (3, 2)):
        t[state, 0x80:0xC0] = after
    t[4, 0xA0:0xC0], t[5, 0x80:0xA0], t[6, 0x90:0xC0], t[7, 0x80:0x90] = 1, 1, 2, 2
    return t


class Utf8Tokens:
    """`next[state, token]`: the UTF-8 state after a token's bytes; `allowed[state]`: a bitmask row
    (xgrammar's layout) of the tokens that keep the text well-formed."""

    def __init__(self, vocab: list[bytes], vocab_size: int):
        step = _utf8_bytes()
        lens = np.array([len(b) for b in vocab])
        buf = np.zeros((len(vocab), max(lens.max(), 1)), dtype=np.uint8)
        flat = np.frombuffer(b"".join(bytes(b) for b in vocab), dtype=np.uint8)
        buf[np.arange(buf.shape[1]) < lens[:, None]] = flat
        state = np.repeat(np.arange(9, dtype=np.int8)[:, None], len(vocab), axis=1)
        for pos in range(buf.shape[1]):
            live = pos < lens
            state[:, live] = step[state[:, live], buf[live, pos]]
        self.next = np.repeat(np.arange(9, dtype=np.int8)[:, None], vocab_size, axis=1)  # ids past the vocab
        self.next[:, :len(vocab)] = state
        words = -(-vocab_size // 32)
        ok = np.zeros((9, words * 32), dtype=np.uint64)
        ok[:, :vocab_size] = self.next != _ILL
        packed = (ok.reshape(9, words, 32) << np.arange(32, dtype=np.uint64)).sum(axis=2)
        self.allowed = packed.astype(np.uint32).view(np.int32)     # numpy: see fill_masks


class GrammarCompiler:
    """Compiles regexes and JSON schemas against one tokenizer, caching by constraint.

    `vocab_size` is the model's (its embedding rows, possibly padded past the tokenizer's length):
    ids the tokenizer lacks are never allowed. With `cache=False` every call compiles again (to
    measure per-request compilation); xgrammar's own cache is off either way, so `compiled_count`
    counts real compilations.
    """

    def __init__(self, tokenizer: Any, vocab_size: int | None = None, *, cache: bool = True,
                 max_threads: int = 8, separators: tuple[str, str] = JSON_SEPARATORS):
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.vocab_size: int = self.info.vocab_size
        self.cache = cache
        self.separators = separators
        self.compiled_count = 0
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=max_threads, cache_enabled=False)
        self._compiled: dict[tuple[str, str], xgr.CompiledGrammar] = {}
        # ids no grammar accepts (padding rows past the tokenizer, special tokens besides the stop
        # token): rejected here, since xgrammar logs a warning for each one it is offered
        self.never = frozenset(self.info.special_token_ids) - frozenset(self.info.stop_token_ids)
        self.utf8 = Utf8Tokens(self.info.decoded_vocab, self.vocab_size)

    def compile(self, regex: str | None = None, json_schema: str | dict[str, Any] | None = None,
                ebnf: str | None = None) -> xgr.CompiledGrammar:
        """The compiled grammar of exactly one of `regex`, `json_schema`, `ebnf` (xgrammar's EBNF
        dialect, GBNF-like, rule `root` first); ValueError if invalid."""
        kind, source = _one_of(regex, json_schema, ebnf)
        key = (kind, _schema_text(source) if kind == "json_schema" else source)
        if self.cache and key in self._compiled:
            return self._compiled[key]
        try:
            if kind == "regex":
                compiled = self._compiler.compile_regex(source)
            elif kind == "ebnf":
                compiled = self._compiler.compile_grammar(source)
            else:
                compiled = self._compiler.compile_json_schema(key[1], any_whitespace=False,
                                                              separators=self.separators)
        except RuntimeError as e:
            what = {"regex": f"regex {regex!r}", "json_schema": "JSON schema", "ebnf": "EBNF grammar"}[kind]
            raise ValueError(f"invalid {what}: {_one_line(e)}") from None
        self.compiled_count += 1
        if self.cache:
            self._compiled[key] = compiled
        return compiled

    def constraint(self, regex: str | None = None, json_schema: str | dict[str, Any] | None = None,
                   ebnf: str | None = None) -> Constraint:
        c = Constraint(self.compile(regex, json_schema, ebnf), self.never, self.utf8)
        c.spec = _one_of(regex, json_schema, ebnf)
        return c


def _one_of(regex: str | None, json_schema: str | dict[str, Any] | None, ebnf: str | None) -> tuple[str, Any]:
    """(kind, source) of the one constraint given."""
    given = [(k, v) for k, v in (("regex", regex), ("json_schema", json_schema), ("ebnf", ebnf)) if v is not None]
    if len(given) != 1:
        raise ValueError("give exactly one of regex, json_schema, ebnf")
    return given[0]


class Constraint:
    """One request's grammar state. The matcher counts one rollback step per accepted token and per
    `accept_string` call (a jump-forward is one such call, whatever its token count)."""

    def __init__(self, compiled: xgr.CompiledGrammar, never: frozenset[int], utf8: Utf8Tokens):
        self.matcher = xgr.GrammarMatcher(compiled)
        # jump_forward(): the longest continuation the grammar forces from here ('' if none), state
        # unchanged. Asked of every grammar row at every step, so bound once (a wrapper call costs as
        # much as the work)
        self.jump_forward = self.matcher.find_jump_forward_string
        self.stops = frozenset(self.matcher.stop_token_ids)    # is_terminated() turns true only after one
        self.never = never
        self.utf8 = utf8
        self.states = [0]           # UTF-8 state after each accepted step (the matcher's rollback unit)
        self.spec: tuple[str, Any] | None = None    # (kind, source): compiled again in another process
        self.steps: list[int | str] = []    # each accepted step (a token id or a string): replayed there

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]` (a CPU tensor)."""
        fill_masks([self], bitmask, [row])

    def well_formed(self, token_id: int) -> int:
        """The UTF-8 state after `token_id`, or -1 if the text would be ill-formed."""
        nxt = int(self.utf8.next[self.states[-1], token_id])
        return -1 if token_id in self.never or nxt == _ILL else nxt

    def accept(self, token_id: int) -> bool:
        """Advance by one token; False (state unchanged) if the grammar does not allow it."""
        nxt = self.well_formed(token_id)
        if nxt < 0 or not self.matcher.accept_token(token_id):
            return False
        self.states.append(nxt)
        self.steps.append(token_id)
        return True

    def is_terminated(self) -> bool:
        """The grammar is complete and the stop token (the tokenizer's EOS) was accepted."""
        return self.matcher.is_terminated()

    def is_completed(self) -> bool:
        """The text so far is a complete match (the stop token may still follow)."""
        return self.matcher.is_completed()

    def forced_stop(self) -> int | None:
        """The stop token, where the grammar is complete and admits nothing else: the end is forced
        too, and jump-forward ends the output without decoding it. None otherwise; state unchanged."""
        if not self.matcher.is_completed():
            return None
        row = _scratch_row(self.utf8.allowed.shape[1])
        self.matcher.fill_next_token_bitmask(row)
        words = row.numpy().view(np.uint32)[0]
        nonzero = np.flatnonzero(words)
        if len(nonzero) != 1:
            return None
        word = int(words[nonzero[0]])
        if word & (word - 1):           # more than one bit: more than one token allowed
            return None
        token = int(nonzero[0]) * 32 + word.bit_length() - 1
        return token if token in self.stops else None

    def accept_string(self, s: str) -> bool:
        """Advance by the characters `s`, as ONE rollback step whatever its token count."""
        if self.states[-1] != 0 or not self.matcher.accept_string(s):
            return False
        self.states.append(0)
        self.steps.append(s)
        return True

    def rollback(self, n: int) -> None:
        """Undo the last `n` steps (tokens)."""
        if n:
            self.matcher.rollback(n)
            del self.states[-n:]
            del self.steps[-n:]


_scratch: dict[int, torch.Tensor] = {}


def _scratch_row(words: int) -> torch.Tensor:
    """A one-row bitmask of `words` int32 words, reused."""
    if words not in _scratch:
        _scratch[words] = torch.zeros((1, words), dtype=torch.int32)
    return _scratch[words]


_batch_matcher: xgr.BatchGrammarMatcher | None = None
BATCH_FILL_MIN = 64


def fill_masks(constraints: list[Constraint], bitmask: torch.Tensor, rows: list[int] | None = None) -> None:
    """`fill_mask` of constraint i into row `rows[i]` (default: row i) of `bitmask`; many rows on
    xgrammar's thread pool (a batch call costs about a millisecond more on a 16-core host, worth it
    from dozens of rows)."""
    global _batch_matcher
    rows = list(range(len(constraints))) if rows is None else rows
    if len(constraints) < BATCH_FILL_MIN:
        for row, c in zip(rows, constraints):
            c.matcher.fill_next_token_bitmask(bitmask, row)
    else:
        if _batch_matcher is None:
            _batch_matcher = xgr.BatchGrammarMatcher()
        _batch_matcher.batch_fill_next_token_bitmask([c.matcher for c in constraints], bitmask, rows)
    # the UTF-8 part, on numpy views (the same memory): ~10 us a call for a few rows, where torch's
    # row gather and masked AND took ~30-50 us, more than xgrammar's own fill in many states
    bitmask.numpy()[rows] &= constraints[0].utf8.allowed[[c.states[-1] for c in constraints]]


def accept_tokens(constraints: list[Constraint], tokens: list[int]) -> list[bool]:
    """`accept` one token per constraint, in one call."""
    nxt = [c.well_formed(t) for c, t in zip(constraints, tokens)]
    ok = [n >= 0 for n in nxt]
    sure = [k for k, o in enumerate(ok) if o]
    if sure:
        res = xgr.BatchGrammarMatcher.batch_accept_token([constraints[k].matcher for k in sure],
                                                         [tokens[k] for k in sure])
        for k, r in zip(sure, res):
            ok[k] = bool(r)
            if r:
                constraints[k].states.append(nxt[k])
    return ok


def allocate_bitmask(n: int, vocab_size: int) -> torch.Tensor:
    """A CPU int32 bitmask of `n` rows, all tokens allowed (one bit per token id)."""
    return xgr.allocate_token_bitmask(n, vocab_size)


def _cuda_backend() -> Literal["triton", "torch_native"]:
    try:
        import triton  # noqa: F401  (xgrammar's CUDA kernel is a Triton one)
        return "triton"
    except ImportError:
        return "torch_native"


def apply_mask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | None = None) -> None:
    """Set disallowed logits to -inf, in place: row i of `logits` by row i of `bitmask` (or only the
    rows listed in `rows`). Columns past the bitmask's width (a padded embedding) are disallowed."""
    width = min(logits.shape[-1], bitmask.shape[-1] * 32)
    if bitmask.device != logits.device:
        bitmask = bitmask.to(logits.device, non_blocking=True)
    backend: Literal["triton", "torch_native", "auto"] = _cuda_backend() if logits.device.type == "cuda" else "auto"
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=width, indices=rows, backend=backend)
    if logits.shape[-1] > width:
        if rows is None:
            logits[..., width:] = float("-inf")
        else:
            logits[torch.as_tensor(rows, device=logits.device), width:] = float("-inf")


def _decode(tokenizer: Any, ids: list[int]) -> str:
    fast = getattr(tokenizer, "backend_tokenizer", None)  # the Rust tokenizer: 4x less overhead per call
    if fast is not None:
        return fast.decode(ids, skip_special_tokens=False)
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _encode(tokenizer: Any, text: str) -> list[int]:
    fast = getattr(tokenizer, "backend_tokenizer", None)
    if fast is not None:
        return fast.encode(text, add_special_tokens=False).ids
    return tokenizer.encode(text, add_special_tokens=False)


MEMO_ENTRIES = 1 << 16


def _retokenized(tokenizer: Any, tail: tuple[int, ...], forced: str,
                 memo: dict | None) -> tuple[int, list[int]] | None:
    """How `tail` + `forced` retokenize: (how many leading tokens of `tail` stay, the tokens after
    them), or None where the text does not round-trip. A pure function of the tokenizer, memoized in
    `memo` (a workload's jumps repeat a few boundaries: '"' before ',"country":"', and so on)."""
    key = (tail, forced)
    if memo is not None and key in memo:
        return memo[key]
    text = _decode(tokenizer, list(tail))
    res = None
    if "\ufffd" not in text:
        new = _encode(tokenizer, text + forced)
        if _decode(tokenizer, new) == text + forced:
            same = 0
            while same < min(len(tail), len(new)) and tail[same] == new[same]:
                same += 1
            res = same, new[same:]
    if memo is not None:
        if len(memo) >= MEMO_ENTRIES:
            memo.clear()
        memo[key] = res
    return res


def retokenize_jump(tokenizer: Any, constraint: Constraint, out_ids: list[int], forced: str,
                    k: int = 2, memo: dict | None = None) -> tuple[list[int], int]:
    """Append the forced string to a request's generated tokens, retokenizing their last `k` tokens
    with it so the boundary merges as the tokenizer would ('"' then ',"' becomes '","').

    Returns (new, n): the request's tokens become out_ids[:len(out_ids) - n] + new (the engine frees
    the n dropped tokens' KV and prefills `new`). The grammar reads text, which retokenizing leaves as
    it was, so the matcher only accepts `forced`, as one step (`rollback(1)` undoes the jump): no
    rollback and no token-by-token accept of what the tail already said. Fewer old tokens are redone
    where the text does not round-trip (a tail starting inside a UTF-8 character, a tokenizer that
    prefixes a space to a fragment), and none where the new tokens would hold a special token;
    (`[]`, 0) means: no jump, decode as usual. `memo` (a dict kept per tokenizer) caches the
    tokenizer's part.
    """
    if not forced:
        return [], 0
    for j in range(min(k, len(out_ids)), -1, -1):
        tail = tuple(out_ids[len(out_ids) - j:]) if j else ()
        split = _retokenized(tokenizer, tail, forced, memo)
        if split is None:
            continue
        same, new = split
        if any(t in constraint.never or t in constraint.stops for t in new):
            continue
        if not constraint.accept_string(forced):
            return [], 0
        return list(new), j - same
    return [], 0
