#!/usr/bin/env python
"""Serving with images: requests with one image each arriving at a rate, through
`Engine.add_request(ids, media=...)`, the sync and the async loop side by side (TTFT, ITL, E2E).

    PYTHONPATH=. python benchmarks/vlm_serving.py [--shape qwen2.5-vl-7b|tiny] [--requests 64] [--rate 8]
                                                  [--new 128] [--device cuda] [--json out.json]

Each request: 64 text tokens around one image (576 tokens at the 7B shape: a 48 x 48 patch grid
merged 2 x 2), its own image, random bf16 weights (benchmarks/gpu_vlm.py's builders). A request's
images are merged on the loop thread right before it is taken in, so its TTFT includes its vision
tower. `--shape tiny --device cpu` checks that the script runs (the figures mean nothing there).
A warm-up run of the same shapes (other images) comes first, not timed.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import gpu_vlm  # noqa: E402  (the model and input builders)

import hf_async_cb  # noqa: E402
from hf_async_cb import BatchingConfig  # noqa: E402
from hf_async_cb.tools.bench import our_path  # noqa: E402
from hf_async_cb.tools.serving_client import drive  # noqa: E402
from hf_async_cb.tools.serving_metrics import Trace, summarize  # noqa: E402
from hf_async_cb.tools.serving_workload import Workload, arrival_times  # noqa: E402

SHAPES = {
    "qwen2.5-vl-7b": (dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                           num_key_value_heads=4, vocab_size=152064, max_position_embeddings=32768),
                      dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                           fullatt_block_indexes=[7, 15, 23, 31]), 48),
    "tiny": (dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=512, max_position_embeddings=2048),
             dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1]), 8),
}


def requests_of(model, count: int, text: int, grid: int, device, seed: int) -> list[tuple[list[int], dict]]:
    """Per request: its prompt ids and its media (one image's patches and grid), each image its own."""
    batch = gpu_vlm.qwen_batch(model, count, text, grid, device, seed=seed)
    patches = batch["pixel_values"].reshape(count, grid * grid, -1)
    out = []
    for i in range(count):
        media = dict(pixel_values=patches[i], image_grid_thw=batch["image_grid_thw"][i:i + 1])
        if "mm_token_type_ids" in batch:
            media["mm_token_type_ids"] = batch["mm_token_type_ids"][i:i + 1]
        out.append((batch["input_ids"][i].tolist(), media))
    return out


def serve(model, path: str, requests, arrivals, new: int) -> dict:
    """One loop's run: `path` as bench names our paths (sync, async, async-early, ...: bench.our_path)."""
    mode, changes = our_path(path)
    engine = hf_async_cb.Engine(model, BatchingConfig(mode=mode, **changes))
    engine.start()
    try:
        warm = [engine.add_request(ids, max_new_tokens=new, media=media) for ids, media in requests[1]]
        for handle in warm:
            handle.result(timeout=600)
        work = Workload([ids for ids, _ in requests[0]], [new] * len(arrivals), arrivals, None, "fixed", "")
        handles = {}

        def submit(i: int, trace: Trace) -> None:
            ids, media = requests[0][i]
            handles[i] = engine.add_request(ids, max_new_tokens=new, media=media,
                                            on_token=lambda request, token, t=trace: t.token_times.append(
                                                time.perf_counter()))

        traces, lag = drive(work, submit)
        for handle in handles.values():
            handle.result(timeout=600)
    finally:
        engine.shutdown(timeout=600)
        engine.close()
    report = summarize(traces)
    report["client_lag_s"] = lag
    return report


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=tuple(SHAPES), default="qwen2.5-vl-7b")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--rate", type=float, default=8.0, help="requests/s (inf: all at once)")
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--text", type=int, default=64)
    p.add_argument("--device", default="cuda")
    p.add_argument("--loops", default="sync,async", help="our paths as bench names them: sync, async, async-early, ...")
    p.add_argument("--json")
    args = p.parse_args(argv)
    loops = args.loops.split(",")
    if any(our_path(loop) is None for loop in loops):
        p.error(f"--loops takes our paths as bench names them (sync, async, async-early, ...), got {args.loops!r}")
    device = torch.device(args.device)
    text, vision, grid = SHAPES[args.shape]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    model = gpu_vlm.qwen_vl(text, vision, dtype, device)
    timed = requests_of(model, args.requests, args.text, grid, device, seed=0)
    warmup = requests_of(model, min(args.requests, 8), args.text, grid, device, seed=1)
    arrivals = arrival_times(args.requests, args.rate if args.rate > 0 else math.inf)
    report = {"shape": args.shape, "requests": args.requests, "rate": args.rate, "new": args.new,
              "image_tokens": grid * grid // 4, "device": str(device)}
    for mode in loops:
        result = serve(model, mode, (timed, warmup), arrivals, args.new)
        report[mode] = result
        ttft, itl = result["ttft_ms"], result["itl_ms"]
        print(f"{mode}: TTFT p50 {ttft['p50']:.1f} / p99 {ttft['p99']:.1f} ms, ITL p50 {itl['p50']:.2f} / "
              f"p99 {itl['p99']:.2f} / mean {itl['mean']:.2f} ms, E2E p50 {result['e2e_s']['p50']:.2f} s, "
              f"{result['output_throughput']:.0f} tok/s, client lag {result['client_lag_s'] * 1e3:.1f} ms",
              flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
