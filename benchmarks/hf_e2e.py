"""Plain transformers, end to end: the job of `lmbatch run mmlu|hellaswag --shots K`, done the way a
user of transformers would, as one fresh process timed phase by phase. The baseline of bench_e2e.py.

    # GPU (what bench_e2e.py runs; the model folder as `lmbatch run --model` takes it):
    python benchmarks/hf_e2e.py --task mmlu --shots 5 --model results/e2e-models/qwen2.5-1.5b --device cuda
    python benchmarks/hf_e2e.py --task hellaswag --shots 5 --model results/e2e-models/qwen2.5-1.5b --device cuda
    # CPU, the embedded model, a few questions:
    python benchmarks/hf_e2e.py --task mmlu --shots 1 --limit 2 --subjects abstract_algebra --device cpu \
        --model ~/.cache/lmbatch/models/SmolLM2-135M-Instruct

Same prompts as lmbatch (its own data and prompt functions, see `task_items`), tokenized as lm-eval's
HF backend `_encode_pair` does, and scored as its `_loglikelihood_tokens` does: requests sorted
longest first, padded batches, one forward per batch; requests with the same input (context +
continuation[:-1]: MMLU's four one-token choices) share one forward (lm-eval's group_by="contexts");
a continuation's logprob is the sum of its tokens'. Two things a careful user does on top, neither
changing a number: batches are left-padded so that the LM head runs only at the last positions
(logits_to_keep), and tokenization is one batched (multi-threaded) call. Writes OUT/predictions.parquet
(one row per question) and OUT/summary.json (accuracy, counts, `time_s` per phase, `wall_s`).
"""
from __future__ import annotations

import time

T_START = time.perf_counter()   # before the heavy imports: "imports" is a phase

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402


@dataclass
class Item:
    """One question: its prompt, its continuations (texts), the gold index."""
    id: str
    subject: str | None
    context: str
    continuations: list[str]
    gold: int


def task_items(task: str, shots: int, limit: int | None, subjects: list[str] | None, seed: int):
    """The questions of `task` with lmbatch's own prompts, and the acc_norm rule (None: acc only).
    The one place that names lmbatch's data/prompt functions: adapt here if they move."""
    if task == "mmlu":
        from lmbatch.programs import mmlu
        items = [Item(f"{q.subject}/{q.index}", q.subject, mmlu.build_context(q.subject, shots, q),
                      list(mmlu.CONTINUATIONS), q.answer) for q in mmlu.load_questions(subjects, limit)]
        return items, None
    if task == "hellaswag":
        from lmbatch.programs import hellaswag
        if subjects:
            raise SystemExit("error: --subjects applies to mmlu only")
        items = [Item(str(d.index), None, hellaswag.build_context(d, shots, seed), hellaswag.continuations(d), d.gold)
                 for d in hellaswag.load_docs(limit)]
        return items, hellaswag.lm_eval_acc_norm
    raise SystemExit(f"error: --task {task}: use mmlu or hellaswag")


def encode_pairs(tok, items: list[Item]) -> list[tuple[list[int], list[int]]]:
    """lm-eval HFLM `_encode_pair` for every (context, continuation): the context's trailing
    whitespace moves onto the continuation; whole = tok(ctx + cont), cont = whole[len(tok(ctx)):]."""
    ctxs, wholes = [], []
    for it in items:
        n = len(it.context) - len(it.context.rstrip())
        ctx = it.context[:-n] if n else it.context
        for cont in it.continuations:
            ctxs.append(ctx)
            wholes.append(it.context + cont)
    unique = list(dict.fromkeys(ctxs))
    ids = tok(unique + wholes, add_special_tokens=False)["input_ids"]
    ctx_ids = dict(zip(unique, ids[:len(unique)]))
    pairs = []
    for ctx, whole in zip(ctxs, ids[len(unique):]):
        c = ctx_ids[ctx]
        if not c:
            raise SystemExit("error: empty context (lm-eval would insert a prefix token here)")
        pairs.append((c, whole[len(c):]))
    return pairs


def score(model, pairs, batch_tokens: int, device) -> tuple[list[float], dict]:
    """Sum of each continuation's token logprobs given its context, as lm-eval's HF backend."""
    import torch

    groups: dict[tuple, list[int]] = {}          # forward input -> the requests it scores
    for i, (ctx, cont) in enumerate(pairs):
        groups.setdefault(tuple(ctx + cont[:-1]), []).append(i)
    inputs = sorted(groups, key=lambda s: (-len(s), s))      # lm-eval's order: longest first
    vals, owners, batches = [], [], 0
    with torch.inference_mode():
        k = 0
        while k < len(inputs):
            width = len(inputs[k])
            batch = inputs[k:k + max(1, batch_tokens // width)]
            k += len(batch)
            keep = max(len(pairs[i][1]) for s in batch for i in groups[s])
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            mask = torch.zeros(len(batch), width, dtype=torch.long)
            rows, cols, targets = [], [], []
            for r, s in enumerate(batch):
                ids[r, width - len(s):] = torch.tensor(s)
                mask[r, width - len(s):] = 1
                for i in groups[s]:                  # the last len(cont) positions predict cont
                    cont = pairs[i][1]
                    rows += [r] * len(cont)
                    cols += range(keep - len(cont), keep)
                    targets += cont
                    owners += [i] * len(cont)
            pos = (mask.cumsum(-1) - 1).clamp(min=0)
            logits = model(input_ids=ids.to(device), attention_mask=mask.to(device), position_ids=pos.to(device),
                           logits_to_keep=keep).logits
            lp = logits[rows, cols].float().log_softmax(-1)
            vals.append(lp[torch.arange(len(targets), device=device), torch.tensor(targets, device=device)])
            batches += 1
        flat = torch.cat(vals).tolist()              # the one device sync
    out = [0.0] * len(pairs)
    for i, v in zip(owners, flat):
        out[i] += v
    return out, {"forward_inputs": len(inputs), "batches": batches, "input_tokens": sum(map(len, inputs))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--task", required=True, choices=["mmlu", "hellaswag"])
    ap.add_argument("--shots", type=int, default=0)
    ap.add_argument("--limit", type=int, help="first N questions (per subject for mmlu, as lmbatch run)")
    ap.add_argument("--subjects", help="mmlu only: comma-separated subject names")
    ap.add_argument("--seed", type=int, default=0, help="hellaswag shots seed (lmbatch run's --seed, default 0)")
    ap.add_argument("--model", required=True, help="HF model folder (with its tokenizer)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--batch-tokens", type=int, help="padded tokens per forward (default 32768 cuda, 8192 cpu)")
    ap.add_argument("--out", default="results/hf_e2e", help="output folder (predictions.parquet, summary.json)")
    args = ap.parse_args()
    model_dir = Path(args.model).expanduser()
    if not (model_dir / "config.json").is_file():
        raise SystemExit(f"error: --model {model_dir}: no config.json there")
    if args.limit is not None and args.limit < 1:
        raise SystemExit("error: --limit must be at least 1")
    batch_tokens = args.batch_tokens or (32768 if args.device == "cuda" else 8192)
    time_s: dict[str, float] = {}

    def lap(name: str, t: float) -> float:
        now = time.perf_counter()
        time_s[name] = now - t
        return now

    t = T_START
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lmbatch.errors import UserError
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda: no CUDA GPU is visible here")
    t = lap("imports", t)

    subjects = args.subjects.split(",") if args.subjects else None
    try:
        items, acc_norm = task_items(args.task, args.shots, args.limit, subjects, args.seed)
    except UserError as e:
        raise SystemExit(f"error: {e}") from None
    if not items:
        raise SystemExit("error: no questions")
    t = lap("data", t)

    tok = AutoTokenizer.from_pretrained(model_dir)
    pairs = encode_pairs(tok, items)
    t = lap("tokenize", t)

    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa",
                                                 device_map=args.device).eval()
    longest = max(len(c) + len(x) for c, x in pairs)
    max_pos = getattr(model.config, "max_position_embeddings", None)
    if max_pos and longest > max_pos:
        raise SystemExit(f"error: a request needs {longest} tokens, more than the model's {max_pos}")
    if dev.type == "cuda":
        torch.cuda.synchronize()
    t = lap("load", t)
    print(f"hf_e2e: {args.task} {args.shots}-shot, {len(items)} questions, {len(pairs)} pairs, "
          f"{dtype} on {args.device}", flush=True)

    lps, counts = score(model, pairs, batch_tokens, dev)
    t = lap("score", t)

    import pyarrow as pa
    import pyarrow.parquet as pq

    rows, k = [], 0
    for it in items:
        lp = lps[k:k + len(it.continuations)]
        k += len(it.continuations)
        pred = max(range(len(lp)), key=lp.__getitem__)        # ties: first index, as np.argmax
        row = dict(task=args.task, subject=it.subject, id=it.id, gold=str(it.gold), prediction=str(pred),
                   correct=pred == it.gold, logprobs=lp)    # strings, as lmbatch's instances.parquet
        if acc_norm is not None:
            row["prediction_norm"] = acc_norm(lp, it.continuations)
            row["correct_norm"] = row["prediction_norm"] == it.gold
        rows.append(row)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), out / "predictions.parquet")
    metrics = {"acc": sum(r["correct"] for r in rows) / len(rows)}
    if acc_norm is not None:
        metrics["acc_norm"] = sum(r["correct_norm"] for r in rows) / len(rows)
    t = lap("write", t)
    time_s["total"] = t - T_START
    summary = {
        "task": args.task, "shots": args.shots, "limit": args.limit, "subjects": subjects, "seed": args.seed,
        "model": str(model_dir), "device": args.device,
        "device_name": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
        "dtype": str(dtype).removeprefix("torch."), "batch_tokens": batch_tokens,
        "versions": {"torch": torch.__version__, "transformers": __import__("transformers").__version__,
                     "python": sys.version.split()[0]},
        "counts": {"instances": len(items), "pairs": len(pairs), **counts},
        "accuracy": metrics["acc"], "metrics": metrics, "hit_rate": None,
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else None,
        "time_s": time_s, "wall_s": time_s["total"],
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    phases = "  ".join(f"{k} {v:.2f}s" for k, v in time_s.items())
    print(f"hf_e2e: acc {metrics['acc']:.4f}" + (f"  acc_norm {metrics['acc_norm']:.4f}" if acc_norm else "")
          + f"  {phases}  -> {out}", flush=True)


if __name__ == "__main__":
    main()
