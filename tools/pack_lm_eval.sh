#!/usr/bin/env bash
# Packs lm-eval 0.4.13 and what its CLI imports, for the GPU machine's Python 3.12 (it has torch,
# transformers, numpy, pandas, pyarrow, tqdm; ../shared/gpu/pack.sh adds datasets): writes
# .gpu/lmeval.tar.xz (~11 MB). On the device, unpack it into the same folder as site.tar.xz:
#     tar xJf .gpu/site.tar.xz -C /tmp/site && tar xJf .gpu/lmeval.tar.xz -C /tmp/site
set -euo pipefail
root=$(git rev-parse --show-toplevel)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip install -q --target "$work/site" --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 \
  lm-eval==0.4.13 accelerate==1.15.0 psutil==7.2.2 sacrebleu==2.6.0 portalocker==4.4.2 tabulate==0.10.0 \
  colorama==0.4.6 lxml==6.1.3 pytablewriter==1.2.1 DataProperty==1.1.1 mbstrdecoder==1.1.5 \
  pathvalidate==3.3.1 tabledata==1.3.5 tcolorpy==0.1.7 typepy==1.3.5 chardet==6.0.0.post1 \
  more_itertools==11.2.1 evaluate==0.4.6 regex xxhash requests urllib3 idna certifi charset_normalizer \
  pytz python-dateutil six
rm -rf "$work/site/bin"
mkdir -p "$root/.gpu"
tar cJf "$root/.gpu/lmeval.tar.xz" -C "$work/site" .
ls -la "$root/.gpu/lmeval.tar.xz"
