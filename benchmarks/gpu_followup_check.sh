#!/usr/bin/env bash
# What the 2026-12-04 (second) session built and could not run on the GPU, in one device call (about
# 9 minutes on an H200; STEPS picks some of them, e.g. STEPS="tests probe"):
#  tests   the OOM-injection and soak tests (tests/test_gpu_reliability.py), and the bitsandbytes 4-bit
#          tests with the fp32 engine test and the bf16 near-tie test (tests/test_bnb_4bit_gemm.py);
#  probe   the codebook form per projection beside bitsandbytes' own path, with the block-tables
#          variant (benchmarks/codebook_gemm_probe.py);
#  vlm     a GRPO-shaped Qwen2.5-VL-7B call (64 rows = 8 images x 8 copies) through generate() beside
#          stock: each image encoded once (benchmarks/gpu_vlm.py --repeat 8);
#  serve   (not in the default STEPS) 64 requests with an image each at 8 req/s through
#          Engine.add_request(media=...), sync and async (benchmarks/vlm_serving.py).
# Needs the quantization wheels the GPU image lacks: run(carry=[".whl"], ...). Results in $OUT.
set -uo pipefail
export PYTHONPATH=.:tests PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STEPS=${STEPS:-tests probe vlm}
python3 -m pip install --no-deps --no-index -q .whl/*.whl 2>&1 | tail -1
git log --oneline -1 | tee "$OUT/commit.txt"
for step in $STEPS; do
  case $step in
    tests)
      timeout 200 python3 -m pytest -q tests/test_gpu_reliability.py tests/test_bnb_4bit_gemm.py -p no:cacheprovider \
        --tb=short -W ignore 2>&1 | tee "$OUT/tests.txt" | grep -E "^E |FAILED|passed|failed" | cut -c1-300 | tail -20 ;;
    probe)
      timeout 150 python3 benchmarks/codebook_gemm_probe.py --rows 1,2,32,128 --json "$OUT/probe.json" 2>&1 \
        | grep -v -i warn | tail -20 ;;
    vlm)
      timeout 240 python3 benchmarks/gpu_vlm.py --shape qwen2.5-vl-7b --skip-tiny --requests 64 --repeat 8 --new 128 \
        --json "$OUT/vlm_repeat8.json" 2>&1 | grep -v -i warn | tail -30 ;;
    serve)
      timeout 300 python3 benchmarks/vlm_serving.py --requests 64 --rate 8 --new 128 --json "$OUT/vlm_serving.json" \
        2>&1 | grep -v -i warn | tail -6 ;;
  esac
done
