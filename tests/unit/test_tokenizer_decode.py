"""`TextDecoder` (lmbatch/model/tokenizer.py) decodes a run's generated tokens without importing transformers:
the text must equal transformers' `AutoTokenizer.from_pretrained(folder).decode(ids, ...)` for every id sequence.

Why this needs a test of its own: transformers 5's decode is the backend tokenizer's decode and then, where
the folder's tokenizer_config.json sets clean_up_tokenization_spaces, a clean-up of spaces before
punctuation that it skips for BPE models (unless told otherwise). The backend tokenizer is the one
`build_tokenizer` makes (rebuilt by some classes with their own decoder, special and added tokens flagged as
transformers flags them), so the decoder is right only where both the tokenizer and the clean-up rule are.
Checked on the folders of tests/unit/test_tokenizer_build.py (every family's layout: Qwen2, Llama 2 and 3,
Gemma 2 and 3, Mistral, Phi-3, OLMo 2, GPT-NeoX/OLMo, GPT-2), the project's test tokenizers, the embedded
SmolLM2 (converted from its GGUF), and folders that set the clean-up flags on a BPE and on a WordPiece
tokenizer: random ids over the whole vocabulary (special and added tokens included), the ids of varied
texts with and without special tokens, and cuts of those (a sequence that starts or ends inside a
character), with and without skip_special_tokens and every clean-up setting. Nothing is downloaded.
"""
from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
from test_tokenizer_build import RECIPES, TEXTS, auto_tokenizer, corpus, write_folder
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from lmbatch.model.checkpoint import resolve_model
from lmbatch.model.tokenizer import LazyTokenizer, TextDecoder
from lmbatch.model.tokenizer_build import build_tokenizer

REPO = Path(__file__).resolve().parents[2]


def id_sequences(tok: Tokenizer, size: int, seed: int = 0) -> list[list[int]]:
    """Random ids over the vocabulary (added tokens included), the ids of TEXTS with and without special
    tokens, and random cuts of those."""
    rng = random.Random(seed)
    seqs = [[], [0], [size - 1]]
    seqs += [[rng.randrange(size) for _ in range(rng.randint(1, 40))] for _ in range(300)]
    texts = [tok.encode(t, add_special_tokens=k % 4 == 0).ids for k, t in enumerate(TEXTS)]
    seqs += texts
    for ids in texts[:150]:
        if len(ids) > 2:
            a = rng.randrange(len(ids) - 1)
            seqs.append(ids[a:rng.randrange(a + 1, len(ids) + 1)])
    seqs += [ids * 2 for ids in texts[:20]]
    return seqs


def first_difference(decoder: TextDecoder, hf, seqs: list[list[int]]) -> str | None:
    for ids in seqs:
        for skip in (False, True):
            for clean in (None, True, False):
                kw = {} if clean is None else {"clean_up_tokenization_spaces": clean}
                mine, ref = decoder.decode(ids, skip, clean), hf.decode(ids, skip_special_tokens=skip, **kw)
                if mine != ref:
                    return f"skip_special_tokens={skip}, clean_up={clean}, ids {ids}:\n  ours {mine!r}\n  hf   {ref!r}"
    return None


def assert_same_text(folder: Path) -> None:
    from transformers import PreTrainedTokenizerBase, TokenizersBackend

    hf = auto_tokenizer(folder)
    # the decode this mirrors: no class build_tokenizer makes has its own
    assert type(hf)._decode is TokenizersBackend._decode and type(hf).decode is PreTrainedTokenizerBase.decode
    tok = build_tokenizer(folder)
    decoder = TextDecoder.of(folder, tok)
    assert (diff := first_difference(decoder, hf, id_sequences(tok, len(hf)))) is None, diff


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    from test_tokenizer_build import source_specs

    specs = source_specs()
    root = tmp_path_factory.mktemp("decode_folders")
    return {name: write_folder(root / name, specs[src], tc, model_type, **extra)
            for name, (src, tc, model_type, _, extra) in RECIPES.items()}


@pytest.mark.parametrize("name", list(RECIPES))
def test_same_text_as_transformers(name, folders):
    assert_same_text(folders[name])


def test_embedded_model():
    """SmolLM2-135M-Instruct, the tokenizer converted from its GGUF file."""
    assert_same_text(resolve_model(None))


def test_test_tokenizers(tiny_tok, tmp_path):
    from conftest import make_small_tokenizer

    assert_same_text(tiny_tok)
    make_small_tokenizer(tmp_path / "small")
    assert_same_text(tmp_path / "small")


def wordpiece() -> dict:
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=False)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(corpus(), trainers.WordPieceTrainer(vocab_size=800, special_tokens=["[UNK]", "[SEP]"],
                                                                show_progress=False))
    tok.add_special_tokens([AddedToken("[SEP]", special=True)])
    return json.loads(tok.to_str())


@pytest.mark.parametrize("flags", [{"clean_up_tokenization_spaces": True},
                                   {"clean_up_tokenization_spaces": True,
                                    "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output": True}])
def test_clean_up_flags(flags, folders, tmp_path):
    """The clean-up: ignored for BPE unless forced, applied to a WordPiece tokenizer's text (which has spaces
    before punctuation to clean)."""
    bpe = tmp_path / "bpe"
    src = folders["pttf_llama_qwenjson"]
    write_folder(bpe, json.loads((src / "tokenizer.json").read_text()),
                 {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", **flags}, "llama")
    assert_same_text(bpe)
    wp = write_folder(tmp_path / "wordpiece", wordpiece(), {"tokenizer_class": "PreTrainedTokenizerFast",
                                                             "sep_token": "[SEP]", **flags}, "llama")
    assert_same_text(wp)
    decoder = TextDecoder.of(wp, build_tokenizer(wp))
    ids = build_tokenizer(wp).encode("Hello, world. don't", add_special_tokens=False).ids
    assert decoder.decode(ids) == "Hello, world. don't" != decoder.decode(ids, clean_up_tokenization_spaces=False)


def test_lazy_tokenizer_decodes_without_transformers(folders):
    """LazyTokenizer.decode: transformers' text, and its tokenizer never made; in a fresh interpreter,
    transformers is not imported at all."""
    folder = folders["qwen2_qwenjson"]
    hf = auto_tokenizer(folder)
    lazy = LazyTokenizer(folder)
    ids = build_tokenizer(folder).encode(TEXTS[17], add_special_tokens=False).ids
    assert lazy.decode(ids) == hf.decode(ids)
    assert lazy.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)
    assert not lazy.loaded
    assert lazy.decode([ids, ids[:3]]) == hf.decode([ids, ids[:3]])      # a batch: transformers decodes it
    from lmbatch.frontend.tokenize import TextEncoder

    run_side = TextEncoder.for_model(folder).hf_source        # what a run's engine decodes with
    assert run_side.decode(ids) == hf.decode(ids) and not run_side.loaded
    code = ("import json, sys\n"
            "from lmbatch.model.tokenizer import LazyTokenizer\n"
            "lazy = LazyTokenizer(sys.argv[1])\n"
            "lazy.ready_to_decode()\n"
            "text = lazy.decode(json.loads(sys.argv[2]))\n"
            "print(json.dumps({'transformers': 'transformers' in sys.modules, 'text': text}))\n")
    run = subprocess.run([sys.executable, "-c", code, str(folder), json.dumps(ids)], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout) == {"transformers": False, "text": hf.decode(ids)}


def test_fallback_folder_decodes_with_transformers(folders, tmp_path):
    """A folder build_tokenizer does not make (here: a legacy added_tokens.json): transformers decodes."""
    import shutil

    folder = tmp_path / "legacy"
    shutil.copytree(folders["pttf_llama_qwenjson"], folder)
    (folder / "added_tokens.json").write_text(json.dumps({"<new>": 2000}))
    lazy = LazyTokenizer(folder)
    assert lazy.decoder() is None
    lazy.ready_to_decode()
    assert lazy.loaded
    assert lazy.decode([5, 6, 7]) == auto_tokenizer(folder).decode([5, 6, 7])


def test_generation_imports_no_transformers():
    """The engine's side of a run that generates without grammars (tree of thought): the sampler picks tokens,
    searches stop strings and gives the output's text (the embedded model's tokenizer, as a run holds it)
    without importing transformers, nor xgrammar (lmbatch.grammar imports both)."""
    code = (
        "import json, sys, torch\n"
        "from lmbatch.engine.sampler import Sampler\n"
        "from lmbatch.engine.state import Running\n"
        "from lmbatch.frontend.tokenize import TextEncoder\n"
        "from lmbatch.model.checkpoint import resolve_model\n"
        "from lmbatch.model.config import ModelConfig\n"
        "from lmbatch.requests import SamplingParams\n"
        "folder = resolve_model(None)\n"
        "enc = TextEncoder.for_model(folder)\n"
        "cfg = ModelConfig.from_dir(folder)\n"
        "sampler = Sampler(cfg, torch.device('cpu'), tokenizer=enc.hf_source)\n"
        "ids = enc.encode(['Step 1: 3 * 12 = 36.\\nStep 2'])[0]\n"
        "rows = [Running(0, None, None, 1, SamplingParams(max_new_tokens=50, stop=('\\n',))),\n"
        "        Running(1, None, None, 1, SamplingParams(max_new_tokens=50, temperature=0.7, seed=3))]\n"
        "for t in ids:\n"
        "    logits = torch.full((2, cfg.vocab_size), -1e9)\n"
        "    logits[:, t] = 0.0\n"
        "    sampler.pick([r for r in rows if not r.finish], logits[:sum(not r.finish for r in rows)])\n"
        "print(json.dumps({'modules': sorted(m for m in ('transformers', 'xgrammar', 'lmbatch.grammar')\n"
        "                                    if m in sys.modules),\n"
        "                  'texts': [sampler.text(r) for r in rows], 'finish': [r.finish for r in rows]}))\n")
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout) == {"modules": [], "texts": ["Step 1: 3 * 12 = 36.", "Step 1: 3 * 12 = 36.\nStep 2"],
                                      "finish": ["stop", ""]}
