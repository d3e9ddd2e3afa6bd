#!/usr/bin/env bash
# One device call (within 10 minutes on an H200) for quantized models and first use:
#  1. the kernels' tests on CUDA (the int8, HQQ 4-bit, quanto, torchao float8 and bitsandbytes 4-bit forms of the skinny GEMM in bf16, which the
#     CPU's interpreter cannot run, and the cache keys on Triton 3.6);
#  2. the first call's census in a fresh process with an empty Triton cache, then a warm one: every
#     compile, where the time goes (phases), and any kernel the disk cache holds twice (why a load missed);
#  3. the 8B quantized forms through generate() beside stock generate, transformers' continuous batching
#     and our sync loop (benchmarks/gpu_quantized.py).
# SKIP_TESTS=1 leaves step 1 out (TESTS=... names the test files instead of all six, TESTS_TIMEOUT its
# seconds); RESOLVE_DIFF=1 first diffs the resolve kernel's worker and serving compiles
# (benchmarks/gpu_resolve_cache_diff.py); SKIP_CENSUS=1 leaves step 2 out; PROBE=1 times the codebook
# 4-bit form per projection beside bitsandbytes' own path (benchmarks/codebook_gemm_probe.py) before step 3,
# and step 3's bitsandbytes 4-bit forms take the codebook form at the rows counts where the probe found it faster.
# Needs the quantization wheels the GPU image lacks: run(carry=[".whl"], ...). Results in $OUT.
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install --no-deps --no-index -q .whl/*.whl 2>&1 | tail -1
git log --oneline -1 | tee "$OUT/commit.txt"
if [ "${RESOLVE_DIFF:-0}" = 1 ]; then
  timeout 90 python3 benchmarks/gpu_resolve_cache_diff.py 2>&1 | tee "$OUT/resolve_diff.txt" | tail -40
fi
# (the kernels' tests only: each engine test compiles its own variants, 200 s for the four files on the H200)
TESTS=${TESTS:-tests/test_int8_gemm.py tests/test_hqq_gemm.py tests/test_quanto_gemm.py tests/test_torchao_float8_gemm.py tests/test_bnb_4bit_gemm.py tests/test_cache_keys.py}
[ "${SKIP_TESTS:-0}" = 1 ] || timeout ${TESTS_TIMEOUT:-200} python3 -m pytest -q $TESTS -k "not engine and not routed" -p no:cacheprovider --tb=line -rf \
  -W ignore 2>&1 | grep -E "^E |FAILED|passed|failed" | cut -c1-300 | tail -15 | tee "$OUT/tests.txt"
CACHE=$(mktemp -d)
[ "${SKIP_CENSUS:-0}" = 1 ] || for run in cold warm; do
  TRITON_CACHE_DIR=$CACHE timeout 100 python3 benchmarks/gpu_compile_census.py --json "$OUT/census_$run.json" \
    > "$OUT/census_$run.txt" 2>&1
  grep -E "^[0-9]+:|phases|cache:|compiled ahead" "$OUT/census_$run.txt" | cut -c1-600
done
BUCKETS=()
if [ "${PROBE:-0}" = 1 ]; then
  timeout ${PROBE_TIMEOUT:-150} python3 benchmarks/codebook_gemm_probe.py --json "$OUT/probe.json" 2>&1 \
    | grep -v -i warn | tail -40 | tee "$OUT/probe.txt"
  # the bitsandbytes 4-bit forms below then take the codebook form at the rows the probe found it faster
  WINS=$(grep -o '"form_wins_at_rows": \[[0-9, ]*\]' "$OUT/probe.txt" | grep -o '\[.*\]' | tr -d '[] ')
  [ -n "${WINS+x}" ] && BUCKETS=(--bnb-4bit-buckets "$WINS")
fi
timeout ${QUANTIZED_TIMEOUT:-330} python3 benchmarks/gpu_quantized.py --forms "${FORMS:-torchao-int8,torchao-float8,hqq-4bit-g128,quanto-int8,bnb-nf4,torchao-int4,bnb-int8}" \
  --budget ${QUANTIZED_BUDGET:-300} --new ${NEW:-512} --paths "${PATHS:-sync,hf-cb}" "${BUCKETS[@]}" --json "$OUT/quantized.json" 2>&1 | grep -v -i warn | tail -14
