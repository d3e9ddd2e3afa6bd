#!/usr/bin/env bash
# One device call for what the prompt-embeddings change and the issues left open need measured:
# stock PEFT prompt tuning against the engine on this machine's transformers, GPU tests, the VLM
# benchmark (tiny fp32 LLaVA exact on CUDA; 7B shapes, 64 x (576 image + 64 text) -> 256 beside stock,
# with the roofline), warm throughput through generate() and a held Engine, and the serving latency
# of both loops. About 9 minutes in full; LEAN=1 keeps it near 6 (no Qwen2.5-VL shape, no 8B run, the
# GPU tests cut to the runtime's and the embeddings'). Results in $OUT.
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
LEAN=${LEAN:-}
timeout 40 python3 benchmarks/peft_stock_check.py 2>&1 | grep -i "rows equal\|error" | tee "$OUT/peft.txt" | tail -5
TESTS="tests/test_gpu.py tests/test_async_latency.py tests/test_prefix_caching.py tests/test_prompt_embeds.py"
[ -n "$LEAN" ] && TESTS="tests/test_gpu.py::test_generate_runtime_compiles_and_captures_nothing_after_warm_up tests/test_prompt_embeds.py"
timeout -s INT ${TEST_TIMEOUT:-150} python3 -m pytest -q $TESTS -p no:cacheprovider --tb=short -rf 2>&1 | tail -25 \
  > "$OUT/tests.txt"; tail -4 "$OUT/tests.txt"
timeout 150 python3 benchmarks/gpu_vlm.py --json "$OUT/vlm.json" 2>&1 | grep -v -i warn | tail -28
[ -z "$LEAN" ] && timeout 150 python3 benchmarks/gpu_vlm.py --shape qwen2.5-vl-7b --skip-tiny --json "$OUT/vlm-qwen.json" \
  2>&1 | grep -v -i warn | tail -26
[ -z "$LEAN" ] && timeout 100 python3 -m hf_async_cb bench --shape llama3-8b --requests 32 --prompt 128 --new 1024 \
  --compare generate-async,async --no-progress 2>&1 | grep -v -i warn | tail -8 | tee "$OUT/bench-8b.txt"
timeout 55 python3 -m hf_async_cb bench --shape llama3.2-1b --requests 64 --prompt 128 --new 256 \
  --compare generate-async,async,sync --no-progress 2>&1 | grep -v -i warn | tail -8 | tee "$OUT/bench-1b.txt"
timeout 75 python3 -m hf_async_cb bench --serve --shape llama3.2-1b --requests 256 --rate 32 --lengths sharegpt \
  --compare sync,async --no-progress 2>&1 | grep -v -i warn | tail -8 | tee "$OUT/serve.txt"
