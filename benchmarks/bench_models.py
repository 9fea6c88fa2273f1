"""Issue 58's table: full MMLU 5-shot on the shapes people release quantized, each a fresh `lmbatch run`
process on random weights written as the releases store them (benchmarks/random_checkpoint.py), side by
side in one call.

    CUDA_VISIBLE_DEVICES=0 python benchmarks/bench_models.py --tokenizer TOK --out OUT --jobs qwen3-8b,qwen3-8b-fp8
    CUDA_VISIBLE_DEVICES=1 python benchmarks/bench_models.py --tokenizer TOK --out OUT --jobs gpt-oss-20b
    python benchmarks/bench_models.py --tokenizer TOK --out OUT --jobs deepseek-v3-3l:tp4 --limit 2000

A job is a preset (presets/NAME), optionally `:tpN` (`--tensor-parallel N`); each runs --rounds times (the
first on a cold page cache for its weights, then warm). Writes OUT/models.jsonl, a line per run, with the
run's phases, its quantization block and the KV bytes a token takes in the pool (MLA: the latent entry).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_fixed_costs import lmbatch, record, timed  # noqa: E402
from random_checkpoint import ROOT, write_random_checkpoint  # noqa: E402


def kv_bytes_per_token(cfg: dict, dtype_bytes: int = 2) -> dict[str, int]:
    """A token's KV in the pool over all layers: MLA's latent entry (kv_lora_rank + rope dim, keys are values)
    against the expanded keys and values a plain cache would hold; else keys and values per KV head."""
    layers = cfg["num_hidden_layers"]
    if "kv_lora_rank" in cfg:
        latent = (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * dtype_bytes * layers
        heads = cfg["num_attention_heads"]
        per_head = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"] + cfg["v_head_dim"]
        expanded = heads * per_head * dtype_bytes * layers
        return {"kv_bytes_per_token": latent, "expanded_kv_bytes_per_token": expanded}
    heads = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    d = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return {"kv_bytes_per_token": 2 * heads * d * dtype_bytes * layers}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--models", default="/tmp/bench-models")
    ap.add_argument("--jobs", default="qwen3-8b,qwen3-8b-fp8,gpt-oss-20b")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--limit", type=int, help="MMLU questions (default: all 14,042)")
    ap.add_argument("--out", default="results/models")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for job in args.jobs.split(","):
        preset, _, tp = job.partition(":")
        extra = ["--tensor-parallel", tp[2:]] if tp else []
        extra += ["--limit", str(args.limit)] if args.limit else []
        print(f"--- {job}", flush=True)
        try:
            model = write_random_checkpoint(preset, Path(args.models) / preset, Path(args.tokenizer))
            cfg = json.loads((ROOT / "presets" / preset / "config.json").read_text())
            for k in range(args.rounds):
                run_id = f"{preset}-{tp or 'tp1'}-{k}"
                wall = timed(lmbatch("mmlu", model, out / "runs", run_id, extra), out / f"{run_id}.log")
                s = json.loads((out / "runs" / run_id / "summary.json").read_text())
                record(out, {"job": job, "round": k, "wall_s": round(wall, 2), "execute_s": s["time_s"].get("execute"),
                             "time_s": s["time_s"], "model_runtime": s.get("model_runtime"),
                             "attention": s.get("attention"), "quantization": s.get("quantization"),
                             "metrics": s.get("metrics"), "tokens": s.get("tokens"), **kv_bytes_per_token(cfg)},
                       "models.jsonl")
        except SystemExit as e:         # a failed job is recorded, the others still run
            print(f"--- {job} failed: {e}", flush=True)
            record(out, {"job": job, "error": str(e)[-2000:]}, "models.jsonl")
    (out / "DONE").touch()


if __name__ == "__main__":
    main()
