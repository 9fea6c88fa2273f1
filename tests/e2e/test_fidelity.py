"""Accuracy fidelity on the embedded model: lmbatch vs plain transformers on real 5-shot MMLU prompts,
the first question of every third subject (19 of the 57, from the first in name order: among them the
three longest prompts, 1.7k-2.7k tokens)."""
import pytest
from baseline import first_selects, load_hf, score_choices
from transformers import AutoTokenizer

from lmbatch.data.mmlu import subject_names
from lmbatch.engine import Engine
from lmbatch.frontend.workload import LoadArgs
from lmbatch.model.embedded import embedded_model_dir
from lmbatch.programs import mmlu
from lmbatch.requests import ScoreRequest


@pytest.mark.slow
def test_mmlu_predictions_match_transformers():
    path = embedded_model_dir()
    tok = AutoTokenizer.from_pretrained(str(path))
    subjects = subject_names()[::3]
    instances = first_selects(mmlu.program, mmlu.instances(LoadArgs(tok, 5, 1, subjects)), tok)
    assert len(subjects) == 19 and len(instances) == 19       # a question of each subject taken
    assert max(len(inst.context) for inst in instances) > 2048
    reqs = [ScoreRequest(inst.context, c) for inst in instances for c in inst.continuations]
    results, stats = Engine.from_pretrained(path, kv_cache_tokens=32768).score(reqs)
    assert stats.hit_rate == pytest.approx(stats.optimal_hit_rate, abs=1e-12)
    ours = [results[4 * k:4 * k + 4] for k in range(len(instances))]
    # one prompt a forward (batch_tokens=1): no padding, so no attention mask to build and apply; the same
    # values as length-sorted padded batches (float noise apart), in 60% of the time on the CPU
    base = score_choices(load_hf(path), instances, batch_tokens=1)
    agree = sum(max(range(4), key=lambda c: res[c].logprob) == p for res, p in zip(ours, base.predictions))
    assert agree >= len(instances) - 1, f"{agree}/{len(instances)} predictions agree"
    worst = max(abs(r.logprob - b) for res, lps in zip(ours, base.logprobs) for r, b in zip(res, lps))
    assert worst < 2e-3, worst
