"""How a generate call's time depends on the stack depth it is called at, with the step loop above a
large chunk of CPython's frame stack (engine/stack_chunk.py) and without.

Why: on CPython 3.11/3.12 a loop whose calls cross the end of a 16 KiB chunk of frames maps and unmaps
that chunk on every such call; where that happens depends on the caller's depth (a script, a notebook,
a trainer's callbacks). The scan calls the same generate at depths 0, 2, ... and reports, per depth,
the call's wall time and the process's minor page faults (a chunk mapped afresh faults its first page
in).

    python benchmarks/stack_depth_scan.py [--shape tiny] [--device cpu] [--depths 64] [--requests 16 --new 64]
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time

import torch


def main(argv=None) -> int:
    from hf_async_cb import BatchingConfig, Engine
    from hf_async_cb.engine import engine as engine_module
    from hf_async_cb.tools.bench import _prompts, build_model

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="tiny")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--depths", type=int, default=64, help="scan depths 0, 2, ... below this")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prompt", type=int, default=16)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--json")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    model = build_model(args.shape, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    prompts = _prompts(args.requests, args.prompt, model.config.vocab_size)
    engine = Engine(model, BatchingConfig(mode="async"))
    engine.generate(prompts, max_new_tokens=4)  # (warm: graphs, kernels)
    opening = engine_module.above_a_large_stack_chunk

    def at_depth(depth: int):
        if depth:
            return at_depth(depth - 1)
        if device.type == "cuda":
            torch.cuda.synchronize()
        faults, start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
        engine.generate(prompts, max_new_tokens=args.new)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults

    rows = []
    for label, loop_above in (("above the large frame", opening), ("without it", lambda fn, *a: fn(*a))):
        engine_module.above_a_large_stack_chunk = loop_above
        for depth in range(0, args.depths, 2):
            seconds, faults = at_depth(depth)
            rows.append(dict(loop=label, depth=depth, seconds=round(seconds, 4), minor_faults=faults))
    engine_module.above_a_large_stack_chunk = opening
    engine.close()
    for label in ("above the large frame", "without it"):
        mine = [r for r in rows if r["loop"] == label]
        times = sorted(r["seconds"] for r in mine)
        worst = max(mine, key=lambda r: r["seconds"])
        print(f"{label:>22}: median {times[len(times) // 2]:.4f} s, worst {worst['seconds']:.4f} s at depth "
              f"{worst['depth']}, faults per call median {sorted(r['minor_faults'] for r in mine)[len(mine) // 2]}, "
              f"max {max(r['minor_faults'] for r in mine)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(python=sys.version.split()[0], shape=args.shape, device=str(device), rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
