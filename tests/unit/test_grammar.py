"""Constrained decoding over xgrammar (lmbatch.grammar), on the embedded model's tokenizer."""

from __future__ import annotations

import json
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("xgrammar")
from transformers import AutoTokenizer  # noqa: E402

from lmbatch.grammar import Constraint, GrammarCompiler, accept_tokens, allocate_bitmask, apply_mask, retokenize_jump  # noqa: E402
from lmbatch.model.embedded import embedded_model_dir  # noqa: E402

PAD = 64  # simulate an embedding padded past the vocabulary
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "population": {"type": ["integer", "null"], "minimum": 0, "maximum": 10**7},
        "landmarks": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2},
    },
    "required": ["name", "population", "landmarks"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(embedded_model_dir())


@pytest.fixture(scope="module")
def gc(tok):
    return GrammarCompiler(tok, vocab_size=len(tok))


def _ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def _state(gc, c) -> tuple[str, torch.Tensor, bool]:
    mask = allocate_bitmask(1, gc.vocab_size)
    c.fill_mask(mask, 0)
    return c.jump_forward(), mask, c.is_completed()


def _fresh(gc, ids: list[int], **constraint):
    """A new constraint fed `ids` token by token: the reference state for those tokens."""
    c = gc.constraint(**constraint)
    assert all(c.accept(t) for t in ids)
    return c


def _greedy(tok, gc, constraint: dict, seed: int, jump: bool, max_steps: int = 400) -> list[int]:
    """Greedy decoding of random logits under the constraint (padded logits rows); with `jump`,
    forced text is appended by retokenize_jump instead of being decoded."""
    c = gc.constraint(**constraint)
    g = torch.Generator().manual_seed(seed)
    out: list[int] = []
    mask = allocate_bitmask(1, gc.vocab_size)
    for _ in range(max_steps):
        if c.is_terminated():
            return out
        if jump:
            new, n = retokenize_jump(tok, c, out, c.jump_forward())
            out = out[:len(out) - n] + new
            assert _state(gc, c)[0] == ""  # nothing forced is left
            if new or n:    # the matcher took the forced text whole: as if fed the new tokens one by one
                jf, mask, done = _state(gc, c)
                jf0, mask0, done0 = _state(gc, _fresh(gc, out, **constraint))
                assert (jf, done) == (jf0, done0) and torch.equal(mask, mask0)
        logits = torch.randn(1, gc.vocab_size + PAD, generator=g)
        c.fill_mask(mask, 0)
        apply_mask(logits, mask)
        assert torch.isinf(logits[0, gc.vocab_size:]).all()
        t = int(logits.argmax())
        assert c.accept(t)
        out.append(t)
    raise AssertionError("did not terminate")


def test_compile_is_cached_per_constraint(tok) -> None:
    gc = GrammarCompiler(tok, vocab_size=len(tok))     # its own cache: no other test's compilations
    before = gc.compiled_count
    a = gc.compile(regex=r"[0-9]{3}-[a-z]{2}")
    assert gc.compile(regex=r"[0-9]{3}-[a-z]{2}") is a
    s = gc.compile(json_schema=SCHEMA)
    assert gc.compile(json_schema=json.dumps(SCHEMA, indent=2)) is s  # same schema as text
    assert gc.compiled_count == before + 2

    nocache = GrammarCompiler(tok, vocab_size=len(tok), cache=False)
    for _ in range(3):
        nocache.compile(regex=r"[0-9]{3}-[a-z]{2}")
    assert nocache.compiled_count == 3


@pytest.mark.parametrize("kwargs, message", [
    (dict(regex="[a-"), r"^invalid regex '\[a-': Regex parsing error at position 4: Unclosed '\['$"),
    (dict(regex="a{3,2}"), r"^invalid regex 'a\{3,2\}': .*Lower bound is larger than upper bound"),
    (dict(json_schema={"type": "strin"}), r'^invalid JSON schema: Unsupported type "strin"$'),
    (dict(json_schema="{not json"), r"^invalid JSON schema: Failed to parse JSON"),
    (dict(), r"^give exactly one of regex, json_schema, ebnf$"),
    (dict(ebnf="root ::= expr"), r'^invalid EBNF grammar: EBNF parser error at line 1, column 10: Rule "expr" is '
                                 r'not defined$'),
    (dict(ebnf='root ::= "a" | '), r"^invalid EBNF grammar: EBNF parser error"),
    (dict(regex="a", ebnf='root ::= "a"'), r"^give exactly one of"),
    (dict(regex="a", json_schema={"type": "string"}), r"^give exactly one of"),
])
def test_invalid_constraint_is_one_line_value_error(gc, kwargs, message) -> None:
    with pytest.raises(ValueError, match=message) as e:
        gc.compile(**kwargs)
    assert "\n" not in str(e.value)


def test_apply_mask_cpu_rows_and_dtypes(gc) -> None:
    c = gc.constraint(regex=r"[0-9]")
    mask = allocate_bitmask(3, gc.vocab_size)
    c.fill_mask(mask, 1)
    for dtype in (torch.float32, torch.bfloat16):
        logits = torch.zeros(3, gc.vocab_size + PAD, dtype=dtype)
        apply_mask(logits, mask, rows=[1])
        assert not torch.isinf(logits[0]).any() and not torch.isinf(logits[2]).any()  # unconstrained rows
        assert (~torch.isinf(logits[1])).sum() == 10  # the ten digit tokens, no padding column


def test_greedy_regex(tok, gc) -> None:
    for seed in range(3):
        out = _greedy(tok, gc, dict(regex=r"[0-9]{3}-[a-z]{2}"), seed, jump=False)
        assert out[-1] == tok.eos_token_id
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", tok.decode(out[:-1]))


@pytest.mark.parametrize("jump", [False, True])
def test_greedy_json_parses_and_fits_schema(tok, gc, jump) -> None:
    for seed in range(2):
        out = _greedy(tok, gc, dict(json_schema=SCHEMA), seed, jump=jump)
        assert out[-1] == tok.eos_token_id
        text = tok.decode(out[:-1])
        # xgrammar's bounded strings allow raw control characters (tab...) that strict JSON forbids
        doc = json.loads(text, strict=False)
        assert list(doc) == ["name", "population", "landmarks"]
        assert isinstance(doc["name"], str) and len(doc["name"]) <= 12
        assert doc["population"] is None or (type(doc["population"]) is int and 0 <= doc["population"] <= 10**7)
        assert len(doc["landmarks"]) <= 2 and all(isinstance(x, str) and len(x) <= 8 for x in doc["landmarks"])
        assert text.startswith('{"name":"')
        assert " " not in re.sub(r'"[^"]*"', '""', text)  # compact: no whitespace outside strings


def test_jump_forward_at_start_is_compact_prefix(gc) -> None:
    c = gc.constraint(json_schema=SCHEMA)
    assert c.jump_forward() == '{"name":"'
    assert c.jump_forward() == '{"name":"'  # does not change the state
    assert gc.constraint(regex=r"abc[0-9]+").jump_forward() == "abc"
    assert gc.constraint(regex=r"[0-9]+").jump_forward() == ""


def test_forced_stop_only_where_the_grammar_admits_nothing_else(tok, gc) -> None:
    stop = gc.info.stop_token_ids[0]
    c = gc.constraint(regex="(yes|no)")
    assert c.forced_stop() is None                      # nothing matched yet
    for t in _ids(tok, "no"):
        assert c.forced_stop() is None
        assert c.accept(t)
    assert c.forced_stop() == stop and not c.is_terminated()   # the state is unchanged
    assert c.accept(stop) and c.is_terminated()
    digits = _fresh(gc, _ids(tok, "12"), regex=r"[0-9]+")
    assert digits.is_completed() and digits.forced_stop() is None   # complete, but more digits may follow
    obj = _fresh(gc, _ids(tok, '{"name":"Paris","population":null,"landmarks":[]}'), json_schema=SCHEMA)
    assert obj.forced_stop() == stop


def test_accept_string_is_one_rollback_step(gc) -> None:
    c = gc.constraint(json_schema=SCHEMA)
    assert c.accept_string('{"name":"') and c.jump_forward() == ""
    c.rollback(1)
    assert c.jump_forward() == '{"name":"'


def test_retokenize_jump_merges_boundary_and_keeps_matcher_in_step(tok, gc) -> None:
    schema = dict(json_schema=SCHEMA)
    c = gc.constraint(**schema)
    out, n = retokenize_jump(tok, c, [], c.jump_forward())
    assert n == 0 and out == _ids(tok, '{"name":"')
    for t in _ids(tok, 'Paris"'):
        assert c.accept(t)
        out.append(t)
    forced = c.jump_forward()
    assert forced == ',"population":'
    new, n = retokenize_jump(tok, c, out, forced, k=2)
    # '"' and ',"' merge into one token '","': the old '"' is replaced
    assert n == 1 and tok.decode(new[0]) == '","'
    out = out[:len(out) - n] + new
    assert tok.decode(out) == '{"name":"Paris","population":'
    assert out == _ids(tok, '{"name":"Paris","population":')  # what the tokenizer makes of the text
    jf, mask, done = _state(gc, c)
    jf0, mask0, done0 = _state(gc, _fresh(gc, out, **schema))
    assert (jf, done) == (jf0, done0) and torch.equal(mask, mask0)
    # the matcher took the forced text as one step, on top of the '"' it had: one rollback undoes the jump
    c.rollback(1)
    assert c.jump_forward() == forced and torch.equal(_state(gc, c)[1],
                                                      _state(gc, _fresh(gc, _ids(tok, '{"name":"Paris"'), **schema))[1])


def test_retokenize_jump_never_splits_a_character(tok, gc) -> None:
    regex = dict(regex=r"Ōsaka-[0-9]")
    out = _ids(tok, "Ō")  # two byte-level tokens, neither a character by itself
    assert len(out) == 2 and "\ufffd" in tok.decode(out[1:])
    for k in (1, 2):  # k=1 would start inside "Ō": the tail is not redone; k=2 redoes "Ō" as it was
        c = _fresh(gc, out, **regex)
        assert c.jump_forward() == "saka-"
        new, n = retokenize_jump(tok, c, out, "saka-", k=k)
        assert n == 0
        ids = out[:len(out) - n] + new
        assert tok.decode(ids) == "Ōsaka-"
        assert torch.equal(_state(gc, c)[1], _state(gc, _fresh(gc, ids, **regex))[1])


def test_retokenize_jump_memo_gives_the_same_tokens_without_the_tokenizer(tok, gc) -> None:
    """A memo of the tokenizer's part: the same (new, n) and matcher state as without it, and a memo
    hit needs no tokenizer at all."""
    regex = dict(regex=r'\{"a":"[a-z]{1,8}","b":"[0-9]{1,3}"\}')
    memo: dict = {}
    for text in ('{"a":"x"', '{"a":"abc"', '{"a":"x","b":"1"'):
        out = _ids(tok, text)
        plain, memoized = _fresh(gc, out, **regex), _fresh(gc, out, **regex)
        forced = plain.jump_forward()
        assert forced
        want = retokenize_jump(tok, plain, out, forced)
        assert retokenize_jump(tok, memoized, out, forced, memo=memo) == want
        again = _fresh(gc, out, **regex)
        assert retokenize_jump(None, again, out, forced, memo=memo) == want   # served by the memo
        for c in (memoized, again):
            assert torch.equal(_state(gc, c)[1], _state(gc, plain)[1])
    assert memo


def test_ids_no_grammar_accepts_are_rejected_quietly(tok, capfd) -> None:
    """Padding ids past the tokenizer (a model's larger embedding) are rejected without xgrammar's
    per-token warning: the engine offers every unconstrained pick to the grammar first."""
    gc = GrammarCompiler(tok, vocab_size=len(tok) + 64)
    c = gc.constraint(regex="[a-z]+")
    pad = len(tok) + 5
    assert not c.accept(pad)
    assert accept_tokens([c, gc.constraint(regex="[a-z]+")], [pad, _ids(tok, "abc")[0]]) == [False, True]
    assert "Warning" not in capfd.readouterr().err


def _byte_token(tok, b: int) -> int:
    """The byte-level BPE token of one raw byte (GPT-2's printable stand-in for it)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    stand_in = chr(b) if b in printable else chr(256 + [x for x in range(256) if x not in printable].index(b))
    return tok.convert_tokens_to_ids(stand_in)


def test_constraints_keep_text_well_formed_utf8(tok) -> None:
    """xgrammar 0.2.8's negated character class admits ill-formed UTF-8: surrogates (ED A0 80) and
    overlong forms (E0 80 80, F0 80 80 80). Each decodes to several U+FFFD, so a 40-character string
    overran its bound (seen in a GPU run). A constraint rejects such a byte and masks it out; well-
    formed 3- and 4-byte characters pass, and rollback restores the state."""
    from lmbatch.programs.json_cities import SCHEMA as CITY

    gc = GrammarCompiler(tok, vocab_size=len(tok))

    def fresh(kind: str) -> Constraint:
        if kind == "regex":
            return gc.constraint(regex=r'[^"\\\x00-\x1f]{1,40}')
        c = gc.constraint(json_schema=CITY)
        assert all(c.accept(t) for t in _ids(tok, '{"name":"'))
        return c

    for kind in ("regex", "schema"):
        def bytes_in(*raw: int) -> list[bool]:
            c = fresh(kind)
            return [c.accept(_byte_token(tok, b)) for b in raw]
        assert bytes_in(0xED, 0xA0) == [True, False]                      # surrogate
        assert bytes_in(0xE0, 0x80) == [True, False]                      # overlong, 3 bytes
        assert bytes_in(0xF0, 0x8F) == [True, False]                      # overlong, 4 bytes
        assert bytes_in(0xED, 0x9F, 0xBF) == [True, True, True]           # U+D7FF
        assert bytes_in(0xE0, 0xA0, 0x80, 0x41) == [True] * 4             # U+0800, then 'A'
        assert bytes_in(0xF0, 0x90, 0x80, 0x80) == [True] * 4             # U+10000
        c = fresh(kind)
        assert c.accept(_byte_token(tok, 0xE0))
        assert accept_tokens([c], [_byte_token(tok, 0x85)]) == [False]    # the batch path checks too
        mask = allocate_bitmask(1, gc.vocab_size)
        c.fill_mask(mask, 0)

        def allowed(t: int) -> bool:
            return bool((int(mask[0, t // 32]) >> (t % 32)) & 1)
        assert not allowed(_byte_token(tok, 0x85)) and allowed(_byte_token(tok, 0xA5))
        assert not allowed(_ids(tok, "A")[0])                             # a character is half written
        c.rollback(1)
        assert c.accept(_ids(tok, "A")[0])


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31 - 1),
       constraint=st.sampled_from([dict(json_schema=SCHEMA), dict(regex=r"\(\d{3}\) \d{3}-\d{4}"),
                                   dict(regex=r"(yes|no)! [a-z]{1,5}\."), dict(regex=r"Ōsaka-[0-9]{2}")]))
def test_jumps_leave_the_matcher_as_if_fed_the_tokens(tok, gc, seed, constraint) -> None:
    """Jump-forward under random logits: after each jump the matcher's state (mask, forced text,
    completion) is that of a fresh matcher fed the request's tokens one by one, and the text parses."""
    out = _greedy(tok, gc, constraint, seed, jump=True)
    text = tok.decode(out[:-1])
    if "regex" in constraint:
        assert re.fullmatch(constraint["regex"], text), text
    else:
        json.loads(text, strict=False)
