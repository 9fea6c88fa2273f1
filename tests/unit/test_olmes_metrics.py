"""OLMES's metrics as lmbatch computes them (programs/olmes.py `predictions`) against OLMo's own code:
olmo_eval/metrics.py's ICLMetric, run on the same loglikelihoods. olmo_eval imports torchmetrics, which is
not installed; its metrics.py is loaded from the installed package's file with stand-ins for the two names
it imports (torchmetrics.Metric: its states as plain lists; .util.all_gather_object: one process), so what
runs is ICLMetric's own update and compute. ICLMetric has no per-token metric and its pmi_dc is not OLMES's
acc_uncond (it divides where OLMES subtracts): those two are checked against OLMES's definitions (oe-eval's
MCAccuracy: logprob / its token count; logprob - the unconditional logprob; ties to the first), from first
principles, with the same counts. The standard error is lm-eval's own mean_stderr."""
from __future__ import annotations

import importlib.util
import math
import random
import sys
import types

import pytest
import torch

from lmbatch.data import package_dir
from lmbatch.programs.olmes import context_groups, predictions
from lmbatch.results.stats import mean_stderr
from lmbatch.results.task_results import metrics_block

VOCAB = 64


@pytest.fixture
def icl_metric(monkeypatch):
    """olmo_eval.metrics.ICLMetric, loaded from its file."""
    class Metric:
        def __init__(self, **kwargs: object) -> None:
            pass

        def add_state(self, name: str, default: list, dist_reduce_fx: object = None) -> None:
            setattr(self, name, list(default))

    monkeypatch.setitem(sys.modules, "torchmetrics", types.SimpleNamespace(Metric=Metric))
    pkg = types.ModuleType("olmo_eval_ref")
    pkg.__path__ = []
    monkeypatch.setitem(sys.modules, "olmo_eval_ref", pkg)
    monkeypatch.setitem(sys.modules, "olmo_eval_ref.util", types.SimpleNamespace(all_gather_object=lambda x: [x]))
    path = package_dir("olmo_eval", "ai2-olmo-eval==0.9.0") / "metrics.py"
    spec = importlib.util.spec_from_file_location("olmo_eval_ref.metrics", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.ICLMetric


def _batch(doc_id: int, label: int, conts: list[str], token_lps: list[list[float]], rng: random.Random):
    """One ICLMetric batch holding a document's requests (as olmo_eval's collate_fn lays them out), and
    logits whose log-softmax gives each continuation token the logprob in `token_lps`."""
    ctx_len, width = 3, 3 + max(len(t) for t in token_lps)
    logits = torch.zeros(len(conts), width, VOCAB, dtype=torch.float64)
    tokens = torch.zeros(len(conts), width, dtype=torch.long)
    for i, lps in enumerate(token_lps):
        for k, lp in enumerate(lps):
            target = rng.randrange(VOCAB)
            tokens[i, k] = target
            rest = math.log((1 - math.exp(lp)) / (VOCAB - 1))
            logits[i, ctx_len - 1 + k] = rest
            logits[i, ctx_len - 1 + k, target] = lp
    return {"doc_id": [doc_id] * len(conts), "cont_id": list(range(len(conts))), "continuation": tokens,
            "cont_len": [len(t) for t in token_lps], "ctx_len": [ctx_len] * len(conts),
            "label_id": [label] * len(conts),
            "cont_str_len": [len(c) for c in conts], "cont_byte_len": [len(c.encode()) for c in conts],
            "cont_str_len_no_leading_space": [len(c) - 1 for c in conts],
            "cont_byte_len_no_leading_space": [len(c[1:].encode()) for c in conts]}, logits


def _document(rng: random.Random) -> tuple[list[str], list[list[float]], int]:
    n = rng.randint(2, 5)
    conts = [" " + "".join(rng.choice("abcdefgh ") for _ in range(rng.randint(1, 40))).strip() + "." for _ in range(n)]
    token_lps = [[-rng.uniform(0.05, 4.0) for _ in range(rng.randint(1, 9))] for _ in range(n)]
    return conts, token_lps, rng.randrange(n)


def test_acc_raw_and_acc_per_char_are_icl_metrics(icl_metric):
    """300 random documents (2 to 5 continuations of 1 to 9 tokens and 2 to 41 characters): each one's
    acc_raw is ICLMetric("acc")'s and its acc_per_char ICLMetric("len_norm")'s (v2: the leading space
    counted, as OLMES counts), document by document and on average."""
    rng = random.Random(0)
    ours = {"acc_raw": [], "acc_per_char": []}
    theirs = {"acc": icl_metric("acc"), "len_norm": icl_metric("len_norm")}
    differ = 0
    for doc_id in range(300):
        conts, token_lps, label = _document(rng)
        batch, logits = _batch(doc_id, label, conts, token_lps, rng)
        logprobs = [sum(t) for t in token_lps]
        picks = predictions(logprobs, [len(t) for t in token_lps], conts)
        differ += picks["acc_raw"] != picks["acc_per_char"]
        for metric_type, ours_name in (("acc", "acc_raw"), ("len_norm", "acc_per_char")):
            one = icl_metric(metric_type)
            one.update(batch, logits)
            theirs[metric_type].update(batch, logits)
            got = float(picks[ours_name] == label)
            assert one.compute()[f"{metric_type}_v2"].item() == got, (doc_id, metric_type)
            ours[ours_name].append(got)
    assert differ > 30          # the two metrics disagree often enough here for the test to tell them apart
    assert theirs["acc"].compute()["acc_v2"].item() == pytest.approx(sum(ours["acc_raw"]) / 300, abs=1e-6)
    assert theirs["len_norm"].compute()["len_norm_v2"].item() == pytest.approx(sum(ours["acc_per_char"]) / 300,
                                                                               abs=1e-6)


def test_acc_per_token_and_acc_uncond_by_their_definitions():
    """Continuations picked differently by each metric: " A" (1 token, -2.0), " Bee" (4 tokens, -3.0),
    " Cccccccccc" (2 tokens, -2.5); unconditional logprobs -0.5, -2.9, -0.2."""
    conts, logprobs, tokens, uncond = [" A", " Bee", " Cccccccccc"], [-2.0, -3.0, -2.5], [1, 4, 2], [-0.5, -2.9, -0.2]
    assert predictions(logprobs, tokens, conts, uncond) == {
        "acc_raw": 0,               # -2.0 is the highest
        "acc_per_token": 1,         # -0.75 per token
        "acc_per_char": 2,          # -2.5 / 11 characters (its leading space counted)
        "acc_uncond": 1,            # -3.0 - -2.9 = -0.1 beats -1.5 and -2.3
    }
    assert "acc_uncond" not in predictions(logprobs, tokens, conts)
    assert predictions([-1.0, -1.0], [1, 1], [" a", " b"], [-1.0, -1.0]) == dict.fromkeys(
        ("acc_raw", "acc_per_token", "acc_per_char", "acc_uncond"), 0)      # ties: the first


def test_winogrande_contexts_pair_with_their_continuations():
    assert context_groups(["c"], [" x", " y"]) == [("c", [" x", " y"])]
    assert context_groups(["c0", "c1"], [" x", " x"]) == [("c0", [" x"]), ("c1", [" x"])]
    with pytest.raises(ValueError):
        context_groups(["c0", "c1"], [" x", " y", " z"])


def test_stderr_is_lm_evals_mean_stderr():
    from lm_eval.api.metrics import mean_stderr as lm_eval_mean_stderr

    rng = random.Random(1)
    for n in (2, 3, 17, 400):
        xs = [float(rng.random() < 0.3) for _ in range(n)]
        assert mean_stderr(xs) == pytest.approx(lm_eval_mean_stderr(xs), rel=1e-12)
    assert mean_stderr([1.0]) is None and mean_stderr([]) is None
    scores = [{"acc": 1.0, "f": 0.5}, {"acc": 0.0}, {"acc": 1.0, "f": 1.0}]
    assert metrics_block(scores) == {"acc": pytest.approx(2 / 3), "acc_stderr": pytest.approx(1 / 3),
                                   "f": 0.75, "f_stderr": pytest.approx(0.25)}
