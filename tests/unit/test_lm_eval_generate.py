"""lm-eval's generate_until requests as engine requests: a seed per (task, document, repeat), and the
generated text cut as lm-eval's HF backend cuts it (think_end_token, stop strings)."""
from __future__ import annotations

import pytest
import torch
from lm_eval.api.instance import Instance

from lmbatch.engine.sampling import sample_on_device
from lmbatch.errors import UserError
from lmbatch.lm_eval.generate import generated_text, request_seeds, think_end
from lmbatch.requests import SamplingParams

SAMPLED = {"until": ["Q:"], "do_sample": True, "temperature": 1.0, "max_gen_toks": 16}


def _doc(task: str, doc_id: int, gen: dict | None = None, repeats: int = 4) -> Instance:
    return Instance(request_type="generate_until", doc={}, arguments=(f"Q{doc_id}", gen or SAMPLED), idx=0,
                    metadata=(task, doc_id, repeats))


def _as_lm_eval_hands_them(instances: list[Instance]) -> list[Instance]:
    return [inst for inst in instances for _ in range(inst.repeats)]     # lm-eval's evaluator: [req] * repeats


def test_each_repeat_gets_its_own_seed_and_the_same_one_again():
    docs = [_doc("sc", d) for d in range(3)]
    seeds = request_seeds(_as_lm_eval_hands_them(docs))
    assert len(seeds) == 12 and len(set(seeds)) == 12
    assert all(0 <= s < 2 ** 62 for s in seeds)
    assert request_seeds(_as_lm_eval_hands_them(docs)) == seeds          # the same command, the same seeds
    # a request's seed does not depend on what else is in the call: doc 1 alone, or beside another task
    alone = request_seeds(_as_lm_eval_hands_them(docs[1:2]))
    assert alone == seeds[4:8]
    mixed = request_seeds(_as_lm_eval_hands_them([_doc("other", 0), docs[1]]))
    assert mixed[4:] == alone and not set(mixed[:4]) & set(seeds)


def test_the_run_seed_is_lm_evals_torch_seed_or_the_gen_kwargs_seed():
    docs = _as_lm_eval_hands_them([_doc("sc", 0)])
    own = torch.initial_seed()
    try:
        torch.manual_seed(1234)         # as lm-eval's evaluator sets it (--seed's third value)
        first = request_seeds(docs)
        torch.manual_seed(7)
        assert set(request_seeds(docs)).isdisjoint(first)
        torch.manual_seed(1234)
        assert request_seeds(docs) == first
    finally:
        torch.manual_seed(own)
    given = _as_lm_eval_hands_them([_doc("sc", 0, {**SAMPLED, "seed": 5})])
    assert request_seeds(given) == request_seeds(_as_lm_eval_hands_them([_doc("sc", 0, {**SAMPLED, "seed": "5"})]))
    assert set(request_seeds(given)).isdisjoint(request_seeds(_as_lm_eval_hands_them([_doc("sc", 0,
                                                                                            {**SAMPLED, "seed": 6})])))
    with pytest.raises(UserError, match=r"^gen_kwargs seed=x: use a whole number$"):
        request_seeds([_doc("sc", 0, {**SAMPLED, "seed": "x"})])


def test_per_request_seeds_draw_independent_tokens_whatever_the_batch():
    """The engine's sampler (PyTorch path; the CUDA kernel hashes the same (seed, step, token)): rows of
    the same logits with their own seeds draw different tokens, and a row draws the same token alone or
    beside others."""
    logits = torch.zeros(1, 5000).repeat(8, 1)      # uniform: every token as likely
    seeds = request_seeds(_as_lm_eval_hands_them([_doc("sc", 0), _doc("sc", 1)]))
    params = [SamplingParams(temperature=1.0, seed=s) for s in seeds]
    together = sample_on_device(logits, params, [3] * 8, fused=False).tolist()
    assert len(set(together)) == 8
    alone = [sample_on_device(logits[:1], [p], [3], fused=False).item() for p in params]
    assert alone == together
    same_seed = sample_on_device(logits, [SamplingParams(temperature=1.0, seed=0)] * 8, [3] * 8, fused=False)
    assert len(set(same_seed.tolist())) == 1        # what every repeat drew before: one seed for all


def test_think_end_token_is_read_as_lm_evals_hf_backend_reads_it():
    assert think_end(None) is None and think_end("") is None
    assert think_end("151668") == 151668 and think_end(151668) == 151668 and think_end(7.0) == 7
    assert think_end("</think>") == "</think>"
    with pytest.raises(UserError, match=r"^--model_args think_end_token=True: "):
        think_end(True)


def test_generated_text_drops_the_thinking_part_then_cuts_at_stops():
    words = {1: "<think>", 2: " hmm", 3: "</think>", 4: "\n The", 5: " answer", 6: " Q:", 7: " more"}

    def decode(ids: list[int]) -> str:
        return "".join(words[i] for i in ids)

    ids = [1, 2, 3, 2, 3, 4, 5, 6, 7]
    assert generated_text(ids, decode, ["Q:"], None) == "<think> hmm</think> hmm</think>\n The answer "
    assert generated_text(ids, decode, ["Q:"], "</think>") == "The answer "
    assert generated_text(ids, decode, ["Q:"], 3) == "The answer "          # after the last id 3, left-stripped
    assert generated_text([2, 5], decode, ["Q:"], 3) == "hmm answer"         # no marker: all of it, left-stripped
