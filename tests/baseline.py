"""Plain transformers scoring, as lm-eval-harness's HF backend does it: the reference for parity
tests and the baseline of the benchmarks (test equipment, not lmbatch: the tests import it as `baseline`, the
benchmarks put tests/ on their path). Length-sorted, left-padded batches; logits at the last
position only; the choices of a question are one-token continuations of its context."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch

if TYPE_CHECKING:
    from pathlib import Path

    from lmbatch.frontend.interpreter import Instance


@dataclass
class ChoiceInstance:
    """One select's token ids: a context and its choices' continuations."""
    context: list[int]
    continuations: list[list[int]]


def first_selects(program: Callable[..., None], instances: list[Instance], tokenizer: Any,
                  max_len: int = 1 << 30) -> list[ChoiceInstance]:
    """The token ids of each instance's first select, exactly as lmbatch runs it (its first pass)."""
    from lmbatch.frontend import Select
    from lmbatch.frontend.calls import CallOptions, select_ids
    from lmbatch.frontend.interpreter import Interpreter

    interp = Interpreter(tokenizer, CallOptions(max_len=max_len))
    interp.start(program, instances)
    first: dict[int, ChoiceInstance] = {}
    for p in interp.ready:
        if isinstance(p.op, Select):
            first.setdefault(p.owner.index, ChoiceInstance(*select_ids(p)))
    return [first[k] for k in range(len(instances))]


@dataclass
class BaselineRun:
    logprobs: list[list[float]]      # per instance, per choice
    predictions: list[int]
    seconds: float
    prompt_tokens: int


def load_hf(path: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> Any:
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, attn_implementation="sdpa")
    return model.to(device).eval()


@torch.inference_mode()
def score_pairs(model: Any, instances: list[ChoiceInstance], batch_tokens: int = 8192,
                full_logits: bool = True) -> BaselineRun:
    """lm-eval's loglikelihood for continuations of any length: each (context + continuation)[:-1]
    runs padded on the right; the continuation's tokens are scored at their positions. With
    full_logits (what lm-eval's HF backend does, and the benchmarks' baseline) the LM head runs at
    every position; without, only at scored ones (same values, faster: the CPU parity test)."""
    device = next(model.parameters()).device
    pairs = [(k, c) for k, inst in enumerate(instances) for c in range(len(inst.continuations))]
    seqs = [(instances[k].context + instances[k].continuations[c])[:-1] for k, c in pairs]
    order = sorted(range(len(pairs)), key=lambda i: -len(seqs[i]))
    out: list[list[float]] = [[0.0] * len(inst.continuations) for inst in instances]
    start = time.perf_counter()
    i = 0
    while i < len(order):
        width = len(seqs[order[i]])
        idx = order[i:i + max(1, batch_tokens // width)]
        i += len(idx)
        ids = torch.zeros(len(idx), width, dtype=torch.long)
        mask = torch.zeros(len(idx), width, dtype=torch.long)
        for row, j in enumerate(idx):
            ids[row, :len(seqs[j])] = torch.tensor(seqs[j])
            mask[row, :len(seqs[j])] = 1
        if full_logits:
            hidden = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
        else:
            hidden = model.model(input_ids=ids.to(device), attention_mask=mask.to(device)).last_hidden_state
        cols: list[int]
        rows, cols, targets, owner = [], [], [], []
        for row, j in enumerate(idx):
            k, c = pairs[j]
            cont = instances[k].continuations[c]
            first = len(instances[k].context) - 1
            rows += [row] * len(cont)
            cols += range(first, first + len(cont))
            targets += cont
            owner += [(k, c)] * len(cont)
        picked_rows = hidden[rows, cols]
        lp = torch.log_softmax(picked_rows.float(), -1) if full_logits else _head(model, picked_rows)
        picked = lp[torch.arange(len(targets), device=device), torch.tensor(targets, device=device)].tolist()
        for (k, c), v in zip(owner, picked):
            out[k][c] += v
    return _finished(out, start, sum(len(s) for s in seqs), device)


def _finished(out: list[list[float]], start: float, tokens: int, device: torch.device) -> BaselineRun:
    """The run of per-instance logprobs `out`, timed from `start` (the device's work waited for)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    preds = [max(range(len(lps)), key=lps.__getitem__) for lps in out]
    return BaselineRun(out, preds, seconds, tokens)


def _head(model: Any, hidden: torch.Tensor) -> torch.Tensor:
    """Log-probabilities from final hidden states: the model's LM head, then Gemma's final soft-cap where set."""
    logits = model.lm_head(hidden)
    if cap := getattr(model.config, "final_logit_softcapping", None):
        logits = torch.tanh(logits / cap) * cap
    return torch.log_softmax(logits.float(), -1)


@torch.inference_mode()
def score_pairs_context_once(model: Any, instances: list[ChoiceInstance], batch_tokens: int = 2048) -> BaselineRun:
    """`score_pairs(full_logits=False)`'s logprobs with each instance's context run once, not once per
    continuation: a batch of contexts (length-sorted, left-padded, as `score_choices`) runs into transformers'
    own KV cache (a DynamicCache); each row of the cache is repeated for its instance's continuations, which
    then run after it in one batch, right-padded (padding only follows a row's real tokens: the causal mask
    keeps it out of them), at positions that go on from their context's. The same causal computation, float
    noise apart; the CPU parity tests' reference where continuations are many and short."""
    import copy
    import inspect

    from transformers import DynamicCache

    device = next(model.parameters()).device
    # transformers 5 calls the cache argument `cache` (`past_key_values` deprecated); 4.x only knows the latter
    cache_kw = "cache" if "cache" in inspect.signature(model.model.forward).parameters else "past_key_values"
    order = sorted(range(len(instances)), key=lambda i: -len(instances[i].context))
    out: list[list[float]] = [[0.0] * len(inst.continuations) for inst in instances]
    tokens = 0
    start = time.perf_counter()
    k = 0
    while k < len(order):
        width = len(instances[order[k]].context)
        idx = order[k:k + max(1, batch_tokens // width)]
        k += len(idx)
        ids = torch.zeros(len(idx), width, dtype=torch.long)
        mask = torch.zeros(len(idx), width, dtype=torch.long)
        for row, i in enumerate(idx):
            ctx = instances[i].context
            ids[row, width - len(ctx):] = torch.tensor(ctx)
            mask[row, width - len(ctx):] = 1
            tokens += len(ctx)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        hidden = model.model(input_ids=ids.to(device), attention_mask=mask.to(device), position_ids=pos.to(device),
                             use_cache=True, **{cache_kw: cache}).last_hidden_state
        first = _head(model, hidden[:, -1])             # each continuation's first token, after its context
        pairs = [(row, i, c) for row, i in enumerate(idx) for c in range(len(instances[i].continuations))]
        for row, i, c in pairs:
            out[i][c] = float(first[row, instances[i].continuations[c][0]])
        # the continuations' later tokens: length-sorted chunks of pairs, each over a copy of its rows' context
        # KV; a quarter of batch_tokens a chunk (on the CPU, 25% faster than whole ones: less padding and KV copied)
        pairs = sorted((p for p in pairs if len(instances[p[1]].continuations[p[2]]) > 1),
                       key=lambda p: -len(instances[p[1]].continuations[p[2]]))
        j = 0
        while j < len(pairs):
            cont_width = len(instances[pairs[j][1]].continuations[pairs[j][2]]) - 1
            chunk = pairs[j:j + max(1, batch_tokens // (4 * cont_width))]
            j += len(chunk)
            owner = torch.tensor([row for row, _, _ in chunk])
            part = copy.deepcopy(cache)
            part.batch_select_indices(owner.to(device))
            cont = torch.zeros(len(chunk), cont_width, dtype=torch.long)
            rows, cols, targets, who = [], [], [], []
            for r, (_, i, c) in enumerate(chunk):
                toks = instances[i].continuations[c]
                cont[r, :len(toks) - 1] = torch.tensor(toks[:-1])
                rows += [r] * (len(toks) - 1)
                cols += range(len(toks) - 1)
                targets += toks[1:]
                who += [(i, c)] * (len(toks) - 1)
                tokens += len(toks) - 1
            cont_mask = torch.cat([mask[owner], torch.ones(len(chunk), cont_width, dtype=torch.long)], 1)
            cont_pos = mask[owner].sum(-1, keepdim=True) + torch.arange(cont_width)[None]
            hidden = model.model(input_ids=cont.to(device), attention_mask=cont_mask.to(device),
                                 position_ids=cont_pos.to(device), use_cache=True, **{cache_kw: part}).last_hidden_state
            lp = _head(model, hidden[rows, cols])
            picked = lp[torch.arange(len(targets), device=device), torch.tensor(targets, device=device)].tolist()
            for (i, c), v in zip(who, picked):
                out[i][c] += v
    return _finished(out, start, tokens, device)


@torch.inference_mode()
def score_choices(model: Any, instances: list[ChoiceInstance], batch_tokens: int = 8192) -> BaselineRun:
    """Each instance's context once; logprob of each one-token choice at the last position."""
    assert all(len(c) == 1 for inst in instances for c in inst.continuations), "one-token choices only"
    device = next(model.parameters()).device
    order = sorted(range(len(instances)), key=lambda i: -len(instances[i].context))
    out: list[list[float]] = [[] for _ in instances]
    start = time.perf_counter()
    k = 0
    while k < len(order):
        width = len(instances[order[k]].context)
        size = max(1, batch_tokens // width)
        idx = order[k:k + size]
        k += size
        ids = torch.zeros(len(idx), width, dtype=torch.long)
        mask = torch.zeros(len(idx), width, dtype=torch.long)
        for row, i in enumerate(idx):
            ctx = instances[i].context
            ids[row, width - len(ctx):] = torch.tensor(ctx)
            mask[row, width - len(ctx):] = 1
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=ids.to(device), attention_mask=mask.to(device), position_ids=pos.to(device),
                       logits_to_keep=1).logits[:, -1].float()
        lp = torch.log_softmax(logits, -1).cpu()
        for row, i in enumerate(idx):
            out[i] = [float(lp[row, c[0]]) for c in instances[i].continuations]
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    preds = [max(range(len(lps)), key=lps.__getitem__) for lps in out]
    return BaselineRun(out, preds, seconds, sum(len(inst.context) for inst in instances))
