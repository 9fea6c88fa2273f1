"""OLMES tasks (OLMES-v0.1): OLMo's exact requests, read from the packaged request files
(`lmbatch.data.olmes`), scored with OLMES's metrics. `arc_challenge:rc`, ..., `winogrande:mc`.

Token ids are made as OLMo's evaluator (olmo_eval's `OEEvalTask`) makes them: the context and each
continuation encoded on their own, no EOS, and a BOS before the context only where the model's own
tokenizer adds one when asked for special tokens (Llama's, Gemma's; not SmolLM2's, OLMo's, Qwen's)
(`select(..., encoding="separate")`, `TextEncoder.encode_separate`). A document's requests share one
context, except WinoGrande rc's: there the option fills the blank in the context and the rest of the
sentence is the continuation, so each option is a select of its own over its own context. Every
request of every document goes into the one radix tree of the run, which shares whatever token prefix
they have in common (the five examples, a sentence up to its blank) as it does any prompt's.

Metrics, per document, each 1 when the continuation it picks is the label (OLMES's `MCAccuracy`; ties
go to the first):
- `acc_raw`: the highest summed logprob;
- `acc_per_token`: logprob over the continuation's number of tokens;
- `acc_per_char`: logprob over its number of characters, the leading space counted (OLMES's rule; the
  "v2" of olmo_eval's ICLMetric);
- `acc_uncond`: logprob minus the same continuation's logprob after "Answer:" (the file's unconditional
  requests, `doc_id >= 1000000`), where the file has them (rc, except BoolQ and WinoGrande).
The config's `primary_metric` (acc_raw or acc_per_char for these tasks) is the task's `correct` column
and its entry in summary.json's `tasks` block. olmo_eval's ICLMetric computes acc_raw (its "acc") and
acc_per_char (its "len_norm") from the same logprobs with the same counts (tested); it has no per-token
metric, and its "pmi_dc" divides the two logprobs (and skips the file's unconditional requests), where
OLMES subtracts them: acc_uncond is OLMES's.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Sequence

from lmbatch.data.olmes import FORMATS, TASKS, OlmesConfig, config, data_files, load_docs
from lmbatch.frontend import State, select
from lmbatch.frontend.workload import Instance, LoadArgs, Workload

NAMES = {"arc_challenge": "ARC-Challenge", "arc_easy": "ARC-Easy", "boolq": "BoolQ", "csqa": "CommonsenseQA",
         "hellaswag": "HellaSwag", "openbookqa": "OpenBookQA", "piqa": "PIQA", "socialiqa": "Social IQa",
         "winogrande": "WinoGrande"}
SUFFIX = "::olmes"          # the full alias, arc_challenge:rc::olmes, names the same task


def task_names() -> list[str]:
    """Every OLMES task's name: task:format, task-major."""
    return [f"{t}:{f}" for t in TASKS for f in FORMATS]


def _first_max(scores: Sequence[float]) -> int:
    return scores.index(max(scores))


def predictions(logprobs: Sequence[float], num_tokens: Sequence[int], continuations: Sequence[str],
                uncond: Sequence[float] | None = None) -> dict[str, int]:
    """The continuation each metric picks (see the module's docstring): by logprob, per token, per
    character, and (given the unconditional logprobs) by their difference."""
    out = {"acc_raw": _first_max(logprobs),
           "acc_per_token": _first_max([lp / max(n, 1) for lp, n in zip(logprobs, num_tokens)]),
           "acc_per_char": _first_max([lp / max(len(c), 1) for lp, c in zip(logprobs, continuations)])}
    if uncond is not None:
        out["acc_uncond"] = _first_max([lp - u for lp, u in zip(logprobs, uncond)])
    return out


def context_groups(contexts: Sequence[str], continuations: Sequence[str]) -> list[tuple[str, list[str]]]:
    """Each context with the continuations scored after it: one context for all, or one each."""
    if len(contexts) == 1:
        return [(contexts[0], list(continuations))]
    if len(contexts) != len(continuations):
        raise ValueError(f"{len(contexts)} contexts for {len(continuations)} continuations")
    return [(c, [x]) for c, x in zip(contexts, continuations)]


def program(s: State, contexts: list[str], continuations: list[str], uncond_context: str | None = None,
            primary: str = "acc_raw") -> None:
    """Every request of one document (a fork per context, and one for the unconditional requests), then
    what each metric picks: `s["answer"]` holds the logprobs and the pick of the `primary` metric."""
    groups = context_groups(contexts, continuations)
    forks = s.fork(len(groups) + (uncond_context is not None))
    for f, (ctx, conts) in zip(forks, groups):
        f += ctx + select("choices", conts, encoding="separate")
    if uncond_context is not None:
        forks[-1] += uncond_context + select("uncond", continuations, encoding="separate")
    metas = [f.meta("choices") for f in forks[:len(groups)]]       # waits for the results
    answer: dict[str, Any] = {k: [v for m in metas for v in m[k]] for k in ("logprobs", "is_greedy", "num_tokens")}
    uncond = forks[-1].meta("uncond")["logprobs"] if uncond_context is not None else None
    picks = predictions(answer["logprobs"], answer["num_tokens"], continuations, uncond)
    s["answer"] = {"index": picks[primary], **answer, "predictions": picks}
    if uncond is not None:
        s["uncond_logprobs"] = uncond


def _instances(task: str, fmt: str, args: LoadArgs) -> list[Instance]:
    out = []
    for d in load_docs(task, fmt, args.limit):
        inputs: dict[str, Any] = {"contexts": list(d.contexts), "continuations": list(d.continuations)}
        if d.uncond_context is not None:
            inputs["uncond_context"] = d.uncond_context
        out.append(Instance(str(d.doc_id), inputs, gold=d.label))
    return out


def score(inst: Instance, s: State) -> dict[str, float]:
    return {metric: float(pick == inst.gold) for metric, pick in s.meta("answer")["predictions"].items()}


def _description(c: OlmesConfig) -> str:
    what = "the option's letter" if c.format == "mc" else "the answer text" if c.task != "winogrande" else \
        "each option in the blank, the rest of the sentence"
    split = "test" if c.split == "test" else "validation"
    return (f"OLMES {NAMES[c.task]}, {c.docs:,} {split} docs, {what} scored; {c.shots} curated shots; primary "
            f"{c.primary_metric}")


def workload(name: str) -> Workload:
    """The OLMES task `name` (task:format, or its full alias task:format::olmes)."""
    task, _, fmt = name.removesuffix(SUFFIX).partition(":")
    c = config(task, fmt)
    return Workload(f"{task}:{fmt}", _description(c), partial(program, primary=c.primary_metric),
                    partial(_instances, task, fmt), score, max_shots=c.shots, answer="answer", generates=False,
                    data_files=partial(data_files, task, fmt), primary_metric=c.primary_metric, fixed_shots=c.shots)
