#!/usr/bin/env bash
# Issue 29's remaining figures in one device call (about 5 minutes on an H200): the 8B shape's first
# calls in a fresh process, cold and warm Triton cache (first greedy <= 8 s, a sampled call after it
# <= +1 s; benchmarks/gpu_first_call.py), and what a later call's graph captures cost on the 1B shape,
# with and without the eager warm-up before each (benchmarks/gpu_capture_cost.py). Results in $OUT.
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
git log --oneline -1 2>/dev/null | tee "$OUT/commit.txt"
timeout ${CAPTURE_TIMEOUT:-200} python3 benchmarks/gpu_capture_cost.py --json "$OUT/capture_cost.json" 2>&1 \
  | grep -v -i warn > "$OUT/capture_cost.txt"; tail -22 "$OUT/capture_cost.txt"
timeout ${FIRST_TIMEOUT:-330} python3 benchmarks/gpu_first_call.py --shape llama3-8b \
  --calls ${CALLS_8B:-32:128:128:g,32:128:128:s,7:128:128:s} --json "$OUT/first_call_8b.json" 2>&1 \
  | grep -v -i warn > "$OUT/first_call_8b.txt"; grep -E "^(cold|warm):|compiled ahead:|phases:|^[0-9]+:" "$OUT/first_call_8b.txt"
