"""Stop strings searched in the output's tail (issue 37): the step a request ends at, and its text, are
those of decoding the whole answer at every step, for the embedded byte-level tokenizer and the
SentencePiece-style ones (byte fallback, a stripped leading space), on outputs with multi-byte
characters split across tokens, special tokens, jump-forward's several tokens at once and thinking."""
from __future__ import annotations

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from lmbatch.engine.sampler import Launched, Sampler
from lmbatch.engine.state import Running
from lmbatch.model.config import ModelConfig
from lmbatch.model.embedded import embedded_model_dir
from lmbatch.model.tokenizer import LazyTokenizer, TextDecoder
from lmbatch.requests import SamplingParams
from tests.unit.test_tokenizer_build import sentencepiece_like

STOPS = ["\n\n", "Question:", "</s>", "<|im_end|>", "é", "日本", " the", "😀", "a", "::", "\n"]
TEXTS = ["Question: what is 2 + 2?\n\nAnswer: 4", "café 日本語 😀👍🏽 the end", "<|im_end|></s>a::b", "x\ny\n\nz",
         "  leading spaces and\ttabs", "ﬁ naïve Zu\u0308rich"]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """Each tokenizer as transformers' (decoding every search) and as a run holds it, a `LazyTokenizer`
    whose `TextDecoder` skips the searches no new token can end a stop string in (name + "-lazy")."""
    out = {"embedded": AutoTokenizer.from_pretrained(str(embedded_model_dir())),
           "embedded-lazy": LazyTokenizer(embedded_model_dir())}
    for kind, spec in sentencepiece_like().items():
        out[kind] = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)))
        out[kind + "-lazy"] = lazy = LazyTokenizer(tmp_path_factory.mktemp(kind))
        lazy.use_decoder(Tokenizer.from_str(json.dumps(spec)))
    return out


def _reference(tokenizers, name):
    """The transformers tokenizer the whole answer is decoded with."""
    return tokenizers[name.removesuffix("-lazy")]


def _whole(tok, out: list[int], think_len: int, stop: tuple[str, ...]) -> bool:
    text = tok.decode(out[think_len:])
    return any(s in text for s in stop)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_the_tail_search_ends_where_the_whole_answer_does(tokenizers, data):
    name = data.draw(st.sampled_from(sorted(tokenizers)))
    tok = _reference(tokenizers, name)
    vocab = len(tok)
    stop = tuple(data.draw(st.lists(st.sampled_from(STOPS), min_size=1, max_size=3, unique=True)))
    # ids of real text (characters split over byte tokens), of random tokens and of special tokens
    text_ids = tok.encode(data.draw(st.sampled_from(TEXTS)), add_special_tokens=False)
    ids = data.draw(st.lists(st.one_of(st.sampled_from(text_ids), st.integers(0, vocab - 1)), min_size=1,
                             max_size=60))
    chunks = data.draw(st.lists(st.integers(1, 12), min_size=len(ids), max_size=len(ids)))   # jumped tokens at once
    think_len = data.draw(st.integers(0, 3))
    cfg = ModelConfig.from_dir(embedded_model_dir())
    sampler = Sampler(cfg, torch.device("cpu"), tokenizer=tokenizers[name])
    r = Running(0, None, torch.zeros(0, dtype=torch.int64), 0, SamplingParams(max_new_tokens=10_000, stop=stop,
                                                                            ignore_eos=True))
    r.out, r.think_len = ids[:think_len], think_len
    i = think_len
    for n in chunks:
        if i >= len(ids):
            break
        r.out += ids[i:i + n]           # several tokens since the last search, as a jump-forward leaves them
        i += n
        want = _whole(tok, r.out, think_len, stop)
        assert sampler._stop_in_tail(r) == want, (name, stop, tok.decode(r.out[think_len:]))
        if want:
            break


@pytest.mark.parametrize("name", ["embedded", "llama", "gemma2", "gemma3", "embedded-lazy", "llama-lazy"])
@pytest.mark.parametrize("before", ["", "é", "日本語 "])
def test_a_stop_string_early_in_many_new_tokens_is_found(tokenizers, name, before):
    """A jump-forward appends many tokens at once: a stop string at their start, far from the end, ends
    the request (only the tokens before the last search may be left out of the tail)."""
    tok = _reference(tokenizers, name)
    sampler = Sampler(ModelConfig.from_dir(embedded_model_dir()), torch.device("cpu"), tokenizer=tokenizers[name])
    r = Running(0, None, torch.zeros(0, dtype=torch.int64), 0, SamplingParams(max_new_tokens=100, stop=("::",)))
    r.out = tok.encode(before + "x", add_special_tokens=False)
    assert not sampler._stop_in_tail(r)
    r.out += tok.encode(" :: " + "b " * 30, add_special_tokens=False)
    assert sampler._stop_in_tail(r)


def test_the_tokens_a_stop_string_ends_in(tokenizers):
    """The tokens whose text holds a stop string's last character, for the searches skipped: on the
    embedded tokenizer exactly those, and None (every search decodes) where a token's text alone cannot
    say: a space, a character beyond ASCII, or a decoder that cleans spaces up."""
    lazy = tokenizers["embedded-lazy"]
    hf = tokenizers["embedded"]
    held = lazy.decoder().tokens_holding(frozenset("\n:"))
    assert held == {i for i in range(len(hf)) if "\n" in hf.decode([i]) or ":" in hf.decode([i])}
    assert hf.encode("\n\n", add_special_tokens=False)[0] in held and 64 < len(held) < len(hf) // 10
    for chars in ("a ", "é", "日", ""):
        assert lazy.decoder().tokens_holding(frozenset(chars)) is None, chars
    cleaning = TextDecoder(lazy.decoder().tokenizer, clean_up=True, clean_up_bpe=True)
    assert cleaning.tokens_holding(frozenset("\n")) is None
    sampler = Sampler(ModelConfig.from_dir(embedded_model_dir()), torch.device("cpu"), tokenizer=lazy)
    assert sampler._stop_tokens(("x\n", "::")) == lazy.decoder().tokens_holding(frozenset("\n:"))
    assert sampler._stop_tokens(("a", "the ")) is None and len(sampler._stop_tokens(("a", " the"))) > 1000
    assert Sampler(ModelConfig.from_dir(embedded_model_dir()), torch.device("cpu"), tokenizer=hf)._stop_tokens(
        ("\n",)) is None


class _Landed:
    def synchronize(self):
        pass


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_landing_a_step_skips_only_checks_that_could_not_end_a_row(tokenizers, data):
    """`Sampler.land` checks in full only a token its `_watch` names (an EOS id, or one that may end a stop
    string of the launch's rows): rows end, at the same token and for the same reason, and search for
    their stop strings from the same place, as when every token is checked in full."""
    name = data.draw(st.sampled_from(["embedded-lazy", "llama-lazy", "embedded"]))
    tok = _reference(tokenizers, name)
    cfg = ModelConfig.from_dir(embedded_model_dir())
    sampler = Sampler(cfg, torch.device("cpu"), tokenizer=tokenizers[name])
    text_ids = tok.encode("Question: 2 + 2?\n\nAnswer: 4.\nx::y", add_special_tokens=False)
    specials = [t for t in cfg.eos_token_ids if t < len(tok)]
    token = st.one_of(st.sampled_from(text_ids), st.integers(0, len(tok) - 1), st.sampled_from(specials))

    def params():
        return SamplingParams(max_new_tokens=data.draw(st.integers(1, 30)), ignore_eos=data.draw(st.booleans()),
                              stop=tuple(data.draw(st.lists(st.sampled_from(["\n\n", "Question:", "::", "\n", "4."]),
                                                            max_size=2, unique=True))))
    rows = [params() for _ in range(data.draw(st.integers(1, 6)))]
    fast = [Running(i, None, torch.zeros(0, dtype=torch.int64), 0, p) for i, p in enumerate(rows)]
    full = [Running(i, None, torch.zeros(0, dtype=torch.int64), 0, p) for i, p in enumerate(rows)]
    vocab = len(tok)
    watch = sampler._watch(fast, vocab)
    if name == "embedded" and any(p.stop for p in rows):
        assert watch is None, "a transformers tokenizer cannot say which tokens end a stop string"
    for _ in range(data.draw(st.integers(1, 35))):
        toks = torch.tensor(data.draw(st.lists(token, min_size=len(rows), max_size=len(rows))))
        sampler.land(Launched(fast, toks, toks, _Landed(), watch))
        sampler.land(Launched(full, toks, toks, _Landed(), None))
        for a, b in zip(fast, full):
            assert (a.out, a.finish, a.steps) == (b.out, b.finish, b.steps)
            assert not a.params.stop or a.stop_seen == b.stop_seen
    if watch is not None:
        assert watch[list(specials)].all() and 0 < watch.sum() < vocab // 4
