#!/usr/bin/env bash
# Device calls for the prefill buckets by powers of 4 and the paths of 2026-12-07 that ran on CUDA only
# in tests. STEPS picks (default "tests ab"; about 8 minutes on an H100):
#  tests     the new paths on CUDA (callbacks that run the model, prefix constraints, guidance,
#            watermarks) and the graph tests (buckets, lending, a warm runtime captures nothing);
#  ab        the 8B serving load at RATES (default 32 req/s), sync and async, prefill context buckets by
#            powers of 4 (step 2, the default now) and of 2 (step 1, before): TTFT, eager steps and the
#            buckets they missed (issue 30: async TTFT p50 within 2 ms of sync);
#  evict     the same load at RATES (default 32,64), sync and async, with prefill graph places changing hands
#            after 8 eager steps and without (cuda_graphs.PREFILL_EVICT_AFTER_MISSES: 8 against 0, the default);
#            prediction: async's eager steps at 32 req/s 60 -> <= 10, TTFT p50 within 2 ms of sync's. Run
#            `tests` first: test_cuda_graphs.py's places test drops and captures graphs mid-call on CUDA;
#  hold      the same load at RATES (default 64,32,16,4), sync and async, the async loop holding its build while
#            arrivals are taken in (the default now) and cutting its wait at an arrival (the earlier rule:
#            --arrivals-end-wait 0,1); prediction: at 8B 64 req/s async's TTFT p50 +11.7 -> within 3 ms of
#            sync's, the split's to-build half shorter; no worse at 4-32;
#  share     the same load at RATES (default 64,16), sync and async, the async loop's margin floor at a quarter of
#            a step (the default) and a tenth (HF_ASYNC_CB_LATE_MIN_SHARE; with the held build, an arrival in the
#            margin is what async's first tokens still pay: +3.2 ms at 64 req/s on an H100); prediction: 0.1
#            brings async within 2 ms of sync at 64 req/s, p99 no higher at 16;
#  guidance  classifier-free guidance through generate, stock against both loops (8B, 32 x 128 -> 128);
#  vlm       Qwen2.5-VL-7B through generate beside stock (issue 31);
#  lending   a 7-row call lent the 64-row decode graphs against its own (benchmarks/decode_lending_ab.py).
# Results in $OUT.
set -uo pipefail
export PYTHONPATH=.:tests PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STEPS=${STEPS:-tests ab}
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/device.txt"
git log --oneline -1 2>/dev/null | tee "$OUT/commit.txt"
for step in $STEPS; do
  case $step in
    tests)
      timeout ${TESTS_TIMEOUT:-200} python3 -m pytest -q tests/test_callback_forwards.py tests/test_prefix_constraint.py \
        tests/test_guidance.py tests/test_watermarking.py tests/test_cuda_graphs.py \
        "tests/test_gpu.py::test_generate_runtime_compiles_and_captures_nothing_after_warm_up" \
        -p no:cacheprovider --tb=short -W ignore 2>&1 | tee "$OUT/tests.txt" \
        | grep -E "^E |FAILED|passed|failed" | cut -c1-300 | tail -12 ;;
    ab)
      timeout ${AB_TIMEOUT:-330} python3 benchmarks/serving_rates.py --shape ${SHAPE:-llama3-8b} --rates ${RATES:-32} \
        --paths sync,async --prefill-context-steps 2,1 --peer-rate 0 --budget ${AB_BUDGET:-290} \
        --json "$OUT/rates_ab.json" 2>&1 | grep -v -i warn | grep -E "^\||eager steps' buckets|skipped" | tail -20 ;;
    evict)
      timeout ${AB_TIMEOUT:-400} python3 benchmarks/serving_rates.py --shape ${SHAPE:-llama3-8b} --rates ${RATES:-32,64} \
        --paths sync,async --evict-after 8,0 --peer-rate 0 --budget ${AB_BUDGET:-330} \
        --json "$OUT/rates_evict.json" 2>&1 | grep -v -i warn | grep -E "^\| [0-9]|eager steps' buckets|skipped" | tail -24 ;;
    hold)
      timeout ${AB_TIMEOUT:-560} python3 benchmarks/serving_rates.py --shape ${SHAPE:-llama3-8b} --rates ${RATES:-64,32,16,4} \
        --paths sync,async --arrivals-end-wait 0,1 --peer-rate 0 --budget ${AB_BUDGET:-480} \
        --json "$OUT/rates_hold.json" 2>&1 | grep -v -i warn | grep -E "^\| [0-9]|skipped" | tail -24 ;;
    share)
      timeout ${AB_TIMEOUT:-560} python3 benchmarks/serving_rates.py --shape ${SHAPE:-llama3-8b} --rates ${RATES:-64,16} \
        --paths sync,async --late-min-share 0.25,0.1 --peer-rate 0 --budget ${AB_BUDGET:-480} \
        --json "$OUT/rates_share.json" 2>&1 | grep -v -i warn | grep -E "^\| [0-9]|skipped" | tail -24 ;;
    guidance)
      timeout 240 python3 benchmarks/guidance_bench.py --shape llama3-8b --rows 32 --prompt 128 --new 128 2>&1 \
        | grep -v -i warn | tail -8 | tee "$OUT/guidance.txt" ;;
    vlm)
      timeout 240 python3 benchmarks/gpu_vlm.py --shape qwen2.5-vl-7b --skip-tiny --json "$OUT/vlm7b.json" 2>&1 \
        | grep -E '"(first_call_s|async_s|stock_s|vision_and_merge_s|again_s|speedup|roofline_s|fraction_of_roofline)"' ;;
    lending)
      timeout 120 python3 benchmarks/decode_lending_ab.py 2>&1 | grep -v -i warn | tail -8 | tee "$OUT/lending.txt" ;;
  esac
done
