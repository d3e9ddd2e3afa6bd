#!/usr/bin/env bash
# One device call: the attention-variant kernel tests, the families on the GPU fast path, and the
# side-by-side bench runs named in BENCH_RUNS ("shape requests prompt new paths [extra]; ...").
set -uo pipefail
export PYTHONPATH=.:tests PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)"
  echo "commit ${GIT_COMMIT:-unknown}"; } 2>&1 | tee "$OUT/gpu.txt"
if [ -n "${TESTS:-}" ]; then
  timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q $TESTS -p no:cacheprovider --tb=short 2>&1 | tail -60 > "$OUT/tests.txt"
  tail -4 "$OUT/tests.txt"
fi
if [ -n "${FAMILIES:-}" ]; then
  timeout ${FAMILY_TIMEOUT:-150} python3 benchmarks/gpu_families.py --types "$FAMILIES" 2>&1 | grep -v -i warn \
    | tee "$OUT/families.txt"
fi
IFS=';' read -ra RUNS <<< "${BENCH_RUNS:-}"
for run in "${RUNS[@]}"; do
  read -r shape req prompt new compare extra <<< "$run"
  timeout ${BENCH_TIMEOUT:-200} python3 -m hf_async_cb bench --shape "$shape" --requests "$req" --prompt "$prompt" \
    --new "$new" --compare "$compare" --no-progress ${extra:-} --json "$OUT/bench-$shape-$req-$prompt-$new.json" 2>&1 \
    | grep -v -i "warn" | tail -14 | tee -a "$OUT/bench.txt"
done
