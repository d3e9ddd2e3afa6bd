#!/usr/bin/env bash
# The device calls the open issues still owe (docs/benchmarks.md, 2026-12-08), each step one call of at most
# ~9 minutes; run with carry=[".whl"] (bash benchmarks/fetch_gpu_wheels.sh first). STEPS picks them, in order:
#  tests     the CUDA checks not yet run since their last change (~3 min): the stream probe (quanto's int4 QLinear
#            probed under no_grad), the grouped weights rebuilt whole for prefill (bit for bit on bf16, sm_90 build),
#            the tinygemm model test (its lm_head now bf16), graph safety;
#  quanto    issue 27: quanto int4 / int2 and HQQ 4-bit at 8B through generate, with the prefill rebuild's A/B
#            (`library-prefill`: the library's own forward for prefill steps) and a profiled step (~8 min on an
#            H100; prediction: int4 4.56 -> ~2.7 s, int2 2.81 -> ~2.5 s, HQQ 4-bit a few percent);
#  vlm       issue 31 on an H200: Qwen2.5-VL-7B beside stock (targets 8x, 0.70 of the roofline; ~5 min);
#  prefix8b  issue 28 on an H200: the 8B group table beside stock and transformers' CB (~9 min; few-shot's stock
#            runs out of memory in its 256 x 2,112-token prefill on any card);
#  rates     issue 30: 8B serving at 32 and 64 req/s, sync and async (~7 min);
#  stack     issue 27: every form a user loads on CUDA (benchmarks/gpu_model_stack.py: exact, refused, DIFFERS,
#            REBUILT; bitsandbytes int8's runtime was rebuilt at every call before a033bfc) (~3 min);
#  grouped   issue 27: the grouped form's config sweep at the 8B shapes, 4 bits (benchmarks/tune_grouped.py; a
#            few minutes of compiles; prediction: a config 1.3-2x faster than the default on the large shapes).
set -uo pipefail
export PYTHONPATH=.:tests PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STEPS=${STEPS:-tests quanto}
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/device.txt"
python3 -m pip install --no-deps --no-index -q .whl/*.whl 2>&1 | grep -v -i warn | tail -1
for step in $STEPS; do
  case $step in
    tests)
      timeout 240 python3 -m pytest -q tests/test_stream_probe.py tests/test_grouped_dequant.py tests/test_graph_safety.py \
        tests/test_quanto_grouped.py -p no:cacheprovider --tb=short -rs -W ignore 2>&1 | tee "$OUT/tests.txt" \
        | grep -E "^E |SKIP|FAILED|passed|failed" | cut -c1-300 | tail -14 ;;
    quanto)
      timeout 500 python3 benchmarks/gpu_quantized.py --forms quanto-int4-head-bf16,quanto-int2-head-bf16,hqq-4bit \
        --paths library-prefill,kernels --new 256 --budget 450 --json "$OUT/quantized.json" 2>&1 | grep -v -i warn \
        | tail -6 ;;
    vlm)
      STEPS="tower vlm" bash benchmarks/gpu_towers_and_admission.sh ;;
    prefix8b)
      timeout 540 python3 -m hf_async_cb.tools.shared_prefix --shape llama3-8b --workloads group \
        --paths stock,hf-cb-sync,cache-off,cache-on --calls 2 --json "$OUT/prefix8b.json" 2>&1 | grep -v -i warn | tail -8 ;;
    stack)
      timeout 400 python3 benchmarks/gpu_model_stack.py --out "$OUT/model_stack_gpu.json" 2>&1 | grep -v -i warn \
        | grep -E "^[a-z0-9-]+ +[A-Za-z]|forms:" | cut -c1-200 ;;
    grouped)
      timeout 540 python3 benchmarks/tune_grouped.py --m 32 --forms fma_centered:4:128,hqq:4:64 2>&1 \
        | grep -v -i warn | tee "$OUT/tune_grouped.txt" | grep -E "^[a-z]|default|step" | cut -c1-260 ;;
    rates)
      timeout 480 python3 benchmarks/serving_rates.py --shape llama3-8b --rates 64,32 --paths sync,async --peer-rate 0 \
        --budget 420 --json "$OUT/rates.json" 2>&1 | grep -v -i warn | tail -8 ;;
  esac
done
