#!/usr/bin/env bash
# One device call on an H200 for bitsandbytes' LLM.int8() through kernels/llm_int8.py:
#  1. tests/test_llm_int8.py on CUDA (the kernels against bitsandbytes' CUDA path bit for bit, an engine's
#     tokens against stock, CUDA graphs captured);
#  2. the kernels per 8B projection beside bitsandbytes' own forward and cuBLAS on bf16 (benchmarks/llm_int8_probe.py),
#     with one outlier column, then with a tenth of the columns (as random weights' down-projection inputs hold),
#     at 32 rows also the kernels of commit BEFORE (default 6ae0cb8: the outlier product in the finish kernel);
#  3. the 8B LLM.int8() model through generate() beside stock generate, transformers' continuous batching
#     and our sync loop, then the top kernels of a profiled call (benchmarks/gpu_quantized.py --forms bnb-int8).
# All three take about 11 minutes: TESTS=0 leaves step 1 out (its 59 tests passed on 2026-12-05, 175 s).
# Needs the bitsandbytes wheel the GPU image lacks: run(carry=[".whl"], ...). Results in $OUT.
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install --no-deps --no-index -q .whl/*.whl 2>&1 | tail -1
git log --oneline -1 | tee "$OUT/commit.txt"
[ "${TESTS:-1}" = 0 ] || timeout ${TESTS_TIMEOUT:-200} python3 -m pytest -q tests/test_llm_int8.py -k "${TESTS_K:-not sm90}" -p no:cacheprovider --tb=short -rf -W ignore \
  2>&1 | grep -E "^E |FAILED|passed|failed|Error" | cut -c1-400 | tail -25 | tee "$OUT/tests.txt"
timeout ${PROBE_TIMEOUT:-90} python3 benchmarks/llm_int8_probe.py --json "$OUT/probe.json" 2>&1 | grep -v -i warn \
  | tail -14 | tee "$OUT/probe.txt"
timeout ${PROBE_TIMEOUT:-90} python3 benchmarks/llm_int8_probe.py --rows 32 --outlier-share 0.1 --json "$OUT/probe_many.json" \
  2>&1 | grep -v -i warn | tail -5 | tee "$OUT/probe_many.txt"
git show ${BEFORE:-6ae0cb8}:hf_async_cb/kernels/llm_int8.py > /tmp/llm_int8_before.py \
  && timeout ${PROBE_TIMEOUT:-90} python3 benchmarks/llm_int8_probe.py --rows 32 --outlier-share 0.1 \
     --kernel-from /tmp/llm_int8_before.py --json "$OUT/probe_many_before.json" 2>&1 | grep -v -i warn | tail -5 \
  | tee "$OUT/probe_many_before.txt"
timeout ${QUANTIZED_TIMEOUT:-330} python3 benchmarks/gpu_quantized.py --forms bnb-int8 --budget ${QUANTIZED_BUDGET:-300} \
  --new ${NEW:-512} --paths "${PATHS:-sync,hf-cb,kernels}" --json "$OUT/quantized.json" 2>&1 | grep -v -i warn | tail -14
