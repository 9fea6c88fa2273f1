"""Accuracy fidelity on the embedded model: lmbatch vs plain transformers on real 5-shot MMLU prompts,
two questions from each of the 57 subjects."""
import pytest
from baseline import first_selects, load_hf, score_choices
from transformers import AutoTokenizer

from lmbatch.engine import Engine
from lmbatch.frontend.workload import LoadArgs
from lmbatch.model.embedded import embedded_model_dir
from lmbatch.programs import mmlu
from lmbatch.requests import ScoreRequest


@pytest.mark.slow
def test_mmlu_predictions_match_transformers():
    path = embedded_model_dir()
    tok = AutoTokenizer.from_pretrained(str(path))
    instances = first_selects(mmlu.program, mmlu.instances(LoadArgs(tok, 5, 1)), tok)
    assert len(instances) == 57         # a question of every subject
    reqs = [ScoreRequest(inst.context, c) for inst in instances for c in inst.continuations]
    results, stats = Engine.from_pretrained(path, kv_cache_tokens=32768).score(reqs)
    assert stats.hit_rate == pytest.approx(stats.optimal_hit_rate, abs=1e-12)
    ours = [results[4 * k:4 * k + 4] for k in range(len(instances))]
    base = score_choices(load_hf(path), instances)
    agree = sum(max(range(4), key=lambda c: res[c].logprob) == p for res, p in zip(ours, base.predictions))
    assert agree >= len(instances) - 1, f"{agree}/{len(instances)} predictions agree"
    worst = max(abs(r.logprob - b) for res, lps in zip(ours, base.logprobs) for r, b in zip(res, lps))
    assert worst < 2e-3, worst
