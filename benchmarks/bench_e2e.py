"""End to end, as a user waits for it: `lmbatch run TASK` vs plain transformers (benchmarks/hf_e2e.py),
each a FRESH process timed by this parent (process start to exit: imports, data, tokenizer, model
load, scoring, writing). Rounds run every variant once, in alternating order; the table gives each
variant's median wall time, its own phases (`time_s` of its summary.json, medians; "outside" is
wall minus the process's own total: interpreter start-up and exit), accuracy, lmbatch's hit rate
and the median of the per-round ratios hf wall / lmbatch wall.

    # GPU (H100/H200): Qwen2.5-1.5B shape, random bf16 weights built once under results/e2e-models/
    python benchmarks/bench_e2e.py --preset qwen2.5-1.5b --tasks mmlu,hellaswag --shots 5 --device cuda \
        --warmup --repeat 3
    # the same with lmbatch's larger forward batches
    python benchmarks/bench_e2e.py --preset qwen2.5-1.5b --tasks mmlu,hellaswag --shots 5 --device cuda \
        --warmup --repeat 3 --lmbatch-args "--max-tokens-per-batch 16384"
    # CPU, the embedded model (real weights: both sides should predict the same), a few questions:
    python benchmarks/bench_e2e.py --tasks mmlu --shots 1 --limit 2 --subjects 3 --device cpu \
        --model ~/.cache/lmbatch/models/SmolLM2-135M-Instruct

Sizes, for planning: the transformers side computes every prompt token, about 10M for MMLU 5-shot
(14,042 questions x ~720) and about 17.7M for HellaSwag 5-shot (10,042 x 4 endings x ~440). Where one
command may run at most 10 minutes, run one task per command (--tasks mmlu, then --tasks hellaswag),
with --limit for HellaSwag if needed; --timeout S stops a run that hangs. The preset folder is built
once (seconds on a GPU) and reused by later commands on the same machine.

Writes OUT/e2e-<model>-<device>-<time>.md (the table) and .json (table rows, every round's raw
numbers, prediction agreement); each run's own output stays in OUT/runs/ (the last round's).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER_FILES = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*", "merges.txt",
                   "*.model", "*.jinja")


def build_preset(name: str, target: Path, tokenizer_dir: Path, device: str) -> Path:
    """A random-weight HF folder of presets/NAME's shape (built once: reused when present), with the
    tokenizer files of `tokenizer_dir` (copied every time). The weights are made in a child process,
    so that this one holds no GPU memory while the timed runs go."""
    preset = ROOT / "presets" / name / "config.json"
    if not preset.is_file():
        known = sorted(p.name for p in (ROOT / "presets").iterdir() if (p / "config.json").is_file())
        raise SystemExit(f"error: no preset {name!r} (known: {', '.join(known)})")
    if not (target / "config.json").is_file() or not any(target.glob("*.safetensors")):
        import multiprocessing

        proc = multiprocessing.get_context("spawn").Process(target=_build_weights, args=(preset, target, device))
        proc.start()
        proc.join()
        if proc.exitcode != 0:
            raise SystemExit(f"error: building {target} from {preset} failed (exit code {proc.exitcode}, see above)")
    for pattern in TOKENIZER_FILES:
        for f in tokenizer_dir.glob(pattern):
            shutil.copy(f, target / f.name)
    if not (target / "tokenizer_config.json").is_file() and not (target / "tokenizer.json").is_file():
        raise SystemExit(f"error: no tokenizer files found in {tokenizer_dir}")
    return target


def _build_weights(preset: Path, target: Path, device: str) -> None:
    """Random weights made on `device` (bf16 on cuda, float32 on cpu) by transformers' own init (std
    0.02, norms 1), seeded; saved as safetensors, renamed into place when complete."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda: no CUDA GPU is visible here")
    t = time.perf_counter()
    spec = json.loads(preset.read_text())
    spec.pop("torch_dtype", None)
    cfg = AutoConfig.for_model(spec.pop("model_type"), **spec)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    tmp = target.with_name(f".{target.name}.partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    n = sum(p.numel() for p in model.parameters())
    print(f"built {target} ({preset.parent.name}: {n / 1e9:.2f}B random {str(dtype).removeprefix('torch.')} "
          f"weights) in {time.perf_counter() - t:.1f}s", flush=True)


def lmbatch_cmd() -> list[str]:
    """The console script, as a user runs it (beside this Python, else on PATH)."""
    exe = Path(sys.executable).parent / "lmbatch"
    found = str(exe) if exe.is_file() else shutil.which("lmbatch")
    return [found] if found else [sys.executable, "-m", "lmbatch.cli"]


def run_timed(cmd: list[str], log: Path, timeout: float | None) -> float:
    """Run cmd as a fresh process, output to log; the wall seconds from spawn to exit."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        t = time.perf_counter()
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        wall = time.perf_counter() - t
    if rc != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise SystemExit(f"error: {shlex.join(cmd)}\nexited with {rc} after {wall:.1f}s; its output ({log}):\n{tail}")
    return wall


def one_run(variant: str, task: str, args, model: Path, subjects: list[str], runs: Path) -> dict:
    """Run one variant once; its wall time, summary and the path of its per-question parquet."""
    common = ["--shots", str(args.shots), "--model", str(model), "--device", args.device]
    common += ["--limit", str(args.limit)] if args.limit else []
    if variant == "lmbatch":
        cmd = lmbatch_cmd() + ["run", task, *common, "--quiet", "--out", str(runs), "--run-id", f"{task}-lmbatch",
                               "--overwrite", *[a for s in subjects for a in ("--subjects", s)],
                               *shlex.split(args.lmbatch_args)]
        run_dir, preds = runs / f"{task}-lmbatch", "instances.parquet"
    elif variant == "hf":
        run_dir, preds = runs / f"{task}-hf", "predictions.parquet"
        cmd = [sys.executable, str(ROOT / "benchmarks" / "hf_e2e.py"), "--task", task, *common, "--out", str(run_dir),
               *(["--subjects", ",".join(subjects)] if subjects else []), *shlex.split(args.hf_args)]
    else:
        raise SystemExit(f"error: unknown variant {variant!r} (use lmbatch, hf)")
    (run_dir / "summary.json").unlink(missing_ok=True)
    wall = run_timed(cmd, runs / f"{task}-{variant}.log", args.timeout)
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"variant": variant, "wall_s": wall, "summary": summary, "predictions": str(run_dir / preds),
            "cmd": shlex.join(cmd)}


def agreement(a: str, b: str) -> dict:
    """Questions on which two runs' predictions are equal (of those both answered), and the largest
    difference of a choice's logprob between them."""
    import pyarrow.parquet as pq

    ra, rb = ({r["id"]: r for r in pq.read_table(p, columns=["id", "prediction", "logprobs"]).to_pylist()}
              for p in (a, b))
    common = [k for k in ra if k in rb and ra[k]["prediction"] is not None and rb[k]["prediction"] is not None]
    diff = max((abs(x - y) for k in common for x, y in zip(ra[k]["logprobs"], rb[k]["logprobs"])), default=None)
    return {"equal": sum(ra[k]["prediction"] == rb[k]["prediction"] for k in common), "questions": len(common),
            "max_logprob_diff": diff}


def table_rows(task: str, rounds: list[dict], variants: list[str], top: int) -> list[dict]:
    rows = []
    ratios = [r["hf"]["wall_s"] / r["lmbatch"]["wall_s"] for r in rounds if "hf" in r and "lmbatch" in r]
    for v in variants:
        runs = [r[v] for r in rounds]
        walls = [x["wall_s"] for x in runs]
        keys = dict.fromkeys(k for x in runs for k, val in x["summary"].get("time_s", {}).items()
                             if isinstance(val, (int, float)))
        phases = {k: statistics.median(x["summary"]["time_s"][k] for x in runs if k in x["summary"]["time_s"])
                  for k in keys}
        if "total" in phases:
            phases["outside"] = statistics.median(x["wall_s"] - x["summary"]["time_s"]["total"]
                                                  for x in runs if "total" in x["summary"]["time_s"])
        s = runs[-1]["summary"]
        rows.append({"task": task, "variant": v, "instances": (s.get("counts") or {}).get("instances"),
                     "wall_s": statistics.median(walls), "walls": walls,
                     "phases": dict(sorted(((k, p) for k, p in phases.items() if k != "total"),
                                           key=lambda kv: -kv[1])[:top]),
                     "total_s": phases.get("total"), "accuracy": s.get("accuracy"),
                     "acc_norm": (s.get("metrics") or {}).get("acc_norm"), "hit_rate": s.get("hit_rate"),
                     "optimal_hit_rate": s.get("optimal_hit_rate"),
                     "ratio_hf_over_lmbatch": statistics.median(ratios) if v == "lmbatch" and ratios else None,
                     "round_ratios": ratios if v == "lmbatch" else None})
    return rows


def markdown(rows: list[dict]) -> str:
    def f(x, fmt):
        return "-" if x is None else format(x, fmt)
    out = ["| task | variant | wall s (median) | phases s (median, largest) | accuracy | hit rate / optimum | "
           "hf / lmbatch |", "|---|---|---:|---|---:|---:|---:|"]
    for r in rows:
        acc = f(r["accuracy"], ".4f") + ("" if r["acc_norm"] is None else f" (norm {r['acc_norm']:.4f})")
        hit = "-" if r["hit_rate"] is None else f"{r['hit_rate']:.4f} / {f(r['optimal_hit_rate'], '.4f')}"
        ratio = "-" if r["ratio_hf_over_lmbatch"] is None else (
            f"**{r['ratio_hf_over_lmbatch']:.2f}x** (" + ", ".join(f"{x:.2f}" for x in r["round_ratios"]) + ")")
        phases = ", ".join(f"{k} {v:.2f}" for k, v in r["phases"].items())
        out.append(f"| {r['task']} ({r['instances']}) | {r['variant']} | {r['wall_s']:.2f} | {phases} | {acc} | "
                   f"{hit} | {ratio} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", default="mmlu,hellaswag")
    ap.add_argument("--shots", type=int, default=5)
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--model", help="HF model folder (default: the embedded SmolLM2-135M-Instruct)")
    src.add_argument("--preset", help="presets/NAME: build a random-weight folder of that shape once, use it")
    ap.add_argument("--models-dir", help="the folder --preset builds and reuses (default results/e2e-models/NAME)")
    ap.add_argument("--tokenizer", help="with --preset: tokenizer folder (default: the embedded model's)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--limit", type=int, help="first N questions (per subject for mmlu)")
    ap.add_argument("--subjects", help="mmlu only: comma-separated names, or a number N: the first N subjects")
    ap.add_argument("--repeat", type=int, default=1, help="rounds; each runs every variant once, alternating order")
    ap.add_argument("--warmup", action="store_true", help="one untimed lmbatch run per task first (kernel JIT caches)")
    ap.add_argument("--variants", default="lmbatch,hf")
    ap.add_argument("--lmbatch-args", default="", help='extra args of lmbatch run, e.g. "--max-tokens-per-batch 16384"')
    ap.add_argument("--hf-args", default="", help='extra args of hf_e2e.py, e.g. "--batch-tokens 16384"')
    ap.add_argument("--timeout", type=float, help="seconds one run may take (default: no limit)")
    ap.add_argument("--top", type=int, default=5, help="phases shown per row")
    ap.add_argument("--out", default="results/e2e")
    args = ap.parse_args()
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if args.repeat < 1 or not variants or not tasks:
        raise SystemExit("error: need --repeat >= 1, some --variants and some --tasks")
    if set(variants) - {"lmbatch", "hf"}:
        raise SystemExit(f"error: --variants {args.variants}: use lmbatch and/or hf")
    if args.tokenizer and not args.preset:
        raise SystemExit("error: --tokenizer goes with --preset (a --model folder brings its own tokenizer)")

    from lmbatch.model.embedded import embedded_model_dir
    if args.preset:
        tok_dir = Path(args.tokenizer).expanduser() if args.tokenizer else embedded_model_dir()
        target = (Path(args.models_dir).expanduser() if args.models_dir
                  else ROOT / "results" / "e2e-models" / args.preset)
        model = build_preset(args.preset, target.resolve(), tok_dir, args.device)
    else:
        model = Path(args.model).expanduser().resolve() if args.model else embedded_model_dir()
        if not (model / "config.json").is_file():
            raise SystemExit(f"error: --model {model}: no config.json there")
    subjects: list[str] = []
    if args.subjects:
        from lmbatch.programs import mmlu
        subjects = (mmlu.subject_names()[:int(args.subjects)] if args.subjects.isdigit()
                    else [s.strip() for s in args.subjects.split(",")])
    out = Path(args.out)
    runs = out / "runs"
    print(f"bench_e2e: {model} on {args.device}, tasks {tasks}, {args.shots}-shot, limit {args.limit}, "
          f"subjects {len(subjects) or 'all'}, variants {variants}, {args.repeat} round(s)", flush=True)

    rows, raw, agree, device_name = [], [], {}, args.device
    for task in tasks:
        task_subjects = subjects if task == "mmlu" else []
        if args.warmup and "lmbatch" in variants:
            w = one_run("lmbatch", task, args, model, task_subjects, runs)
            print(f"  {task} warm-up lmbatch {w['wall_s']:.2f}s (untimed)", flush=True)
        rounds = []
        for r in range(args.repeat):
            done = {}
            for v in (variants if r % 2 == 0 else variants[::-1]):
                done[v] = one_run(v, task, args, model, task_subjects, runs)
                s = done[v]["summary"]
                print(f"  {task} round {r + 1} {v:8s} wall {done[v]['wall_s']:7.2f}s  acc {s.get('accuracy')}  "
                      f"time_s {json.dumps({k: round(x, 2) for k, x in s.get('time_s', {}).items()})}", flush=True)
            rounds.append(done)
            device_name = next((x["summary"]["device_name"] for x in done.values() if "device_name" in x["summary"]),
                               device_name)
            raw += [{"task": task, "round": r + 1, "variant": v, "wall_s": x["wall_s"], "cmd": x["cmd"],
                     "time_s": x["summary"].get("time_s"), "accuracy": x["summary"].get("accuracy"),
                     "metrics": x["summary"].get("metrics"), "hit_rate": x["summary"].get("hit_rate"),
                     "optimal_hit_rate": x["summary"].get("optimal_hit_rate"),
                     "counts": x["summary"].get("counts")} for v, x in done.items()]
        rows += table_rows(task, rounds, variants, args.top)
        if "lmbatch" in variants and "hf" in variants:
            agree[task] = agreement(rounds[-1]["lmbatch"]["predictions"], rounds[-1]["hf"]["predictions"])

    head = (f"{device_name}, {args.preset or model.name}, {args.shots}-shot, limit {args.limit}, "
            f"{args.repeat} round(s){', warm-up' if args.warmup else ''}"
            + (f", lmbatch args: {args.lmbatch_args}" if args.lmbatch_args else "")
            + (f", hf args: {args.hf_args}" if args.hf_args else ""))
    text = head + "\n\n" + markdown(rows)
    if agree:
        text += "\n\npredictions lmbatch = hf (last round): " + ", ".join(
            f"{t} {a['equal']}/{a['questions']} (largest logprob difference {a['max_logprob_diff'] or 0:.2g})"
            for t, a in agree.items())
    print("\n" + text, flush=True)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    base = f"e2e-{args.preset or model.name}-{args.device}-{stamp}"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{base}.md").write_text(text + "\n")
    (out / f"{base}.json").write_text(json.dumps(
        {"args": vars(args), "model": str(model), "device_name": device_name, "rows": rows, "rounds": raw,
         "agreement": agree, "markdown": text}, indent=2) + "\n")
    print(f"\nwrote {out / base}.md and .json", flush=True)


if __name__ == "__main__":
    main()
