"""What a user waits for, first on a fresh machine and then warm (issue 34): `lmbatch run` of full MMLU
and HellaSwag 5-shot on random weights of real shapes, each run a fresh process timed by this parent
from spawn to exit, with the run's own phases (`summary.json` `time_s`), beside plain transformers doing
the MMLU job end to end (benchmarks/hf_e2e.py).

    python benchmarks/bench_fixed_costs.py --tokenizer TOK --out $OUT
    # TOK: a tokenizer folder (the embedded SmolLM2's files); writes $OUT/fixed-costs.jsonl, a line per
    # run as it ends (a call cut short keeps what it measured)

Order matters: the first run is the machine's first (Python's bytecode, the kernel compilers' caches,
the page cache of torch's libraries and of the weights, lmbatch's workload cache: all cold). So the
model folders are written here with numpy alone (random bf16 weights in safetensors, norms 1): nothing
imports torch before that first run. Then, per job, a dry run that puts its workload into the cache (no
model work) and `--repeat` warm runs (medians reported); the transformers script where --jobs puts it.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
BLOCK = 1 << 24         # random bf16 values drawn once and tiled over every tensor


def _tensors(cfg: dict) -> dict[str, tuple[int, ...]]:
    """The HF checkpoint's tensor names and shapes of a llama / qwen2 / qwen3 config."""
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    d = cfg.get("head_dim") or h // heads
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not cfg.get("tie_word_embeddings", False):
        out["lm_head.weight"] = (v, h)
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        out |= {p + "self_attn.q_proj.weight": (heads * d, h), p + "self_attn.k_proj.weight": (kv * d, h),
                p + "self_attn.v_proj.weight": (kv * d, h), p + "self_attn.o_proj.weight": (h, heads * d),
                p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                p + "mlp.down_proj.weight": (h, i), p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,)}
        if cfg["model_type"] == "qwen2":
            out |= {p + "self_attn.q_proj.bias": (heads * d,), p + "self_attn.k_proj.bias": (kv * d,),
                    p + "self_attn.v_proj.bias": (kv * d,)}
        if cfg["model_type"] == "qwen3":
            out |= {p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)}
    return out


def write_random_checkpoint(preset: str, target: Path, tokenizer: Path) -> Path:
    """presets/PRESET's shape as an HF folder of random bf16 weights (about N(0, 0.02); norms 1), written
    with numpy: a file per 4 GB, an index, the tokenizer's files. Reused when present."""
    cfg = json.loads((ROOT / "presets" / preset / "config.json").read_text())
    if not (target / "config.json").is_file():
        tmp = target.with_name(target.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        rng = np.random.default_rng(0)
        block = (rng.standard_normal(BLOCK, dtype=np.float32) * 0.02).view(np.uint32) >> 16
        block = block.astype(np.uint16)
        one = np.uint16(0x3F80)     # bf16 1.0
        shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
        size = 0
        for name, shape in _tensors(cfg).items():
            n = int(np.prod(shape)) * 2
            if size and size + n > 4 << 30:
                shards.append([])
                size = 0
            shards[-1].append((name, shape))
            size += n
        weight_map = {}
        for k, shard in enumerate(shards):
            fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
            header, offset = {}, 0
            for name, shape in shard:
                n = int(np.prod(shape)) * 2
                header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + n]}
                offset += n
                weight_map[name] = fname
            raw = json.dumps(header).encode()
            raw += b" " * (-len(raw) % 8)
            with open(tmp / fname, "wb") as f:
                f.write(len(raw).to_bytes(8, "little") + raw)
                for name, shape in shard:
                    count = int(np.prod(shape))
                    if name.endswith("norm.weight"):
                        f.write(np.full(count, one, dtype=np.uint16).tobytes())
                        continue
                    for start in range(0, count, BLOCK):
                        f.write(block[:min(BLOCK, count - start)].tobytes())
        (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
        (tmp / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k != "torch_dtype"}))
        tmp.rename(target)
    for f in tokenizer.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")) or f.suffix == ".jinja":
            shutil.copy(f, target / f.name)
    return target


def timed(cmd: list[str], log: Path) -> float:
    t = time.perf_counter()
    with open(log, "w") as fh:
        rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - t
    if rc != 0:
        raise SystemExit(f"{' '.join(map(str, cmd))} exited {rc}:\n{log.read_text()[-3000:]}")
    return wall


def cli() -> list[str]:
    """The `lmbatch` command: its console script beside this Python, else the module."""
    exe = Path(sys.executable).parent / "lmbatch"
    return [str(exe)] if exe.is_file() else [sys.executable, "-c", "from lmbatch.cli import main; main()"]


def lmbatch(task: str, model: Path, out: Path, run_id: str, extra: list[str], shots: int | None = 5) -> list[str]:
    """The `lmbatch run` command line (`shots` None: no --shots, for tasks whose shots are their own)."""
    given = [] if shots is None else ["--shots", str(shots)]
    return cli() + ["run", task, *given, "--model", str(model), "--out", str(out), "--run-id", run_id,
                  "--overwrite", "--quiet", *extra]


def record(out: Path, row: dict, name: str = "fixed-costs.jsonl", hide: tuple[str, ...] = ("time_s",)) -> None:
    """A line of `out/name`, and the row printed without its `hide` fields."""
    with open(out / name, "a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps({k: v for k, v in row.items() if k not in hide}), flush=True)


def run_job(args: argparse.Namespace, job: str, task: str, model: Path, kind: str, run_id: str) -> dict:
    runs = Path(args.out) / "runs"
    wall = timed(lmbatch(task, model, runs, run_id, args.lmbatch_args.split()), Path(args.out) / f"{run_id}.log")
    s = json.loads((runs / run_id / "summary.json").read_text())
    row = {"job": job, "kind": kind, "wall_s": round(wall, 2), "time_s": s["time_s"], "workload": s.get("workload"),
           "attention": s.get("attention"), "hit_rate": s["hit_rate"], "optimal_hit_rate": s["optimal_hit_rate"],
           "accuracy": s["accuracy"], "instances": s["counts"]["instances"]}
    record(Path(args.out), row)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", required=True, help="tokenizer folder copied into the model folders")
    ap.add_argument("--models", default="/tmp/bench-models")
    ap.add_argument("--jobs", default="mmlu-1.5b,hf-mmlu-1.5b,hellaswag-1.5b,mmlu-8b")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--lmbatch-args", default="")
    ap.add_argument("--out", default="results/fixed-costs")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tok = Path(args.tokenizer)
    jobs = args.jobs.split(",")
    t = time.perf_counter()
    q15 = write_random_checkpoint("qwen2.5-1.5b", Path(args.models) / "Q15", tok)
    print(f"wrote {q15} in {time.perf_counter() - t:.1f}s", flush=True)
    rows = [run_job(args, "mmlu-1.5b", "mmlu", q15, "fresh machine, first run", "fresh")]
    for job in jobs:
        name, _, size = job.partition("-")
        if name == "hf":
            wall = timed([sys.executable, str(ROOT / "benchmarks" / "hf_e2e.py"), "--task", "mmlu", "--shots", "5",
                          "--model", str(q15), "--device", "cuda", "--out", str(out / "runs" / "hf")],
                         out / "hf.log")
            record(out, {"job": job, "kind": "plain transformers", "wall_s": round(wall, 2)})
            continue
        model = q15 if size == "1.5b" else write_random_checkpoint("qwen3-8b", Path(args.models) / "Q8", tok)
        if job != "mmlu-1.5b":      # its workload into the cache (a dry run: no model work), as a warm run finds it
            timed(lmbatch(name, model, out / "runs", f"{job}-dry", ["--dry-run"]), out / f"{job}-dry.log")
        for k in range(args.repeat):
            rows.append(run_job(args, job, name, model, "warm", f"{job}-warm{k}"))
    summary = {}
    for job in dict.fromkeys(r["job"] for r in rows):
        warm = [r["wall_s"] for r in rows if r["job"] == job and r["kind"] == "warm"]
        if warm:
            summary[job] = statistics.median(warm)
    (out / "fixed-costs-summary.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
