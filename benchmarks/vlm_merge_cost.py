#!/usr/bin/env python
"""What one served request's image merge costs on the loop thread (Engine.add_request(media=...)),
and where that time goes: requests sent one at a time to a started engine, each merge timed with
the device synced around it, and one merge profiled (cProfile, cumulative time).

Why: serving with images (benchmarks/vlm_serving.py) showed ITL p99 near 280 ms against a p50 of
5-6 ms, and TTFT p50 near 275 ms: every running request waits while a new one's images are merged.

    PYTHONPATH=. python benchmarks/vlm_merge_cost.py [--shape qwen2.5-vl-7b|tiny] [--merges 6] [--device cuda]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import gpu_vlm  # noqa: E402
import vlm_serving  # noqa: E402

import hf_async_cb  # noqa: E402
from hf_async_cb.engine import serving_api  # noqa: E402  (where add_request finds media_embeds)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=tuple(vlm_serving.SHAPES), default="qwen2.5-vl-7b")
    p.add_argument("--merges", type=int, default=6)
    p.add_argument("--device", default="cuda")
    p.add_argument("--json")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    text, vision, grid = vlm_serving.SHAPES[args.shape]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    model = gpu_vlm.qwen_vl(text, vision, dtype, device)
    requests = vlm_serving.requests_of(model, args.merges, 64, grid, device, seed=0)
    timings, profiled = [], {}
    real = serving_api.media_embeds

    def timed(model, request, **kwargs):
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        sync()
        began = time.perf_counter()
        if len(timings) == args.merges - 1:  # the last one, profiled (the others timed alone)
            profile = cProfile.Profile()
            profile.enable()
            real(model, request, **kwargs)
            sync()
            profile.disable()
            text = io.StringIO()
            pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(25)
            profiled["top"] = text.getvalue()
        else:
            real(model, request, **kwargs)
            sync()
        timings.append(time.perf_counter() - began)

    serving_api.media_embeds = timed
    engine = hf_async_cb.Engine(model, hf_async_cb.BatchingConfig(mode="async"))
    engine.start()
    try:
        for ids, media in requests:
            engine.add_request(ids, max_new_tokens=4, media=media).result(timeout=600)
    finally:
        serving_api.media_embeds = real
        engine.shutdown(timeout=600)
        engine.close()
    report = {"shape": args.shape, "merge_ms": [round(t * 1e3, 1) for t in timings]}
    print(json.dumps(report))
    print(profiled.get("top", "")[:6000])
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**report, "profile": profiled.get("top", "")}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
