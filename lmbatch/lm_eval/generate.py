"""lm-eval's `generate_until` requests as engine requests, and the engine's tokens as the text lm-eval's
HF backend returns.

A sampled request's seed is its own: a hash of the run's seed, its task, document, request index and
repeat. lm-eval hands a task's `repeats: k` as the same `Instance` k times in a row, so the repeat is
counted, in order, among the requests of the same (task, document, index). k repeats are k independent
samples (the engine's noise is a pure function of (seed, step, token): engine/sampling.py), the same
command draws the same samples, and a request's draws do not depend on which others share its batch.
The run's seed is a `seed` in the request's gen_kwargs (a task's generation_kwargs, `--gen_kwargs
seed=N`), else lm-eval's torch seed (`--seed`'s third value, 1234 unless given; lm-eval sets it with
`torch.manual_seed` before it builds requests, and the HF backend samples from it)."""
from __future__ import annotations

import hashlib
from collections import Counter
from typing import Any, Callable, Sequence

from lmbatch.errors import UserError
from lmbatch.requests import GenerateRequest, SamplingParams

SEED_BITS = 62      # the engine hashes seeds as int64


def think_end(value: Any) -> int | str | None:
    """`think_end_token` as lm-eval's HF backend reads it: a token id (a number, or a string of digits),
    else the marker's text; None (or empty): no thinking part."""
    if value is None or value == "":
        return None
    if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
        raise UserError(f"--model_args think_end_token={value}: use a token id or the end-of-thinking text")
    if isinstance(value, (int, float)):
        return int(value)
    return int(value) if str(value).isdigit() else str(value)


def run_seed(gen_kwargs: dict[str, Any]) -> int:
    """The seed a request's samples derive from: its gen_kwargs' `seed`, else lm-eval's torch seed."""
    seed = gen_kwargs.get("seed")
    if seed is None:
        import torch

        return int(torch.initial_seed())
    if isinstance(seed, bool) or not (isinstance(seed, int) or (isinstance(seed, str) and seed.lstrip("-").isdigit())):
        raise UserError(f"gen_kwargs seed={seed}: use a whole number")
    return int(seed)


def request_seeds(requests: Sequence[Any]) -> list[int]:
    """One seed per request (lm-eval `Instance`s, in the order lm-eval hands them): a hash of (run seed,
    task, document, request index, repeat), the repeat counted in order among the requests of the same
    (task, document, index)."""
    seen: Counter[tuple[Any, ...]] = Counter()
    out = []
    for req in requests:
        key = (getattr(req, "task_name", None), getattr(req, "doc_id", None), getattr(req, "idx", None))
        repeat = seen[key]
        seen[key] += 1
        base = run_seed(req.args[1]) if len(req.args) > 1 and isinstance(req.args[1], dict) else run_seed({})
        digest = hashlib.blake2b(repr((base, *key, repeat)).encode(), digest_size=8).digest()
        out.append(int.from_bytes(digest, "little") >> (64 - SEED_BITS))
    return out


def engine_requests(lm: Any, requests: Sequence[Any]) -> tuple[list[GenerateRequest], list[list[str]]]:
    """Each request's context as token ids (lm-eval's HF backend's, left-truncated to leave room for
    `max_gen_toks`) with its sampling settings (greedy unless the task samples), and its stop strings
    (the task's `until` and the EOS text). `lm`: the backend (`tok_encode`, `tok_decode`, ...)."""
    from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs

    eos = lm.tok_decode([lm.eot_token_id], skip_special_tokens=False)
    reqs, stops = [], []
    for (context, gen_kwargs), seed in zip((req.args for req in requests), request_seeds(requests)):
        kw = normalize_gen_kwargs(gen_kwargs, lm.max_gen_toks)
        until = handle_stop_sequences(kw.pop("until", None), eos=eos)
        new = int(kw.pop("max_gen_toks"))
        ids = lm.tok_encode(context, left_truncate_len=lm.max_length - new)
        temperature = float(kw.get("temperature", 0.0) or 0.0) if kw.get("do_sample") else 0.0
        reqs.append(GenerateRequest(ids, SamplingParams(max_new_tokens=new, temperature=temperature,
                                                        top_p=float(kw.get("top_p", 1.0) or 1.0), seed=seed,
                                                        stop=tuple(until))))
        stops.append(until)
    return reqs, stops


def generated_text(token_ids: list[int], decode: Callable[[list[int]], str], until: list[str],
                   think_end_token: int | str | None) -> str:
    """The text lm-eval's HF backend returns for these generated tokens: with a token id as
    `think_end_token`, what follows its last occurrence (left-stripped); with a text, what follows its
    last occurrence (left-stripped); then cut at the first stop string."""
    from lm_eval.models.utils import postprocess_generated_text

    if isinstance(think_end_token, int):
        ends = [i for i, t in enumerate(token_ids) if t == think_end_token]
        text = decode(token_ids[ends[-1] + 1:] if ends else token_ids).lstrip()
    else:
        text = decode(token_ids)
    return str(postprocess_generated_text(generation=text, stop=until,
                                          think_end_token=think_end_token if isinstance(think_end_token, str)
                                          else None))
