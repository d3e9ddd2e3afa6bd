#!/usr/bin/env bash
# First use A/B on one GPU machine (issue 29): the first generate() call of a fresh process, cold and
# warm Triton cache (benchmarks/gpu_first_call.py), for a snapshot of an earlier commit and for the
# working tree (its first calls' stacks sampled, with the phases' timeline: --sample), one after the other in
# one call. The snapshot: before the call,
#   mkdir -p .ab/base && git archive BASE hf_async_cb benchmarks | tar -x -C .ab/base
# and run(carry=[".ab"], ...). Results in $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
CALLS=${CALLS:-64:128:256:s,7:128:256:s,7:128:256:s,64:128:256:g}
SHAPE=${SHAPE:-llama3.2-1b}
summary() { grep -E "^(cold|warm):|compiled ahead:" ; }
python3 -c "import torch, triton; print(torch.cuda.get_device_name(), 'torch', torch.__version__, 'triton', triton.__version__)"
for side in base tree; do  # the working tree's first calls with their stack sampled (--sample: a few ms of cost)
  root=.; flags=--sample; [ "$side" = base ] && root=.ab/base && flags=
  echo "=== $side ($root)"
  PYTHONPATH=$root timeout 200 python3 $root/benchmarks/gpu_first_call.py --shape $SHAPE --calls $CALLS $flags \
    --json "$OUT/first_call_$side.json" 2>&1 | grep -v -i warn > "$OUT/first_call_$side.txt"; summary < "$OUT/first_call_$side.txt"
done
grep -v "^     0.0. s  " "$OUT/first_call_tree.txt" | grep -v "cache:" | grep -v "^   *[0-9.]* s  *[a-z_]*\._" | head -${SAMPLE_LINES:-220}
if [ -n "${TESTS:-}" ]; then  # e.g. TESTS=tests/test_first_use.py
  PYTHONPATH=. timeout ${TESTS_TIMEOUT:-240} python3 -m pytest -q -s $TESTS -p no:cacheprovider --tb=short -rf 2>&1 \
    | grep -v -i warn | tail -60 > "$OUT/tests.txt"; grep -E "passed|failed|launchers|first_s|Error|assert" "$OUT/tests.txt" | head -20
fi
