#!/usr/bin/env bash
# One device call: GPU tests, the families on the fast path (FAMILIES), kernel/step breakdown and
# side-by-side bench runs. Results in $OUT.
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)"
  echo "commit ${GIT_COMMIT:-unknown}"; } 2>&1 | tee "$OUT/gpu.txt"
# The quicker files first, the long sweep of attention variants last: a run cut by the time limit
# loses the fewest files.
TEST_FILES=${TEST_FILES:-tests/test_decode_gemm.py tests/test_skinny_gemm.py tests/test_sampled_search.py tests/test_fusion.py tests/test_greedy.py tests/test_sampled.py tests/test_store_kv.py tests/test_gpu_reliability.py tests/test_triton_attention.py tests/test_gpu.py tests/test_attention_variants.py}
if [ "$TEST_FILES" != none ]; then  # TEST_FILES=none: benchmarks only
  # SIGINT at the limit: pytest stops and still prints the failures so far (-rf) and its summary.
  timeout -s INT ${TEST_TIMEOUT:-240} python3 -m pytest -q $TEST_FILES -p no:cacheprovider --tb=short -rf \
    -k "${TEST_FILTER:-}" 2>&1 | tail -200 > "$OUT/tests.txt"; tail -3 "$OUT/tests.txt"
fi
if [ -n "${FAMILIES:-}" ]; then  # model families on the fast path (benchmarks/gpu_families.py)
  PYTHONPATH=.:tests timeout ${FAMILY_TIMEOUT:-150} python3 benchmarks/gpu_families.py --types "$FAMILIES" 2>&1 \
    | grep -v -i warn | tee "$OUT/families.txt"
fi
if [ -n "${GEMM_TUNE:-}" ]; then  # skinny GEMM vs cuBLAS per decode shape; winners stored for GemmChoice
  export HF_ASYNC_CB_CACHE=${HF_ASYNC_CB_CACHE:-$OUT/cache}
  timeout ${GEMM_TIMEOUT:-240} python3 benchmarks/tune_gemm.py --record $GEMM_TUNE 2>&1 | grep -v -i warn | tee "$OUT/gemm.txt"
fi
if [ -n "${DP_SCALING:-}" ]; then  # DataParallel over 1..N GPUs (a multi-GPU machine), e.g. DP_SCALING="--gpus 1 2 8"
  timeout ${DP_TIMEOUT:-500} python3 benchmarks/data_parallel_scaling.py $DP_SCALING 2>&1 | grep -v -i warn | tee "$OUT/dp.txt"
fi
[ -n "${SAMPLING:-}" ] && timeout 90 python3 benchmarks/gpu_sampling.py 2>&1 | grep -v -i warn | tee "$OUT/sampling.txt"
# Kernel sweeps: TUNE=all (the small kernels and the decode attention), or tune_kernels.py's flags
# (TUNE=--prefill, TUNE=--attention).
[ -n "${TUNE:-}" ] && PYTHONPATH=.:tests timeout ${TUNE_TIMEOUT:-300} python3 benchmarks/tune_kernels.py ${TUNE/all/} 2>&1 \
  | grep -v -i warn | tee "$OUT/tune.txt"
for b in ${BREAKDOWNS:-}; do
  IFS=: read -r shape req new <<< "$b"
  timeout 150 python3 benchmarks/gpu_breakdown.py --shape "$shape" --requests "$req" --new "$new" 2>&1 \
    | grep -v -i warn | tee -a "$OUT/breakdown.txt"
done
IFS=';' read -ra RUNS <<< "${BENCH_RUNS:-}"
for run in "${RUNS[@]}"; do
  read -r shape req prompt new compare extra <<< "$run"
  timeout ${BENCH_TIMEOUT:-400} python3 -m hf_async_cb bench --shape "$shape" --requests "$req" --prompt "$prompt" \
    --new "$new" --compare "$compare" --no-progress ${extra:-} --json "$OUT/bench-$shape-$req-$new-${extra//-/}.json" 2>&1 \
    | grep -v -i "warn" | tail -14 | tee -a "$OUT/bench.txt"
done
# Shared prefixes (tools/shared_prefix.py): SHARED_PREFIX="shape:workloads:paths;...", e.g.
# SHARED_PREFIX="llama3.2-1b:group,few-shot,none:stock,hf-cb-sync,cache-off,cache-on"
IFS=';' read -ra PREFIX_RUNS <<< "${SHARED_PREFIX:-}"
for run in "${PREFIX_RUNS[@]}"; do
  IFS=: read -r shape workloads paths <<< "$run"
  timeout ${PREFIX_TIMEOUT:-300} python3 -m hf_async_cb.tools.shared_prefix --shape "$shape" --workloads "$workloads" \
    --paths "${paths:-stock,hf-cb-sync,cache-off,cache-on}" --json "$OUT/shared-prefix-$shape.json" 2>&1 \
    | grep -v -i "warn" | tee -a "$OUT/shared_prefix.txt"
done
