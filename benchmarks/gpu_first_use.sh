#!/usr/bin/env bash
# One device call for first use (issue 29), within 8 minutes on an H200: the compiled kernels' tests
# on CUDA and the first-use test (a fresh process, an empty Triton cache: everything compiled in its
# first call, nothing in 20 later ones), then the first call's time with a cold and a warm Triton
# cache (benchmarks/gpu_first_call.py), then the sampling step's run time (against docs/benchmarks.md).
# Results in $OUT.
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -c "import torch, transformers, triton; print(torch.cuda.get_device_name(), 'torch', torch.__version__, \
'transformers', transformers.__version__, 'triton', triton.__version__)" 2>&1 | tee "$OUT/gpu.txt"
TEST_FILES=${TEST_FILES:-tests/test_first_use.py tests/test_sampled.py tests/test_sampled_search.py tests/test_greedy.py \
tests/test_store_kv.py tests/test_triton_attention.py}
timeout -s INT ${TEST_TIMEOUT:-240} python3 -m pytest -q -s $TEST_FILES -p no:cacheprovider --tb=short -rf 2>&1 \
  | grep -v -i warn | tail -120 > "$OUT/tests.txt"; tail -3 "$OUT/tests.txt"
timeout -s INT 50 python3 -m pytest -q tests/test_gpu.py -k compiles_and_captures_nothing -p no:cacheprovider \
  --tb=short -rf 2>&1 | tail -20 > "$OUT/test_gpu_runtime.txt"; tail -1 "$OUT/test_gpu_runtime.txt"
timeout 140 python3 benchmarks/gpu_first_call.py --shape llama3.2-1b --json "$OUT/first_call.json" 2>&1 \
  | grep -v -i warn | tee "$OUT/first_call.txt" | tail -6
timeout 40 python3 benchmarks/gpu_sampling.py 2>&1 | grep -v -i warn | tee "$OUT/sampling.txt"
