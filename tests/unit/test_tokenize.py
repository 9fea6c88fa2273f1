"""`TextEncoder` (lmbatch/frontend/tokenize.py) gives exactly the ids of whole-text tokenization and of
lm-eval's `_encode_pair`: on every MMLU and HellaSwag 5-shot prompt, on random texts that stress its
cut rules (the embedded GPT-2-style tokenizer and Qwen2 / Llama-3-style Split pre-tokenizers), and
by falling back to whole texts for tokenizers the rules do not hold for."""
from __future__ import annotations

import functools
import json
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models, pre_tokenizers

from lmbatch.frontend.tokenize import TextEncoder, _splittable, choice_texts, split_choices
from lmbatch.frontend.workload import LoadArgs
from lmbatch.model.embedded import embedded_model_dir

# Qwen2's pre-tokenizer, exactly as in its tokenizer.json
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# Llama-3's: digits in runs of up to three
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")


# ---- tokenizers --------------------------------------------------------------------------------
@functools.cache
def embedded_spec() -> str:
    return (embedded_model_dir() / "tokenizer.json").read_text()


@functools.cache
def hf_tokenizer():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(embedded_model_dir()))


def edited(edit) -> Tokenizer:
    """The embedded tokenizer with its tokenizer.json edited by `edit(spec)`."""
    spec = json.loads(embedded_spec())
    edit(spec)
    return Tokenizer.from_str(json.dumps(spec))


def split_pre_tokenizer(pattern: str) -> dict:
    return {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]}


def with_pre(pattern: str, nfc: bool = False):
    def edit(spec):
        spec["pre_tokenizer"] = split_pre_tokenizer(pattern)
        if nfc:
            spec["normalizer"] = {"type": "NFC"}
    return edit


@functools.cache
def tokenizer_kind(kind: str) -> Tokenizer:
    if kind == "embedded":
        return Tokenizer.from_str(embedded_spec())
    if kind == "qwen2":
        return edited(with_pre(QWEN2_PATTERN))
    if kind == "qwen2-nfc":
        return edited(with_pre(QWEN2_PATTERN, nfc=True))
    if kind == "llama3":
        return edited(with_pre(LLAMA3_PATTERN))
    raise ValueError(kind)


@functools.cache
def shared_encoder(kind: str) -> TextEncoder:
    """One encoder per kind for all of a test's examples: its memo carries across them."""
    return TextEncoder(tokenizer_kind(kind))


@functools.cache
def fresh_encoder(kind: str) -> TextEncoder:
    """An encoder whose memo each example clears first."""
    return TextEncoder(tokenizer_kind(kind))


def raw_ids(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


def lm_eval_encode_pair(encode, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's `TemplateLM._encode_pair`, written out: the context's trailing whitespace moves onto
    the continuation; the continuation's ids are the whole text's past the context's length."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces > 0:
        continuation = context[-n_spaces:] + continuation
        context = context[:-n_spaces]
    whole = encode(context + continuation)
    ctx = encode(context)
    return ctx, whole[len(ctx):]


def lm_eval_choices(encode, context: str, continuations) -> tuple[list[int], list[list[int]]]:
    pairs = [lm_eval_encode_pair(encode, context, c) for c in continuations]
    return pairs[0][0], [cont for _, cont in pairs]


# ---- every MMLU and HellaSwag prompt ------------------------------------------------------------
def task_pairs(task: str) -> tuple[list[str], list[tuple[str, list[str]]]]:
    from lmbatch.programs import hellaswag, mmlu

    args = LoadArgs(None, 5, None, None, 0)
    if task == "mmlu":
        insts = mmlu.instances(args)
        return [i.id for i in insts], [(i.inputs["context"], list(mmlu.CONTINUATIONS)) for i in insts]
    insts = hellaswag.instances(args)
    return [i.id for i in insts], [(i.inputs["context"], list(i.inputs["choices"])) for i in insts]


def first_diff(got: list[int], want: list[int]) -> str:
    p = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    return f"at token {p} (of {len(got)} / {len(want)}): got {got[p:p + 6]}, want {want[p:p + 6]}"


def difference(got, want, got_wholes, want_wholes) -> str | None:
    """Where `encode_choices`' result or `encode`'s of the texts first differ from the reference."""
    (got_ctx, got_conts), (want_ctx, want_conts) = got, want
    if list(got_ctx) != want_ctx:
        return "context ids " + first_diff(got_ctx, want_ctx)
    if len(got_conts) != len(want_conts):
        return f"{len(got_conts)} continuations, want {len(want_conts)}"
    for k, (g, w) in enumerate(zip(got_conts, want_conts)):
        if list(g) != w:
            return f"continuation {k}: got {g}, lm-eval {w}"
    for k, (g, w) in enumerate(zip(got_wholes, want_wholes)):
        if g != w:
            return f"encode() of text {k} (0: the context, then context + each continuation) " + first_diff(g, w)
    return None


@pytest.mark.parametrize("task", ["mmlu", "hellaswag"])
def test_every_mmlu_and_hellaswag_prompt_tokenizes_as_lm_eval(task):
    """All 14,042 MMLU / 10,042 HellaSwag 5-shot prompts: `encode_choices` (the fast, cut path) equals
    lm-eval's `_encode_pair` with the transformers tokenizer, and `encode` of each whole text (context
    + continuation) equals tokenizing it whole. The reference is batched in chunks (memory)."""
    t0 = time.perf_counter()
    ids, pairs = task_pairs(task)
    enc = TextEncoder.for_model(embedded_model_dir())
    assert enc.splittable is True
    t1 = time.perf_counter()
    got = enc.encode_choices(pairs)
    t2 = time.perf_counter()
    assert len(got) == len(pairs)

    hf = hf_tokenizer()
    mismatches, first, t_ref, t_enc, n_texts = 0, None, 0.0, 0.0, 0
    chunk = 1000
    for start in range(0, len(pairs), chunk):
        texts, spans = [], []
        for context, conts in pairs[start:start + chunk]:
            ctx, wholes = choice_texts(context, conts)
            spans.append((len(texts), len(wholes)))
            texts += [ctx] + wholes
        n_texts += len(texts)
        s = time.perf_counter()
        ref = hf(texts, add_special_tokens=False)["input_ids"]
        t_ref += time.perf_counter() - s
        s = time.perf_counter()
        whole = enc.encode(texts)
        t_enc += time.perf_counter() - s
        for j, (k, n) in enumerate(spans):
            problem = difference(got[start + j], split_choices(ref[k], ref[k + 1:k + 1 + n]), whole[k:k + 1 + n],
                                 ref[k:k + 1 + n])
            if problem:
                mismatches += 1
                if first is None:
                    first = f"{ids[start + j]!r}: {problem}"
    print(f"\n{task}: {len(pairs)} instances, {n_texts} texts; load {t1 - t0:.1f}s, encode_choices "
          f"{t2 - t1:.1f}s, encode(whole texts) {t_enc:.1f}s, transformers reference {t_ref:.1f}s")
    assert mismatches == 0, f"{mismatches} of {len(pairs)} {task} instances differ from lm-eval; first: {first}"


# ---- random texts -------------------------------------------------------------------------------
FRAGMENTS = [
    "a", "b", "Z", "x", "word", "The", "Answer", "Answer:", "0", "7", "42", "1234", "3.5",
    " ", "  ", "   ", "\n", "\n\n", "\r\n", "\r", "\t", " \n", "\n ", "\t\n",
    ".", ":", ",", "'", '"', "-", "(", ")", "?", "!", "...", ".\n", ":\n\n",
    "'s", "'t", "'re", "'ll", "'S", "don't", "it's",
    "é", "É", "日本", "語", "ß", "Ω", "😀", "👍🏽", "e\u0301", "\u0301", "a\u0308", "\u0627\u0644",
    "\xa0", "\u3000", "\u2028", "\x85", "\x0b", "\x0c", "\x1c",
    "<|endoftext|>", "<|im_start|>",
]
CHARS = "aZ09 \n\r\t.:,'\"-()é日😀\u0301\xa0"

fragment = st.one_of(st.sampled_from(FRAGMENTS), st.text(alphabet=CHARS, min_size=1, max_size=3))
random_text = st.lists(fragment, max_size=24).map("".join)
word = st.text(alphabet="abcXYZ019", min_size=1, max_size=5)
continuation = st.one_of(
    st.tuples(st.just(" "), word, random_text).map("".join),    # " word...": the space cut
    st.tuples(st.just(" "), random_text).map("".join),
    st.tuples(st.sampled_from(["\n", "\n\n", "\r\n", " \n"]), random_text).map("".join),
    random_text,                                                # no leading space (or empty)
    st.sampled_from([" A", " B", " 1", "A", "\nA", " é", " 日本"]),
)
context = st.one_of(
    random_text,
    st.tuples(random_text, st.sampled_from(["", " ", "\n", "\n\n", ":", ": ", "\nAnswer:", " \n "])).map("".join),
)
random_pairs = st.lists(st.tuples(context, st.lists(continuation, min_size=1, max_size=4)), min_size=1, max_size=3)

KINDS = ["embedded", "qwen2", "qwen2-nfc", "llama3"]


def check_encoder(enc: TextEncoder, tok: Tokenizer, ref_encode, texts, pairs) -> None:
    want = [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]
    assert enc.encode(texts) == want
    good = [(c, conts) for c, conts in pairs if c.rstrip()]
    if good:
        got = enc.encode_choices(good)
        assert got == [lm_eval_choices(ref_encode, c, conts) for c, conts in good]
    for c, conts in pairs:
        if not c.rstrip():      # lm-eval would use a prefix token here; lmbatch refuses
            with pytest.raises(ValueError):
                enc.encode_choices([(c, conts)])


@pytest.mark.parametrize("kind", KINDS)
def test_pre_tokenizers_are_splittable(kind):
    enc = TextEncoder(tokenizer_kind(kind))
    assert enc.splittable is True
    if kind.startswith("qwen2"):
        spec = json.loads(tokenizer_kind(kind).to_str())
        assert spec["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] == QWEN2_PATTERN
        assert _splittable(spec)


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=300, deadline=None)
@given(texts=st.lists(random_text, min_size=1, max_size=6), pairs=random_pairs)
def test_random_texts_tokenize_as_whole(kind, texts, pairs):
    tok = tokenizer_kind(kind)
    if kind == "embedded":
        hf = hf_tokenizer()
        ref_encode = functools.partial(hf.encode, add_special_tokens=False)
    else:
        ref_encode = functools.partial(raw_ids, tok)
    shared = shared_encoder(kind)
    assert shared.splittable
    check_encoder(shared, tok, ref_encode, texts, pairs)
    fresh = fresh_encoder(kind)     # (building a TextEncoder parses its tokenizer.json: ~70 ms)
    fresh.clear()
    check_encoder(fresh, tok, ref_encode, texts, pairs)
    # the same texts again, now wholly from the memo, and as contexts and continuations of each other
    assert shared.encode(texts[::-1]) == [raw_ids(tok, t) for t in texts[::-1]]
    extra = [(texts[0], texts[1:] + [" " + t for t in texts])]
    check_encoder(shared, tok, ref_encode, [], extra)


# a program's calls: each round's texts continue the last round's (a line cut, an output, more)
step = st.tuples(st.sampled_from(["\nStep 1:", "\nIs it right?", "\n1.", "\nA", "", " Q:", "\n\nZ"]),
                 random_text).map("".join)


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=150, deadline=None)
@given(starts=st.lists(random_text, min_size=1, max_size=3), rounds=st.lists(
    st.tuples(st.lists(st.tuples(st.integers(0, 10), step), min_size=1, max_size=4), st.booleans()),
    min_size=1, max_size=4))
def test_texts_that_continue_earlier_ones_tokenize_as_whole(kind, starts, rounds):
    """Texts that begin with an earlier round's take those ids up to a line cut (`KnownPrefixes`) and
    still tokenize as whole texts, as contexts of choices too."""
    tok = tokenizer_kind(kind)
    enc = fresh_encoder(kind)
    enc.clear()
    enc.prefixes.next_round()
    texts = list(starts)
    assert enc.encode(texts) == [raw_ids(tok, t) for t in texts]
    for picks, as_choices in rounds:
        enc.prefixes.next_round()
        texts = [texts[k % len(texts)] + more for k, more in picks]
        if as_choices and all(t.rstrip() for t in texts):
            got = enc.encode_choices([(t, [" yes", " no"]) for t in texts])
            assert got == [lm_eval_choices(functools.partial(raw_ids, tok), t, [" yes", " no"]) for t in texts]
        else:
            assert enc.encode(texts) == [raw_ids(tok, t) for t in texts]


def test_a_text_that_continues_an_earlier_one_takes_its_ids():
    """The ids up to the earlier text's last line cut are taken, not made again; two rounds that encode
    other texts on, forgotten (a round that encodes nothing does not count)."""
    enc = TextEncoder(tokenizer_kind("qwen2"))
    first = "Question: two and two?\nAnswer: Let's think.\nStep 1:"
    enc.encode([first])
    assert not enc.prefixes.now         # off until a round starts (a caller of one kind of text: lm-eval's)
    enc.prefixes.next_round()
    enc.encode([first])
    enc.prefixes.next_round()
    later = first + " 2 + 2 = 4\nIs this step correct? Answer yes or no:"
    ids, at = enc.prefixes.find(later)
    assert at == first.index("Step 1:") and ids == raw_ids(tokenizer_kind("qwen2"), first[:at])
    assert enc.encode_choices([(later, [" yes"])])[0][0] == raw_ids(tokenizer_kind("qwen2"), later)
    enc.prefixes.next_round()
    enc.prefixes.next_round()
    assert enc.prefixes.find(later) is not None
    enc.encode(["Other\nText"])
    enc.prefixes.next_round()
    assert enc.prefixes.find(later) is None
    # only at a line cut: where its newline is followed by no letter or digit, the text is not cut there
    enc.encode(["Intro\nStep 1:"])
    enc.prefixes.next_round()
    for text in ("Intro\n\nStep", "Intro\n Step", "Intro\n\n\n1", "Intro\n", "Intro\n.\nA"):
        assert enc.encode([text]) == [raw_ids(tokenizer_kind("qwen2"), text)], text


@pytest.mark.parametrize("kind", KINDS)
def test_cut_examples(kind):
    """Hand-picked texts at the cut rules' edges."""
    texts = ["a\nb", "a\n\nb", "a \nb", "a\n \nb", "a\r\nb", "x.\n\nAnswer: B", ".\n1", "a\n\n\n12345",
             "\n", "\nA", "A\n", "\n\n", " \n", "a\n", "\n\nThe", "\u3000\nX", "\xa0\nX", "\x85\nX",
             "it's\nI'm\n'S", "é\né\nE\u0301", "<|im_start|>\nA<|im_end|>\nB", "日本\n語\n1"]
    tok = tokenizer_kind(kind)
    enc = TextEncoder(tok)
    assert enc.encode(texts) == [raw_ids(tok, t) for t in texts]
    pairs = [("Question: 2+2?\nAnswer:", [" 4", " four", "4", "\n4", " 4\n", " é", " (4)"]),
             ("x\n\nAnswer: ", ["A", " A", "\nA", "B\n"]),
             ("end.", [" Then", " then x\ny", "\nNext", " 12"]),
             ("a\n", [" b", "b", "\n\nb"]),
             ("(", [" a", " 1", "a"])]
    assert enc.encode_choices(pairs) == [lm_eval_choices(functools.partial(raw_ids, tok), c, cs)
                                         for c, cs in pairs]


# ---- tokenizers the cut rules do not hold for -------------------------------------------------
FALLBACK_TEXTS = ["hello world\nfoo bar", "foo\nbar\n\nhello", "a\nb c\nd", "hello\nworld foo"]


def word_level() -> Tokenizer:
    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "foo": 3, "bar": 4, "a": 5, "b": 6, "c": 7, "d": 8}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok


def metaspace() -> Tokenizer:
    """A SentencePiece-style tokenizer: Metaspace marks spaces, and the start, with "▁"."""
    vocab = {"[UNK]": 0, "▁hello": 1, "hello": 2, "▁world": 3, "world": 4, "\n": 5, "▁foo": 6, "foo": 7,
             "▁bar": 8, "bar": 9, "▁": 10}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split("\n", "isolated"),
                                                 pre_tokenizers.Metaspace()])
    return tok


def set_pre(**changes):
    def edit(spec):
        spec["pre_tokenizer"] = {**spec["pre_tokenizer"], **changes}
    return edit


def add_newline_token(spec):
    spec["added_tokens"].append({"id": len(spec["model"]["vocab"]), "content": "\nhello", "single_word": False,
                                 "lstrip": False, "rstrip": False, "normalized": False, "special": False})


def split_then_regex(spec):
    """Qwen2's Split, then a ByteLevel that splits again by GPT-2's regex."""
    spec["pre_tokenizer"] = split_pre_tokenizer(QWEN2_PATTERN)
    spec["pre_tokenizer"]["pretokenizers"][1]["use_regex"] = True


UNSPLITTABLE = {
    "word-level": word_level,
    "metaspace": metaspace,
    "byte-level-prefix-space": lambda: edited(set_pre(add_prefix_space=True)),
    "byte-level-no-regex": lambda: edited(set_pre(use_regex=False)),
    "nfkc": lambda: edited(lambda s: s.update(normalizer={"type": "NFKC"})),
    "added-token-with-newline": lambda: edited(add_newline_token),
    "split-then-byte-level-regex": lambda: edited(split_then_regex),
    # a Split whose words take the newlines before them: not Qwen2's / Llama-3's pattern
    "split-other-pattern": lambda: edited(with_pre(r"\s*[^\s]+|\s+")),
}
# where cutting would give other ids (or fail): the fallback is what makes them right
# (not "split-other-pattern": this vocabulary has no merge of a newline with a letter)
CUTTING_BREAKS = {"metaspace", "byte-level-prefix-space", "added-token-with-newline"}


@pytest.mark.parametrize("kind", list(UNSPLITTABLE))
def test_unsplittable_tokenizers_encode_whole_texts(kind):
    tok = UNSPLITTABLE[kind]()
    enc = TextEncoder(tok)
    assert enc.splittable is False
    want = [raw_ids(tok, t) for t in FALLBACK_TEXTS]
    assert enc.encode(FALLBACK_TEXTS) == want
    assert enc.encode(FALLBACK_TEXTS) == want     # from the memo
    pairs = [("hello world\nfoo", [" bar", "\nbar", " hello\nworld"]), ("foo\nbar ", ["hello", "\nworld"])]
    assert enc.encode_choices(pairs) == [lm_eval_choices(functools.partial(raw_ids, tok), c, cs)
                                         for c, cs in pairs]
    if kind in CUTTING_BREAKS:
        forced = TextEncoder(tok)
        forced.splittable = True
        try:
            cut = forced.encode(FALLBACK_TEXTS)
        except RuntimeError:        # the check on the dropped letter's token caught it
            cut = None
        assert cut != want, "the fallback texts do not exercise the cut"


def test_for_model_falls_back_to_transformers(tmp_path):
    """A model folder whose tokenizer.json is not splittable: the transformers tokenizer's own."""
    spec = json.loads(embedded_spec())
    spec["pre_tokenizer"]["add_prefix_space"] = True
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    (tmp_path / "tokenizer_config.json").write_text((embedded_model_dir() / "tokenizer_config.json").read_text())
    enc = TextEncoder.for_model(tmp_path)
    assert enc.splittable is False
    assert enc.encode(FALLBACK_TEXTS) == [enc.hf.encode(t, add_special_tokens=False) for t in FALLBACK_TEXTS]


def test_for_model_tokenizes_as_autotokenizer_even_where_it_rebuilds_the_file(tmp_path):
    """transformers rebuilds a qwen2 folder's pre-tokenizer as Qwen2's, whatever its tokenizer.json
    says (here the embedded GPT-2-style one): lmbatch must use the ids lm-eval gets, not the file's."""
    from transformers import AutoTokenizer, Qwen2Config

    Qwen2Config(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2).save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_text((embedded_model_dir() / name).read_text())
    from lmbatch.programs import mmlu

    context = mmlu.instances(LoadArgs(None, 5, 1, ["anatomy"], 0))[0].inputs["context"]
    texts = [context, context + " B", "x  12345 y\n\n\nz"]
    hf = AutoTokenizer.from_pretrained(tmp_path)
    want = [hf.encode(t, add_special_tokens=False) for t in texts]
    raw = [e.ids for e in Tokenizer.from_file(str(tmp_path / "tokenizer.json")).encode_batch(texts,
                                                                                             add_special_tokens=False)]
    assert raw != want, "transformers no longer rebuilds this tokenizer: the test lost its point"
    enc = TextEncoder.for_model(tmp_path)
    assert enc.encode(texts) == want
    assert enc.encode_choices([(context, [" A", " B"])]) == [mmlu.encode_choices(hf, context, [" A", " B"])]


def test_for_model_caches_what_autotokenizer_made(tmp_path, monkeypatch):
    """Where lmbatch cannot make the tokenizer itself (here: a transformers version model/tokenizer.py does
    not mirror), transformers makes it once: a second encoder of the same folder comes from the cache
    without transformers' tokenizer (made on first use of `hf`), with the same ids where AutoTokenizer
    rebuilt the file (a qwen2 folder); any change to the folder's files makes another entry."""
    from transformers import Qwen2Config

    import lmbatch.model.tokenizer_build as tokenizer_module
    from lmbatch.frontend.tokenize import tokenizer_cache_file

    monkeypatch.setattr(tokenizer_module, "_validated", lambda: False)
    monkeypatch.setenv("LMBATCH_CACHE", str(tmp_path / "cache"))
    model = tmp_path / "m"
    Qwen2Config(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2).save_pretrained(model)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model / name).write_text((embedded_model_dir() / name).read_text())
    texts = ["x  12345 y\n\n\nz", "Question: what is 2+2?\nAnswer: 4"]
    first = TextEncoder.for_model(model)
    assert first.hf_source.loaded and tokenizer_cache_file(model).read_text() == first.spec
    second = TextEncoder.for_model(model)
    assert not second.hf_source.loaded, "the cached tokenizer should not need transformers'"
    assert second.spec == first.spec and second.encode(texts) == first.encode(texts)
    assert second.hf.backend_tokenizer.to_str() == second.spec and second.hf_source.loaded
    before = tokenizer_cache_file(model)
    (model / "tokenizer_config.json").write_text((model / "tokenizer_config.json").read_text().replace("}", ' }'))
    assert tokenizer_cache_file(model) != before


# ---- OLMES's token ids: context and continuation encoded on their own ---------------------------
@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=100, deadline=None)
@given(pairs=random_pairs)
def test_encode_separate_encodes_each_text_alone(kind, pairs):
    """olmo_eval's rule: the context's ids and each continuation's as each text alone (no trailing
    whitespace moved, no EOS); GPT-2-style tokenizers add no BOS. An empty text is refused."""
    tok = tokenizer_kind(kind)
    enc = shared_encoder(kind)
    assert enc.bos_prefix == []
    for c, conts in pairs:
        want = (raw_ids(tok, c), [raw_ids(tok, x) for x in conts])
        if want[0] and all(want[1]):
            assert enc.encode_separate([(c, conts)]) == [want]
        else:
            with pytest.raises(ValueError):
                enc.encode_separate([(c, conts)])


def test_encode_separate_puts_the_bos_a_tokenizer_adds_before_the_context():
    """A tokenizer whose post-processor adds a BOS (Llama's, Gemma's) has it before every context, as
    olmo_eval adds one where the tokenizer has a BOS; never before a continuation."""
    from tokenizers import processors

    tok = tokenizer_kind("embedded")
    bos = tok.token_to_id("<|im_start|>")
    tok.post_processor = processors.TemplateProcessing(single="<|im_start|> $A", special_tokens=[("<|im_start|>", bos)])
    enc = TextEncoder(tok)
    assert enc.bos_prefix == [bos]
    ctx, (cont,) = enc.encode_separate([("Question: what?\nAnswer:", [" yes"])])[0]
    assert ctx == [bos] + raw_ids(tok, "Question: what?\nAnswer:") and cont == raw_ids(tok, " yes")
