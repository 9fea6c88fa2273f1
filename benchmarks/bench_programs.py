"""LM-program benchmark (HellaSwag, tree of thought on GSM8K), every variant in one process on the
same programs and the same weights (`seconds`: model work, every wave of the programs; `start_s`:
the programs' first pass, which tokenizes their first-stage calls, as the baseline's tokenization):
lmbatch (DFS waves), the paper's ablations (fcfs, random, no
cache) and, for HellaSwag, plain transformers (lm-eval's loglikelihood with padded batches).

    # GPU, SmolLM2-135M shape with dummy weights:
    python benchmarks/bench_programs.py --workload hellaswag --shots 10 --preset smollm2-135m \
        --tokenizer .gpu/tok --variants dfs,fcfs,random,nocache,hf
    python benchmarks/bench_programs.py --workload tot-gsm8k --preset smollm2-135m --tokenizer .gpu/tok
    python benchmarks/bench_programs.py --workload tot-gsm8k --preset smollm2-135m --tokenizer .gpu/tok \
        --variants dfs,cascade     # cascade: --attention cascade (a program's rows read their prompt once a step)
    python benchmarks/bench_programs.py --workload json --variants dfs,nojump,percall --repeat 3
                                              # embedded model (real weights: real outputs); jump-forward
                                              # off; grammar compiled per request
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from bench_mmlu import _reset, shared_models

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))     # baseline.py: the transformers reference

ROOT = Path(__file__).resolve().parent.parent


def _timed(acc: dict[str, float], key: str, fn):
    """`fn`, adding the seconds of each call to acc[key]."""
    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            acc[key] = acc.get(key, 0.0) + time.perf_counter() - t
    return wrapper


def _phases(lmbatch, name, instances) -> None:
    """Where a run's wall time goes (--phases), without extra device syncs: the interpreter vs the
    engine, the engine's prefill (until decoding starts), decode and the rest; of decode, the
    steps with a full pool of rows and the tail after the queue ran dry; and the host calls inside
    (`_forward` launches a step, of which `run` is the graph replay's; `_mask_ahead` fills masks
    until the step's logits are in, `sample` waits for what is left of it)."""
    from lmbatch.engine import Engine
    from lmbatch.engine.decode import Decode
    from lmbatch.engine.model_runner import ModelRunner
    from lmbatch.engine.prefill import Prefill
    from lmbatch.engine.sampler import Sampler
    from lmbatch.frontend.interpreter import Interpreter
    clock = time.perf_counter
    acc: dict[str, float] = {}
    marks: dict[str, float] = {}
    stream, decode_all, step, execute = Engine.stream, Decode.run_all, Decode.step, Interpreter.execute

    def add(key, dt):
        acc[key] = acc.get(key, 0.0) + dt

    def t_stream(self, *a, **k):        # generators: the time between their first and last step
        marks["run"] = clock()
        try:
            yield from stream(self, *a, **k)
        finally:
            add("engine", clock() - marks["run"])

    def t_decode_all(self):
        t = clock()
        add("prefill", t - marks["run"])
        yield from decode_all(self)
        add("decode", clock() - t)

    def t_step(self):
        t, tail = clock(), not self.queue and len(self.running) < self.max_running
        n = step(self)
        add("tail" if tail else "full", clock() - t)
        add("tail_steps" if tail else "full_steps", 1)
        return n

    import lmbatch.engine.sampler as sampler_mod
    import lmbatch.grammar as grammar_mod
    from lmbatch.engine.graphs import DecodeGraphs

    sample_rows = Sampler.pick

    def t_sample(self, rows, logits):   # a step's first tokens (from prompt logits) apart from the rest
        t = clock()
        picked = sample_rows(self, rows, logits)
        add("first_tokens" if rows[0].steps == 1 else "sampling", clock() - t)
        return picked
    patched = [(Engine, "stream", t_stream), (Decode, "run_all", t_decode_all), (Decode, "step", t_step),
               (Interpreter, "execute", _timed(acc, "execute", execute)), (Sampler, "pick", t_sample)]
    patched += [(o, a, _timed(acc, a, getattr(o, a))) for o, a in
                [(Decode, "_release"), (Sampler, "_jump"), (ModelRunner, "decode"), (Decode, "admit"),
                 (Prefill, "flush"), (Sampler, "_mask_ahead"), (DecodeGraphs, "run"), (grammar_mod, "accept_tokens"),
                 (grammar_mod, "retokenize_jump"), (sampler_mod, "sample")]]
    originals = [(o, a, getattr(o, a)) for o, a, _ in patched]
    for o, a, fn in patched:
        setattr(o, a, fn)
    try:
        seconds = lmbatch(name, instances)[2]
    finally:
        for o, a, fn in originals:
            setattr(o, a, fn)
    print(f"--- {name}: {seconds:.3f} s; " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) and not
          k.endswith("steps") else f"{k} {int(v)}" for k, v in acc.items()))


def _step_trace(lmbatch, name, instances) -> None:
    """Where a run's time goes (--profile, CUDA only): seconds in the engine's main host calls, rows
    and synchronized wall time of every decode step, the longest outputs, then the GPU kernels."""
    from lmbatch.engine.decode import Decode
    from lmbatch.engine.model_runner import ModelRunner
    from lmbatch.engine.prefill import Prefill
    from lmbatch.engine.sampler import Sampler
    steps, forward = [], ModelRunner.decode

    def traced(self, rows):
        tokens = sum(len(r.out) - r.fed for r in rows)
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = forward(self, rows)
        torch.cuda.synchronize()
        steps.append((len(rows), tokens, time.perf_counter() - t))
        return out
    ModelRunner.decode = traced
    flushes, flush = [], Prefill.flush

    def traced_flush(self):
        n = self.batch.num_tokens
        torch.cuda.synchronize()
        t = time.perf_counter()
        flush(self)
        torch.cuda.synchronize()
        if n:
            flushes.append((n, time.perf_counter() - t))
    Prefill.flush = traced_flush
    import lmbatch.engine.sampler as sampler_mod
    import lmbatch.grammar as grammar_mod
    spent: dict[str, float] = {}
    patched = [(grammar_mod, "fill_masks"), (grammar_mod, "accept_tokens"), (sampler_mod, "sample"),
               (Sampler, "_jump"), (Prefill, "flush"), (Decode, "_release"), (Sampler, "pick")]
    originals = [getattr(o, a) for o, a in patched]

    for (o, a), fn in zip(patched, originals):
        setattr(o, a, _timed(spent, a, fn))
    t = time.perf_counter()
    interp = lmbatch(name, instances)[0]
    total = time.perf_counter() - t
    for (o, a), fn in zip(patched, originals):
        setattr(o, a, fn)
    ModelRunner.decode, Prefill.flush = forward, flush
    print(f"--- {name}: seconds in " + ", ".join(f"{k} {v:.3f}" for k, v in spent.items()))
    n = len(steps)
    fwd = sum(s[2] for s in steps)
    small = sum(1 for s in steps if s[0] < 32)
    gens = sorted((p.meta["steps"], p.meta["output_tokens"], p.value) for r in interp.runs for p in r.calls
                  if "steps" in p.meta)
    if gens:
        print(f"--- {name}: steps per output p50 {gens[len(gens) // 2][0]} p90 {gens[len(gens) * 9 // 10][0]} "
              f"max {gens[-1][0]}; longest: {gens[-3:]}")
    print(f"--- {name}: {len(flushes)} prefill forwards, {sum(f[1] for f in flushes):.3f} s in them, "
          f"{sum(f[0] for f in flushes)} tokens; sizes {[f[0] for f in flushes]}")
    print(f"--- {name}: {n} decode forwards, {fwd:.3f} s of {total:.3f} s in them; {small} with < 32 rows; "
          f"rows per step: {[s[0] for s in steps]}")
    by_size: dict[int, list[float]] = {}
    for rows_, toks, sec in steps:
        by_size.setdefault(next(b for b in (8, 16, 32, 64, 128, 256, 384, 512, 1 << 30) if toks <= b), []).append(sec)
    print(f"--- {name}: tokens per decode forward {sum(s[1] for s in steps) / max(n, 1):.1f}; ms per forward by "
          "tokens: " + ", ".join(f"<={b}: {len(v)} x {1e3 * sum(v) / len(v):.2f}" for b, v in sorted(by_size.items())))
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        lmbatch(name, instances)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="hellaswag", choices=["hellaswag", "tot-gsm8k", "json"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--preset", help="presets/<name>/config.json with dummy weights (default: the embedded model)")
    ap.add_argument("--tokenizer", help="tokenizer folder (default: the embedded model's)")
    ap.add_argument("--shots", type=int, default=0)
    ap.add_argument("--limit", type=int)
    ap.add_argument("--variants", default="dfs,fcfs,random,nocache")
    ap.add_argument("--max-tokens-per-batch", type=int, default=16384)
    ap.add_argument("--kv-cache-tokens", type=int, default=131072)
    ap.add_argument("--max-running", type=int, default=256, help="generations decoded together at most")
    ap.add_argument("--hf-batch-tokens", type=int, default=32768)
    ap.add_argument("--out", default="results/bench_programs.parquet")
    ap.add_argument("--repeat", type=int, default=1,
                    help="rounds of timed runs, each running every variant once (percall: the first only); "
                         "medians are reported")
    ap.add_argument("--masks", default="overlap", choices=["overlap", "lazy", "eager"],
                    help="when grammar rows fill their token masks (lmbatch.engine.sampler.MASK_MODES)")
    ap.add_argument("--profile", action="store_true", help="print where the host time of each variant goes")
    ap.add_argument("--phases", action="store_true", help="print each variant's wall time by phase (no extra syncs)")
    args = ap.parse_args()

    from baseline import first_selects, score_pairs
    from transformers import AutoTokenizer

    from lmbatch.engine import Engine
    from lmbatch.frontend.calls import CallOptions
    from lmbatch.frontend.interpreter import Interpreter
    from lmbatch.frontend.workload import LoadArgs
    from lmbatch.model.embedded import embedded_model_dir
    from lmbatch.programs.registry import get_workload

    dev = torch.device(args.device)
    dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
    tok = AutoTokenizer.from_pretrained(args.tokenizer or str(embedded_model_dir()))
    model_dir = ROOT / "presets" / args.preset if args.preset else embedded_model_dir()
    w = get_workload(args.workload)
    instances = w.instances(LoadArgs(tok, args.shots, args.limit))
    hf, model, cfg = shared_models(model_dir, bool(args.preset), dev, dtype)

    def lmbatch(name: str, insts):
        jump = name != "nojump"
        interp = Interpreter(tok, CallOptions(max_len=cfg.max_position_embeddings, vocab_size=cfg.vocab_size,
                                              jump_forward=jump, grammar_cache=name != "percall"),
                             schedule={"fcfs": "fcfs", "random": "random"}.get(name, "dfs"))
        t = time.perf_counter()
        interp.start(w.program, insts)              # first pass of every program: tokenizes stage 0
        t_start = time.perf_counter() - t
        eng = Engine(model, kv_cache_tokens=args.kv_cache_tokens, max_tokens_per_batch=args.max_tokens_per_batch,
                     cache=name != "nocache", tokenizer=tok, jump_forward=jump, max_running=args.max_running,
                     attention="cascade" if name == "cascade" else None,
                     masks=args.masks)
        t = time.perf_counter()
        interp.execute(eng)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t
        interp.engine = None    # its KV pool goes with it (--repeat keeps every run's interpreter)
        return interp, t_start, seconds

    rows, preds = [], {}
    names = args.variants.split(",")
    runs: dict[str, list] = {}      # the timed runs of each lmbatch variant
    for name in names:
        if name == "hf":
            continue
        lmbatch(name, instances[:32])                                    # warm-up: kernels, graphs
        _reset(dev)
        if args.phases:
            for _ in range(2):
                _phases(lmbatch, name, instances)
        if args.profile:
            import cProfile
            import pstats
            prof = cProfile.Profile()
            interp, t_start, seconds = prof.runcall(lmbatch, name, instances)
            print(f"--- {name}: {seconds:.3f} s under the profiler")
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)
            _step_trace(lmbatch, name, instances)
            runs[name] = [lmbatch(name, instances)]
    # Timed runs in rounds, each round running every variant once: a host that speeds up or slows
    # down during the benchmark (the small model's steps are host-bound) shifts every variant alike
    # and leaves each round's ratios unchanged.
    lm_names = [n for n in names if n != "hf"]
    # `percall` runs in the first round only: its model work is dfs's, and what it measures (compiling
    # every request's grammar in the first pass) takes a minute a run on the 8B shape's vocabulary.
    if not args.profile:
        for rnd in range(args.repeat):
            for name in lm_names:
                if name != "percall" or rnd == 0:
                    runs.setdefault(name, []).append(lmbatch(name, instances))
    for name in names:
        if name == "hf":
            t = time.perf_counter()
            choices = first_selects(w.program, instances, tok)
            t_start = time.perf_counter() - t
            score_pairs(hf, choices[:16], args.hf_batch_tokens)      # warm-up
            _reset(dev)
            base = score_pairs(hf, choices, args.hf_batch_tokens)
            preds[name] = base.predictions
            rows.append(dict(variant=name, seconds=base.seconds, start_s=t_start,
                             programs_per_s=len(instances) / base.seconds,
                             prompt_tokens=base.prompt_tokens, computed_tokens=base.prompt_tokens))
            continue
        timed = sorted(runs[name], key=lambda x: x[2])
        interp, t_start, seconds = timed[len(timed) // 2]
        first = runs[lm_names[0]]
        ratios = [r[2] / f[2] for r, f in zip(runs[name], first)]
        s = interp.stats
        if w.answer:
            preds[name] = [r.state.meta(w.answer)["index"] for r in interp.runs]
        metrics = [w.score(i, r.state) for i, r in zip(instances, interp.runs)]
        bad = [r.state["json"] for m, r in zip(metrics, interp.runs) if m.get("complete") and not m.get("valid")]
        if bad:
            print(f"{name}: {len(bad)} complete outputs fail validation, e.g. {bad[:3]}")
        gens = [p.meta for r in interp.runs for p in r.calls if "steps" in p.meta]
        rows.append(dict(variant=name, seconds=seconds, start_s=t_start, programs_per_s=len(instances) / seconds,
                         prompt_tokens=s.prompt_tokens, computed_tokens=s.computed_tokens,
                         decode_tokens=s.decode_tokens,
                         hit_rate=s.hit_rate, optimal_hit_rate=s.optimal_hit_rate,
                         hit_ratio=s.hit_rate / s.optimal_hit_rate if s.optimal_hit_rate else None,
                         prompt_tree_optimal=interp.prompt_tree_optimal_hit_rate, waves=interp.waves,
                         forward_batches=s.forward_batches, evicted_tokens=s.evicted_tokens, masked_rows=s.masked_rows,
                         resampled_rows=s.resampled_rows,
                         acc=sum(m.get("acc", 0) for m in metrics) / len(metrics),
                         total_s=t_start + seconds, programs_per_s_total=len(instances) / (t_start + seconds),
                         steps_per_output=sum(g["steps"] for g in gens) / max(len(gens), 1),
                         max_steps=max((g["steps"] for g in gens), default=0),
                         tokens_per_output=sum(g["output_tokens"] for g in gens) / max(len(gens), 1),
                         valid=sum(m.get("valid", 0) for m in metrics) / len(metrics),
                         compilations=interp.grammars.compiled_count if interp.grammars else 0,
                         peak_mem_gib=torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else None,
                         runs_s=[round(r[2], 4) for r in runs[name]],
                         # seconds / the first variant's, in each round (median): no jump-forward's
                         # time over jump-forward's is jump-forward's gain
                         vs_first=statistics.median(ratios)))
    base_s = next((r["seconds"] for r in rows if r["variant"] == "hf"), None)
    for row in rows:
        row["speedup_vs_hf"] = base_s / row["seconds"] if base_s else None
        if "dfs" in preds and row["variant"] in preds:
            p = preds[row["variant"]]
            row["agree_dfs"] = sum(a == b for a, b in zip(p, preds["dfs"])) / len(p)
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    print(f"\n{name}, {args.workload}, {len(instances)} programs, {args.preset or 'embedded SmolLM2-135M'}")
    keys = list(dict.fromkeys(k for r in rows for k in r))
    print(" | ".join(keys))
    for r in rows:
        print(" | ".join(f"{r.get(k):.4g}" if isinstance(r.get(k), float) else str(r.get(k)) for k in keys))
    for r in rows:
        if "vs_first" in r:
            print(f"{r['variant']}: median {r['seconds']:.3f} s of runs {r['runs_s']}; {r['vs_first']:.3f} x the "
                  f"time of {lm_names[0]} (median of the rounds' ratios)")
    print(json.dumps(rows))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.Table.from_pylist(rows), out)


if __name__ == "__main__":
    main()
