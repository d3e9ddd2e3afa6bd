#!/usr/bin/env bash
# Device calls for what the 2026-12-06 third session built and could not measure, or measured on an
# H100 only. All steps take about 9 minutes on an H200, near the 10-minute limit: split them over two
# calls, STEPS="tests tower vlm" (about 4.5 minutes) and STEPS="serve weights" (about 4.5).
#  tests    the new kernels and patches on CUDA (vision rotary bit for bit, tower norms, padded MLPs with
#           their SiLU-mul, windows read as views, late admission);
#  tower    the Qwen2.5-VL-7B tower stage by stage (H100: 1,373 -> 515 ms; prediction with the padded
#           MLPs' SiLU-mul: ~460 ms);
#  vlm      Qwen2.5-VL-7B through generate beside stock (issue 31: >= 8x stock, >= 0.70 of the roofline;
#           H100: 6.07x, 0.728);
#  serve    the 8B serving benchmark with a 1,024-token system prompt: async (late admission, the
#           default), async-early (late admission off), caching off, sync (issues 28/30; H100, fifth
#           session: late TTFT p50 15.0 ms, early 19.6, caching off 47.6, sync 14.9);
#  weights  the per-call weights check (H100 at 2e43cee: 31 ms with the content pass, 14.4 ms without;
#           prediction after the one-walk fingerprint and the place-weighted rows: ~9 ms without, ~30-36
#           with: the same two reads, two more small kernels per tensor).
#  rates    (not in the default) the 8B shape's sync, async and async-early loops at 4, 16, 32 and 64 req/s
#           (issue 30; H100, seventh session: async TTFT p50 14.1 / 15.9 / 46.3 ms at 4 / 16 / 64 req/s,
#           early 19.0 / 22.0 / 44.5, sync 13.9 / 16.9 / 34.2);
#  vlmlate  (not in the default) serving with images, sync, async and async-early (H100, early: async TTFT
#           p50 151.7 ms against sync's 134.5; prediction: async within 5 ms of sync).
# STEPS picks some of them (default: the first five, in this order). Results in $OUT.
set -uo pipefail
export PYTHONPATH=.:tests PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STEPS=${STEPS:-tests tower vlm serve weights}
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/device.txt"
git log --oneline -1 2>/dev/null | tee "$OUT/commit.txt"
for step in $STEPS; do
  case $step in
    tests)
      timeout 150 python3 -m pytest -q tests/test_vision_rotary.py tests/test_tower_norms.py tests/test_aligned_mlp.py \
        tests/test_vision_attention.py tests/test_late_admission.py -p no:cacheprovider --tb=short -W ignore 2>&1 \
        | tee "$OUT/tests.txt" | grep -E "^E |FAILED|passed|failed" | cut -c1-300 | tail -12 ;;
    tower)
      timeout 120 python3 benchmarks/vlm_tower_profile.py --batches 64 2>&1 | grep -v -i warn \
        | grep -E "TFLOP ->|images per call|profiled|gpu " | head -20 | tee "$OUT/tower.txt" ;;
    vlm)
      timeout 240 python3 benchmarks/gpu_vlm.py --shape qwen2.5-vl-7b --skip-tiny --json "$OUT/vlm7b.json" 2>&1 \
        | grep -E '"(first_call_s|async_s|stock_s|vision_and_merge_s|again_s|speedup|roofline_s|fraction_of_roofline)"' ;;
    serve)
      timeout 330 python3 -m hf_async_cb bench --serve --shape llama3-8b --requests 64 --rate 4 --lengths sharegpt \
        --system-prompt 1024 --compare async,async-early,async-nocache,sync --json "$OUT/serve8b.json" 2>&1 \
        | grep -v -i warn | tail -9 ;;
    rates)
      timeout 420 python3 benchmarks/serving_rates.py --shape llama3-8b --rates 4,16,32,64 --paths sync,async,async-early \
        --peer-rate 0 --budget 360 --json "$OUT/rates8b.json" 2>&1 | grep -v -i warn | tail -16 ;;
    vlmlate)
      timeout 300 python3 benchmarks/vlm_serving.py --requests 64 --rate 8 --new 128 --loops sync,async,async-early \
        --json "$OUT/vlm_serving.json" 2>&1 | grep -v -i warn | tail -4 ;;
    weights)
      timeout 90 python3 benchmarks/fingerprint_cost.py 2>&1 | tail -1 | tee "$OUT/fingerprint.txt" ;;
  esac
done
