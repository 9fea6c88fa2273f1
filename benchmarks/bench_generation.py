"""BENCHMARKS.md's generation table (issue 48) in one process on one GPU: each job a fresh `lmbatch`
process (or bench_decode.py's), random bf16 weights, side by side in one call.

    python benchmarks/bench_generation.py --tokenizer TOK --out OUT [--jobs tot,decode,long,cot,sc16,json]

- tot: `lmbatch run tot-gsm8k` (all 1,319 programs), SmolLM2-135M shape, twice; tot-1.5b: once, Qwen2.5-1.5B shape;
- decode: bench_decode.py, 1.5B, 256 rows sharing a 2,000-token prefix + 100 own tokens, 256 new: the
  default (`auto`), plain decode and `--attention cascade` against the shared-prefix roofline;
- own: bench_decode.py, 1.5B, 64 and 256 rows x 1,000 own tokens (no sharing), `auto` and plain decode;
- long: bench_decode.py, 1.5B, 256 rows x 256 prompt tokens, 4,096 new tokens each;
- cot: lm-eval's gsm8k_cot (8-shot fixed chain-of-thought prompt, all 1,319): `lmbatch lm-eval` and
  `lm_eval --model hf --batch_size 64`;
- sc16: lm-eval's gsm8k_cot_self_consistency with `repeats: 16` (temperature sampling), `lmbatch lm-eval`;
- json: `lmbatch run json --think-budget 256`, Qwen3-8B shape;
- det-mmlu-1.5b, det-mmlu-8b, det-decode (issue 50): `--deterministic`'s cost on full MMLU 5-shot
  (bench_deterministic.py) and on decode at 64 / 256 rows x 1,000 tokens (bench_decode.py).
Writes OUT/generation.jsonl (a line per measurement) and OUT/DONE.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_fixed_costs import cli, lmbatch, record, timed, write_random_checkpoint  # noqa: E402

HERE = Path(__file__).resolve().parent


def _summary(runs: Path, run_id: str) -> dict:
    return json.loads((runs / run_id / "summary.json").read_text())


def job_run(args, out: Path, task: str, model: Path, run_id: str, extra: list[str]) -> None:
    runs = out / "runs"
    wall = timed(lmbatch(task, model, runs, run_id, extra, None), out / f"{run_id}.log")
    s = _summary(runs, run_id)
    record(out, {"job": run_id, "wall_s": round(wall, 2), "execute_s": s["time_s"].get("execute"),
                 "time_s": s["time_s"], "hit_rate": s["hit_rate"], "optimal_hit_rate": s["optimal_hit_rate"],
                 "counts": s.get("counts"), "tokens": s.get("tokens")}, "generation.jsonl")


def job_decode(out: Path, name: str, extra: list[str]) -> None:
    cmd = [sys.executable, str(HERE / "bench_decode.py"), "--presets", "qwen2.5-1.5b", "--out",
           str(out / "generation.jsonl"), *extra]
    timed(cmd, out / f"{name}.log")
    print((out / f"{name}.log").read_text()[-1500:], flush=True)


def _lm_eval(out: Path, name: str, cmd: list[str]) -> None:
    target = out / "runs" / name
    wall = timed(cmd + ["--output_path", str(target)], out / f"{name}.log")
    row: dict = {"job": name, "wall_s": round(wall, 2)}
    reports = list(target.rglob("lmbatch_*.json"))
    if reports:
        rep = json.loads(reports[0].read_text())
        row.update(time_s=rep.get("time_s"), tokens=rep.get("tokens"), hit_rate=rep.get("hit_rate"))
    record(out, row, "generation.jsonl")


def job_lm_eval(out: Path, model: Path, task: str, variants: list[str]) -> None:
    from lmbatch.lm_eval.backend import write_offline_tasks

    tasks = out / "lm-eval-tasks"
    write_offline_tasks(tasks)
    (tasks / "gsm8k_cot_sc16_offline.yaml").write_text(json.dumps({     # JSON is YAML
        "include": str(tasks / "gsm8k_cot_self_consistency_offline.yaml"), "task": "gsm8k_cot_sc16_offline",
        "repeats": 16}))
    common = ["--tasks", task, "--include_path", str(tasks), "--num_fewshot", "8", "--device", "cuda"]
    for v in variants:
        if v == "lmbatch":
            cmd = cli() + ["lm-eval", "--model_args", f"pretrained={model},dtype=bfloat16", *common]
        else:
            cmd = [sys.executable, "-m", "lm_eval", "run", "--model", "hf", "--batch_size", "64",
                   "--model_args", f"pretrained={model},dtype=bfloat16", *common]
        _lm_eval(out, f"{task}-{v}", cmd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--models", default="/tmp/bench-models")
    ap.add_argument("--jobs", default="decode,own,tot,cot,sc16,long,json")
    ap.add_argument("--out", default="results/generation")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tok = Path(args.tokenizer)

    def model(preset: str) -> Path:
        return write_random_checkpoint(preset, Path(args.models) / preset, tok)

    for job in args.jobs.split(","):
        print(f"--- {job}", flush=True)
        try:
            run_job(args, out, job, model)
        except SystemExit as e:         # a failed job is recorded, the others still run
            print(f"--- {job} failed: {e}", flush=True)
            record(out, {"job": job, "error": str(e)[-2000:]}, "generation.jsonl")
    (out / "DONE").touch()


def job_deterministic(out: Path, name: str, model: Path) -> None:
    """bench_deterministic.py: full MMLU 5-shot with and without `--deterministic`, fresh processes."""
    cmd = [sys.executable, str(HERE / "bench_deterministic.py"), "--model", str(model), "--args", "mmlu --shots 5",
           "--rounds", "2", "--out", str(out / "runs" / name)]
    timed(cmd, out / f"{name}.log")
    row = json.loads((out / f"{name}.log").read_text().strip().splitlines()[-1])
    record(out, {"job": name, **row}, "generation.jsonl")


def run_job(args, out: Path, job: str, model) -> None:
    if job == "tot":
        for k in range(2):
            job_run(args, out, "tot-gsm8k", model("smollm2-135m"), f"tot-{k}", [])
    elif job == "tot-1.5b":
        job_run(args, out, "tot-gsm8k", model("qwen2.5-1.5b"), "tot-1.5b", [])
    elif job == "decode":
        job_decode(out, "decode", ["--rows", "256", "--contexts", "100", "--shared-prefix", "2000",
                                   "--new-tokens", "256", "--kernels", "auto,decode,cascade"])
    elif job == "own":
        job_decode(out, "own", ["--rows", "64,256", "--contexts", "1000", "--new-tokens", "256",
                                "--kernels", "auto,decode"])
    elif job == "long":
        job_decode(out, "long", ["--rows", "256", "--contexts", "256", "--new-tokens", "4096",
                                 "--kernels", "decode"])
    elif job == "cot":
        job_lm_eval(out, model("qwen2.5-1.5b"), "gsm8k_cot_offline", ["lmbatch", "hf"])
    elif job == "sc16":
        job_lm_eval(out, model("qwen2.5-1.5b"), "gsm8k_cot_sc16_offline", ["lmbatch"])
    elif job == "json":
        job_run(args, out, "json", model("qwen3-8b"), "json-think",
                ["--think-budget", "256", "--think-end", "</think>"])
    elif job in ("det-mmlu-1.5b", "det-mmlu-8b"):         # issue 50's cost table
        job_deterministic(out, job, model("qwen2.5-1.5b" if job.endswith("1.5b") else "llama-3.1-8b"))
    elif job == "det-decode":
        job_decode(out, job, ["--rows", "64,256", "--contexts", "1000", "--new-tokens", "256",
                              "--kernels", "decode,deterministic"])
    else:
        raise SystemExit(f"no job {job}")

if __name__ == "__main__":
    main()
