#!/usr/bin/env bash
# Issue 29's open figures in one device call (about 8-9 minutes; STEPS picks some of them, in its order):
#  tests    tests/test_first_use.py (a fresh process compiles every variant in its first call, none
#           later, and builds no Triton C launcher itself);
#  first1b  the 1B shape's first calls, cold and warm Triton cache (benchmarks/gpu_first_call.py;
#           64 x 128 -> 256 sampled, then 7 rows twice: a new batch size, then the same call warm, then
#           7 rows greedy twice: steps lent the sampled graphs, LEND_SAMPLED_STEPS),
#           then warm again without and with loading the variants onto the device ahead (the A/B of
#           HF_ASYNC_CB_LOAD_AHEAD: the warm first call, and the 7-row call's capture);
#  capture  what a later call's graph captures cost on the 1B shape, with and without the eager
#           warm-up before each (benchmarks/gpu_capture_cost.py);
#  first8b  the 8B shape's first calls, cold and warm (first greedy <= 8 s, a sampled call after it
#           <= +1 s).
# The first use A/B against an earlier commit is benchmarks/gpu_first_use_ab.sh. Results in $OUT.
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STEPS=${STEPS:-tests first8b first1b}  # (the 8B first: its targets are the ones never measured; capture: measured)
python3 -c "import torch, triton; print(torch.cuda.get_device_name(), 'torch', torch.__version__, 'triton', triton.__version__)"
for step in $STEPS; do
  echo "=== $step"
  case $step in
    tests)
      timeout ${TESTS_TIMEOUT:-150} python3 -m pytest -q -s tests/test_first_use.py -p no:cacheprovider --tb=short -rf -W ignore 2>&1 \
        | tail -40 > "$OUT/tests.txt"; grep -E "passed|failed|launchers|Error|assert" "$OUT/tests.txt" | head -12 ;;
    first1b)
      timeout ${FIRST_TIMEOUT:-220} python3 benchmarks/gpu_first_call.py --shape llama3.2-1b \
        --calls 64:128:256:s,7:128:256:s,7:128:256:s,7:128:256:g,7:128:256:g \
        --warm-with ${WARM_WITH:-HF_ASYNC_CB_LOAD_AHEAD=0,HF_ASYNC_CB_LOAD_AHEAD=1,HF_ASYNC_CB_LOAD_AHEAD=0} --json "$OUT/first_call_1b.json" 2>&1 | grep -v -i warn \
        > "$OUT/first_call_1b.txt"; grep -E "^(cold|warm)[^:]*:|compiled ahead:|phases:|^[0-9]+:" "$OUT/first_call_1b.txt" | cut -c1-400 ;;
    capture)
      timeout ${CAPTURE_TIMEOUT:-120} python3 benchmarks/gpu_capture_cost.py --json "$OUT/capture_cost.json" 2>&1 \
        | grep -v -i warn > "$OUT/capture_cost.txt"; tail -22 "$OUT/capture_cost.txt" ;;
    first8b)
      timeout ${FIRST8B_TIMEOUT:-200} python3 benchmarks/gpu_first_call.py --shape llama3-8b \
        --calls ${CALLS_8B:-32:128:128:g,32:128:128:s,7:128:128:s} --json "$OUT/first_call_8b.json" 2>&1 \
        | grep -v -i warn > "$OUT/first_call_8b.txt"; grep -E "^(cold|warm)[^:]*:|compiled ahead:|phases:|^[0-9]+:" "$OUT/first_call_8b.txt" | cut -c1-400 ;;
  esac
done
