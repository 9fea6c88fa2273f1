#!/usr/bin/env bash
# Refresh constraints.txt, the tested set the README's commands install (`pip install -c constraints.txt`):
# a throwaway venv gets torch==2.13.0 and the newest versions pyproject.toml allows for lmbatch with its test
# and lm-eval extras, and what pip installed there is written down. Then run the README's test command (or
# `bash .ci/run`) on it before committing. About two minutes.
#   tools/constraints.sh
# Left out: lmbatch itself, torch's CUDA packages (nvidia-*, triton: never on the CPU machines), and the data
# and model packages the README installs with --no-deps at versions of their own (pinned there).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=$(mktemp -d)
trap 'rm -rf "$venv"' EXIT
python3 -m venv "$venv"
"$venv/bin/pip" install -q torch==2.13.0
"$venv/bin/pip" install -q -e '.[test,lm-eval]'
nodeps=$(grep -o -m1 'pip install -q --no-deps [^&]*' README.md | sed 's/pip install -q --no-deps//')
skip=$(for p in $nodeps; do echo "${p%%==*}"; done | tr '[:upper:]_.' '[:lower:]--' | paste -sd '|')
{
    echo "# The tested set of lmbatch's dependencies, installed by the README's commands (pip install -c"
    echo "# constraints.txt). Written by tools/constraints.sh on $(date -u +%Y-%m-%d) with Python $(python3 -V | cut -d' ' -f2)"
    echo "# ($(uname -m)); run it again to refresh. pyproject.toml keeps the ranges, tested at their lower end"
    echo "# by tools/smoke.sh --oldest. Not here: lmbatch and the --no-deps data packages (the README pins those)."
    "$venv/bin/pip" freeze --exclude-editable --all \
        | grep -v -E '^(pip|setuptools|wheel)==' \
        | sed -E 's/^(torch==[^+]*)\+.*/\1/' \
        | awk -F'==' -v skip="^(nvidia-.*|triton|lmbatch|$skip)$" \
            '{n = tolower($1); gsub(/[_.]/, "-", n)} n !~ skip' \
        | LC_ALL=C sort -f
} > constraints.txt.new
grep -q '^torch==2.13.0$' constraints.txt.new || { echo "constraints: torch==2.13.0 missing"; exit 1; }
mv constraints.txt.new constraints.txt
echo "constraints: wrote $(grep -vc '^#' constraints.txt) pins to constraints.txt"
