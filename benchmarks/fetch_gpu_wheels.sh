#!/usr/bin/env bash
# The quantization libraries the GPU image lacks, as wheels in .whl/ (git-ignored) for
# run(carry=[".whl"], ...): the versions every figure in docs/benchmarks.md was measured with.
# The GPU scripts install them with pip --no-index --no-deps before they start.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >> .git/info/exclude
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any \
  -d .whl bitsandbytes==0.50.2 torchao==0.17.0 optimum-quanto==0.2.7 termcolor==3.2.0
# hqq is published as a source archive only (pure Python): built into a wheel here.
python3 -m pip wheel -q --no-deps --no-build-isolation -w .whl hqq==0.2.8
ls -la .whl
