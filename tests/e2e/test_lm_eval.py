"""lmbatch as lm-eval's backend against lm-eval's own HF backend, request by request, on the embedded
model in float32: loglikelihoods (empty contexts, trailing spaces, contexts cut to max_length),
rolling loglikelihoods over several windows, greedy generations with stop strings."""
from __future__ import annotations

import pytest
from lm_eval.api.instance import Instance
from lm_eval.api.model import TemplateLM
from lm_eval.models.huggingface import HFLM

from lmbatch.lm_eval.backend import LMBatch
from lmbatch.lm_eval.tokens import _batch_backend
from lmbatch.model.embedded import embedded_model_dir

MAX_LENGTH = 96     # small, so that long texts need several rolling windows and long pairs are cut

STEM = ("The museum by the river opened in the north of the city. Its tower was the tallest landmark, and "
        "many people came to the park beside it because")
PAIRS = [(STEM, " it was free."), (STEM, " the bridge was closed."), (STEM + " ", "of the view."),
         (STEM + " it", " rained."), ("", "The city"), ("Question: how many bridges? Answer:", " two"),
         ("Question: how many bridges? Answer:", " three hundred and four"),
         (STEM * 3, " people came back.")]      # longer than MAX_LENGTH: the context is cut on the left
TEXTS = [STEM, STEM * 4, "One two three four five. " * 40]


@pytest.fixture(scope="module")
def backends():
    path = str(embedded_model_dir())
    ours = LMBatch(pretrained=path, device="cpu", dtype="float32", max_length=MAX_LENGTH, score_cache=False)
    theirs = HFLM(pretrained=path, device="cpu", dtype="float32", batch_size=4, max_length=MAX_LENGTH)
    return ours, theirs


def _instances(kind: str, args: list[tuple]) -> list[Instance]:
    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


def test_loglikelihood_matches_hf(backends):
    ours, theirs = backends
    before = ours.stats.prompt_tokens
    got = ours.loglikelihood(_instances("loglikelihood", PAIRS))
    want = theirs.loglikelihood(_instances("loglikelihood", PAIRS))
    for (a, greedy_a), (b, greedy_b) in zip(got, want):
        assert abs(a - b) < 1e-4, (a, b)
        assert greedy_a == greedy_b
    assert ours.stats.prompt_tokens > before and ours.stats.cached_tokens > 0


def test_loglikelihood_rolling_matches_hf(backends):
    ours, theirs = backends
    got = ours.loglikelihood_rolling(_instances("loglikelihood_rolling", [(t,) for t in TEXTS]))
    want = theirs.loglikelihood_rolling(_instances("loglikelihood_rolling", [(t,) for t in TEXTS]))
    assert len(ours.tok_encode(TEXTS[2])) > 2 * MAX_LENGTH      # several windows
    for a, b in zip(got, want):
        assert abs(a - b) < 1e-3, (a, b)


def test_greedy_generation_matches_hf(backends):
    ours, theirs = backends
    args = [(STEM, {"until": ["."], "max_gen_toks": 24, "do_sample": False}),
            (STEM + " it", {"until": ["\n\n", "!"], "max_gen_toks": 12, "do_sample": False}),
            ("Question: how many bridges? Answer:", {"until": "\n", "max_gen_toks": 16, "temperature": 0.0})]
    got = ours.generate_until(_instances("generate_until", args))
    want = theirs.generate_until(_instances("generate_until", args))
    assert got == want
    assert any(got)


def test_think_end_token_cuts_as_hf(backends):
    """`think_end_token` (a text, or a token id as a string of digits): only what follows its last occurrence
    is returned, as lm-eval's HF backend returns it."""
    from lmbatch.lm_eval.generate import think_end

    ours, theirs = backends
    gen = _instances("generate_until", [(STEM, {"until": ["\n\n"], "max_gen_toks": 24, "do_sample": False})])
    plain = ours.generate_until(gen)[0]
    ids = ours.tok_encode(plain)
    try:
        for marker in (plain.split()[2], str(ids[len(ids) // 2])):
            ours.think_end_token = think_end(marker)
            theirs.think_end_token = int(marker) if marker.isdigit() else marker     # as HFLM.__init__ reads it
            got = ours.generate_until(gen)
            assert got == theirs.generate_until(gen) and got[0] != plain, (marker, plain, got)
    finally:
        ours.think_end_token = theirs.think_end_token = None


def test_token_ids_are_lm_evals(backends):
    ours, theirs = backends
    for context, continuation in PAIRS[:4] + PAIRS[5:]:
        assert ours._encode_pair(context, continuation) == theirs._encode_pair(context, continuation)
    assert ours.prefix_token_id == theirs.prefix_token_id and ours.eot_token_id == theirs.eot_token_id
    assert ours.max_length == theirs.max_length == MAX_LENGTH


def test_batched_tokenization_gives_lm_evals_ids(backends, monkeypatch):
    """`LMBatch.loglikelihood` encodes each distinct text once, in batches (`_score_requests`); the ids
    it scores are those of lm-eval's own request-by-request path (`TemplateLM.loglikelihood`), and of
    `--model hf`'s, cut to max_length + 1 tokens as both cut them."""
    ours, theirs = backends
    prefix = ours.tok_decode([ours.prefix_token_id], skip_special_tokens=False)
    pairs = PAIRS + [(prefix + STEM, " it was free."), ("Café  ", "naïve résumé"), ("  ", "x"),
                     ("\n\nQuestion:", " 😀 emoji"), (STEM + "\n", "\nnext")]
    seen: dict[str, list] = {}
    for name, lm in (("one by one", ours), ("hf", theirs)):
        monkeypatch.setattr(lm, "_loglikelihood_tokens", lambda reqs, name=name, **kw: seen.setdefault(name, reqs))
        if name == "one by one":
            TemplateLM.loglikelihood(lm, _instances("loglikelihood", pairs))
        else:
            lm.loglikelihood(_instances("loglikelihood", pairs))
        monkeypatch.undo()
    assert seen["one by one"] == seen["hf"]
    batched = ours.tokens.score_requests(pairs)
    assert batched == ours.tokens.cut([(context, continuation) for _, context, continuation in seen["hf"]])
    assert len(batched) == len(pairs) and all(r.continuation for r in batched)
    assert max(len(r.tokens) for r in batched) <= MAX_LENGTH + 1
    # those ids came from the text's ends alone, each distinct segment tokenized once (this tokenizer's cut
    # rule holds); the whole texts through the tokenizer's own batch encoding, and through transformers'
    # call, give them too
    assert ours.tokens._by_segments() is not None
    monkeypatch.setattr(ours.tokens, "_by_segments", lambda: None)
    assert _batch_backend(ours.tokenizer) is not None
    assert ours.tokens.score_requests(pairs) == batched
    monkeypatch.setattr("lmbatch.lm_eval.tokens._batch_backend", lambda tokenizer: None)
    assert ours.tokens.score_requests(pairs) == batched


def test_ids_from_the_texts_ends_are_the_whole_texts_ids(backends, monkeypatch):
    """Random pairs (contexts shared by several continuations, newlines and carriage returns, runs of spaces,
    digits, punctuation, accents, an emoji, the prefix token's text): the ids made from each text's end
    (`_by_segments`) are those of the whole texts encoded and split (the path the test above holds to lm-eval's
    own), every pair."""
    import random

    ours = backends[0]
    rng = random.Random(7)
    prefix = ours.tok_decode([ours.prefix_token_id], skip_special_tokens=False)
    atoms = ["the", "Answer", "Question", ":", "?", ".", ",", " ", "  ", "\n", "\n\n", " \n", "\t", "2", "42",
             "1999", "é", "naïve", "😀", "A", "(B)", "x_y", "'s", "-", "\u00a0", "\r\n", "\r"]

    def text(n):
        return "".join(rng.choice(atoms) for _ in range(n))

    pairs = []
    for _ in range(60):
        context = (prefix if rng.random() < 0.1 else "") + text(rng.randrange(0, 40))
        for _ in range(rng.randrange(1, 5)):
            pairs.append((context, text(rng.randrange(1, 6))))
    pairs = [(c, x) for c, x in pairs if x]
    assert ours.tokens._by_segments() is not None
    fast = ours.tokens.score_requests(pairs)
    monkeypatch.setattr(ours.tokens, "_by_segments", lambda: None)
    assert ours.tokens.score_requests(pairs) == fast


def test_the_tokenizers_own_batch_encoding_only_where_transformers_call_is_it(backends, monkeypatch):
    """`_batch_backend` refuses a tokenizer class that overrides a step of transformers' call, and one set
    to truncate, pad or split special tokens (transformers' call would undo or apply those)."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = backends[0].tokenizer
    assert _batch_backend(tokenizer) is tokenizer._tokenizer

    class Own(type(tokenizer)):
        def _encode_plus(self, *args, **kwargs):
            return super()._encode_plus(*args, **kwargs)

    monkeypatch.setattr(tokenizer, "__class__", Own)
    assert _batch_backend(tokenizer) is None
    monkeypatch.undo()
    monkeypatch.setattr(tokenizer, "split_special_tokens", True, raising=False)
    assert _batch_backend(tokenizer) is None
    monkeypatch.undo()
    tokenizer._tokenizer.enable_truncation(8)
    try:
        assert _batch_backend(tokenizer) is None
    finally:
        tokenizer._tokenizer.no_truncation()
    assert _batch_backend(tokenizer) is tokenizer._tokenizer and isinstance(tokenizer, PreTrainedTokenizerFast)


def test_data_parallel_backend_matches_hf(backends):
    """`data_parallel=2` in model_args: the batch's subtrees on two worker processes, lm-eval's
    numbers unchanged (stop strings decoded in the workers, too)."""
    _, theirs = backends
    ours = LMBatch(pretrained=str(embedded_model_dir()), device="cpu", dtype="float32", max_length=MAX_LENGTH,
                   data_parallel=2, score_cache=False)
    try:
        got = ours.loglikelihood(_instances("loglikelihood", PAIRS))
        want = theirs.loglikelihood(_instances("loglikelihood", PAIRS))
        for (a, greedy_a), (b, greedy_b) in zip(got, want):
            assert abs(a - b) < 1e-4, (a, b)
            assert greedy_a == greedy_b
        args = [(STEM, {"until": ["."], "max_gen_toks": 24, "do_sample": False}),
                (STEM + " it", {"until": ["\n\n", "!"], "max_gen_toks": 12, "do_sample": False})]
        gen = _instances("generate_until", args)
        assert ours.generate_until(gen) == theirs.generate_until(gen)
        report = ours.report()
        assert report["data_parallel"] == 2 and report["tokens"]["prompt"] > 0
    finally:
        ours.engine.close()
