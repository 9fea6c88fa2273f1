#!/usr/bin/env bash
# BENCHMARKS.md's "tree of thought on four GPUs" section: tree of thought (all 1,319 questions, random bf16
# weights of presets/qwen2.5-1.5b) on one GPU and on four data-parallel workers, lmbatch at REV ("before")
# beside the working tree ("after"), each version installed on its own (pip --target), each run a fresh
# process: first with a new Triton cache per version and GPU count, then two warm rounds, alternating.
#
#   bash benchmarks/spread_section.sh REV TOK OUT     # TOK: a tokenizer folder; writes OUT/runs.jsonl (each
#                                                     # run's summary.json with its name), OUT/info.txt
set -u
REV=$1 TOK=$2 OUT=$3
mkdir -p "$OUT" /tmp/spread/old-src
start=$(date +%s)
git archive "$REV" | tar x -C /tmp/spread/old-src
python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/spread/old /tmp/spread/old-src
python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/spread/new .
PYTHONPATH=/tmp/spread/new${PYTHONPATH:+:$PYTHONPATH} python3 -c "import sys; sys.path.insert(0, 'benchmarks')
from pathlib import Path; from random_checkpoint import write_random_checkpoint as w
w('qwen2.5-1.5b', Path('/tmp/spread/q15'), Path('$TOK'))"
run() {  # name version workers triton-cache [--dry-run]
  ( cd /tmp && LMBATCH_CACHE=/tmp/spread/cache-$2 PYTHONPATH=/tmp/spread/$2${PYTHONPATH:+:$PYTHONPATH} \
    TRITON_CACHE_DIR=$4 timeout 300 python3 -m lmbatch.cli run tot-gsm8k --model /tmp/spread/q15 --out /tmp/spread/runs \
    --run-id "$1" --overwrite --quiet --data-parallel "$3" ${5:-} > "/tmp/spread/$1.log" 2>&1 )
  echo "$1 rc=$? at $(( $(date +%s) - start )) s" >> "$OUT/info.txt"
  [ -n "${5:-}" ] || python3 -c "import json; s = json.load(open('/tmp/spread/runs/$1/summary.json')); s['run'] = '$1'
print(json.dumps(s))" >> "$OUT/runs.jsonl"
}
for v in old new; do run "dry-$v" $v 1 /tmp/spread/tc-dry --dry-run; done     # the workload cached, as a rerun finds it
run o1f old 1 /tmp/spread/tc-o1; run n1f new 1 /tmp/spread/tc-n1; run o4f old 4 /tmp/spread/tc-o4; run n4f new 4 /tmp/spread/tc-n4
for k in 1 2; do
  run "o1w$k" old 1 /tmp/spread/tc-o1; run "n1w$k" new 1 /tmp/spread/tc-n1
  run "o4w$k" old 4 /tmp/spread/tc-o4; run "n4w$k" new 4 /tmp/spread/tc-n4
done
