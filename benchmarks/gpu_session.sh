#!/usr/bin/env bash
# One device call: GPU tests, then the side-by-side benchmarks. Results go to $OUT.
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
echo "commit ${GIT_COMMIT:-unknown}" | tee -a "$OUT/gpu.txt"
timeout ${TEST_TIMEOUT:-150} python3 -m pytest -q -x tests/test_gpu.py -p no:cacheprovider 2>&1 | tail -25 | tee "$OUT/tests.txt"
IFS=';' read -ra RUNS <<< "${BENCH_RUNS:-llama3.2-1b 64 128 64}"
for run in "${RUNS[@]}"; do
  read -r shape req prompt new compare <<< "$run"
  timeout ${BENCH_TIMEOUT:-400} python3 -m hf_async_cb bench --shape "$shape" --requests "$req" --prompt "$prompt" \
    --new "$new" --compare "${compare:-stock,hf-cb-sync,hf-cb-async,sync,async}" \
    --json "$OUT/bench-$shape-$req-$prompt-$new.json" 2>&1 | grep -v "Warning\|warn" | tail -12 | tee -a "$OUT/bench.txt"
done
