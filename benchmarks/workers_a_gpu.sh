#!/usr/bin/env bash
# BENCHMARKS.md's "Workers a GPU": each job with one worker a GPU and with two, every run a fresh process
# (`lmbatch run` / `lmbatch lm-eval`), its own Triton cache per variant (the first run of each fresh, then
# warm), alternating; random bf16 weights of presets/qwen2.5-1.5b (Q15) and qwen3-8b (Q8).
#
#   bash benchmarks/workers_a_gpu.sh TOK OUT one        # 1 GPU: tree of thought, 1.5B, 1 worker and auto
#   bash benchmarks/workers_a_gpu.sh TOK OUT tot        # 4 GPUs: tree of thought, 1.5B, on 1 GPU (1 and 2
#                                                       # workers) and on 4 (4 and 8 workers)
#   bash benchmarks/workers_a_gpu.sh TOK OUT large      # 2 GPUs, side by side: GPU 0 tree of thought at 8B;
#                                                       # GPU 1 thinking then JSON at 8B, then lm-eval gsm8k at 1.5B
# TOK: a tokenizer folder; writes OUT/runs.jsonl (each run's summary.json, or lm-eval's lmbatch report, with
# its name), OUT/info.txt (each run's end), OUT/logs.txt
set -u
TOK=$1 OUT=$2 WHAT=$3
W=/tmp/workers-a-gpu; mkdir -p "$OUT" $W
start=$(date +%s); I=$OUT/info.txt
python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from pathlib import Path
from random_checkpoint import write_random_checkpoint as w
w('qwen2.5-1.5b', Path('$W/q15'), Path('$TOK'))
if '$WHAT' == 'large': w('qwen3-8b', Path('$W/q8'), Path('$TOK'))"
record() {  # name summary-file
  python3 -c "import json; s = json.load(open('$2')); s['run'] = '$1'; print(json.dumps(s))" >> "$OUT/runs.jsonl" 2>> "$I"
}
one() {  # name workers gpus triton-cache workload args...
  local n=$1 dp=$2 g=$3 tc=$4 wl=$5; shift 5
  ( cd /tmp && CUDA_VISIBLE_DEVICES=$g TRITON_CACHE_DIR=$W/tc-$tc timeout 200 python3 -m lmbatch.cli run "$wl" \
      --out $W/runs --run-id "$n" --overwrite --quiet --data-parallel "$dp" "$@" > "$W/$n.log" 2>&1 )
  echo "$n rc=$? at $(( $(date +%s) - start )) s" >> "$I"; { echo "== $n"; tail -c 1000 "$W/$n.log"; } >> "$OUT/logs.txt"
  record "$n" "$W/runs/$n/summary.json"
}
lme() {  # name workers gpu triton-cache
  ( cd /tmp && CUDA_VISIBLE_DEVICES=$3 TRITON_CACHE_DIR=$W/tc-$4 timeout 200 python3 -m lmbatch.cli lm-eval --model_args \
      "pretrained=$W/q15,dtype=bfloat16,data_parallel=$2" --tasks gsm8k_offline --include_path $W/lmt --num_fewshot 5 \
      --output_path "$W/le/$1" > "$W/$1.log" 2>&1 )
  echo "$1 rc=$? at $(( $(date +%s) - start )) s" >> "$I"; { echo "== $1"; tail -c 1000 "$W/$1.log"; } >> "$OUT/logs.txt"
  record "$1" "$(find "$W/le/$1" -name 'lmbatch_*.json' | head -1)"
}
think=(--think-budget 256 --think-end '</think>')
if [ "$WHAT" != large ]; then
  ( cd /tmp && python3 -m lmbatch.cli run tot-gsm8k --model $W/q15 --out $W/runs --run-id dry --dry-run --quiet > /dev/null 2>&1 )
fi
if [ "$WHAT" = one ]; then
  for k in f w1 w2 w3; do one "d1$k" 1 0 d1 tot-gsm8k --model $W/q15; one "da$k" auto 0 da tot-gsm8k --model $W/q15; done
elif [ "$WHAT" = tot ]; then
  for k in f w1 w2; do     # f: each variant's first run, its Triton cache new
    one "d1$k" 1 0 d1 tot-gsm8k --model $W/q15; one "d2$k" 2 0 d2 tot-gsm8k --model $W/q15
    one "d4$k" 4 0,1,2,3 d4 tot-gsm8k --model $W/q15; one "d8$k" 8 0,1,2,3 d8 tot-gsm8k --model $W/q15
  done
else
  python3 -c "from lmbatch.lm_eval.offline import write_offline_tasks as w; from pathlib import Path; w(Path('$W/lmt'))"
  ( cd /tmp && python3 -m lmbatch.cli run tot-gsm8k --model $W/q8 --out $W/runs --run-id dry --dry-run --quiet > /dev/null 2>&1 )
  ( cd /tmp && python3 -m lmbatch.cli run json --model $W/q8 --out $W/runs --run-id dryj --dry-run --quiet "${think[@]}" > /dev/null 2>&1 )
  ( for k in f w1 w2; do one "t1$k" 1 0 t1 tot-gsm8k --model $W/q8; one "t2$k" 2 0 t2 tot-gsm8k --model $W/q8; done ) &
  ( for k in f w1; do one "j1$k" 1 1 j1 json --model $W/q8 "${think[@]}"; one "j2$k" 2 1 j2 json --model $W/q8 "${think[@]}"; done
    for k in f w1; do lme "l1$k" 1 1 l1; lme "l2$k" 2 1 l2; done ) &
  wait
fi
echo "all done at $(( $(date +%s) - start )) s" >> "$I"
