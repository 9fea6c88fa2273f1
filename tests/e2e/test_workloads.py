"""HellaSwag and tree-of-thought GSM8K end to end on the embedded model (SmolLM2-135M, float32)."""
import pytest
from baseline import first_selects, load_hf, score_pairs_context_once
from transformers import AutoTokenizer

from lmbatch.engine import Engine
from lmbatch.frontend.calls import CallOptions
from lmbatch.frontend.interpreter import Interpreter
from lmbatch.frontend.workload import LoadArgs
from lmbatch.model.embedded import embedded_model_dir
from lmbatch.programs import hellaswag, tot_gsm8k


def run(workload, args, kv=65536, wave_tokens=None):
    path = embedded_model_dir()
    tok = AutoTokenizer.from_pretrained(str(path))
    insts = workload.instances(LoadArgs(tok, **args))
    interp = Interpreter(tok, CallOptions(max_len=8192))
    interp.start(workload.program, insts)
    interp.execute(Engine.from_pretrained(path, tokenizer=tok, kv_cache_tokens=kv), wave_tokens)
    return interp, insts, tok


@pytest.mark.slow
def test_hellaswag_matches_transformers_on_100_questions():
    interp, insts, tok = run(hellaswag.WORKLOAD, dict(shots=1, limit=100))
    s = interp.stats
    assert s.hit_rate == pytest.approx(s.optimal_hit_rate, abs=1e-12) and interp.waves == 1
    ours = [r.state.meta("answer") for r in interp.runs]
    # transformers runs each question's context once, its four endings after it from its own KV cache
    base = score_pairs_context_once(load_hf(embedded_model_dir()), first_selects(hellaswag.program, insts, tok))
    agree = sum(o["index"] == p for o, p in zip(ours, base.predictions))
    assert agree >= 99, f"{agree}/100 predictions agree with transformers"
    worst = max(abs(a - b) for o, lps in zip(ours, base.logprobs) for a, b in zip(o["logprobs"], lps))
    assert worst < 5e-3, worst
    scores = [hellaswag.score(i, r.state) for i, r in zip(insts, interp.runs)]
    assert {k for sc in scores for k in sc} == {"acc", "acc_norm"}


@pytest.mark.slow
@pytest.mark.parametrize("kv, wave_tokens", [(65536, None), (3072, 1536)])
def test_tree_of_thought_reaches_95_percent_of_the_posthoc_optimum(kv, wave_tokens):
    interp, insts, _ = run(tot_gsm8k.WORKLOAD, dict(limit=2), kv=kv, wave_tokens=wave_tokens)
    s = interp.stats
    assert s.hit_rate >= 0.95 * s.optimal_hit_rate, (s.hit_rate, s.optimal_hit_rate)
    assert s.optimal_hit_rate > interp.prompt_tree_optimal_hit_rate   # decoded tokens count as cached
    n = len(insts)     # per question: 3 proposals, 3 judgements, then 6 and 6 twice, then one answer
    assert {k: c.calls for k, c in interp.stages.items()} == {0: 3 * n, 1: 3 * n, 2: 6 * n, 3: 6 * n, 4: 6 * n,
                                                              5: 6 * n, 6: n}
    assert all(r.error is None and r.state["answer"] is not None for r in interp.runs)
    assert all(set(tot_gsm8k.score(i, r.state)) == {"acc"} for i, r in zip(insts, interp.runs))
