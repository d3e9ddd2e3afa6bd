#!/usr/bin/env python
"""Why the serving process does not find the compile workers' disk entry for the resolve kernel.

    PYTHONPATH=. python benchmarks/gpu_resolve_cache_diff.py [--logits bf16|fp32]

On the H200 (docs/benchmarks.md, third session of 2026-12-03) every kernel variant compiled ahead in
the forked workers (kernels/compile_workers.py) loads in milliseconds in the serving process, except
`draw_sampled._resolve_kernel`: the serving process compiles it again (1-1.6 s per variant), and
Triton's cache then holds two entries for one variant, whose metadata differ only in shared memory.
This compiles that one variant once in a worker and once in this process, each into a cache folder
of its own, then prints how their cache keys' inputs and their IRs differ (the first differing
lines of each stage). The worker compiles for the target this process's driver reports, as the
precompile does.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import glob
import json
import os
import tempfile

import torch


def _entry(folder: str, suffix: str) -> str | None:
    found = glob.glob(os.path.join(folder, "*", f"_resolve_kernel.{suffix}"))
    if not found:
        return None
    with open(found[0], errors="replace") as f:
        return f.read()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--logits", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--lines", type=int, default=30, help="differing lines shown per stage")
    args = parser.parse_args(argv)
    from triton.runtime.driver import driver

    from hf_async_cb.kernels import draw_sampled
    from hf_async_cb.kernels.compile_workers import compile_in_workers
    from hf_async_cb.kernels.variant import compiling_for, sm90

    dtype = torch.bfloat16 if args.logits == "bf16" else torch.float32
    vocab = 128256
    variant = next(v for v in draw_sampled.variants(dtype, vocab, vocab, torch.device("cuda"))
                   if v.name.endswith("_resolve_kernel"))
    worker_dir, parent_dir = tempfile.mkdtemp(), tempfile.mkdtemp()
    on_gpu = torch.cuda.is_available()  # off a GPU: both sides compile for an H200 (a check of this script)
    target = driver.active.get_current_target() if on_gpu else sm90()
    os.environ["TRITON_CACHE_DIR"] = worker_dir  # (read by Triton at each compile)
    reports = compile_in_workers([variant], target, 1)
    print("worker:", [(r.name, round(r.seconds, 2), r.error) for r in reports], flush=True)
    os.environ["TRITON_CACHE_DIR"] = parent_dir
    with contextlib.nullcontext() if on_gpu else compiling_for(target):
        variant.warmup()
    print("worker entries:", sorted(os.listdir(worker_dir)), "this process's:", sorted(os.listdir(parent_dir)))
    for stage in ("json", "source", "ttir", "ttgir", "llir", "ptx"):
        a, b = _entry(worker_dir, stage), _entry(parent_dir, stage)
        if a is None and b is None:
            continue
        if stage == "json" and a and b:
            ma, mb = json.loads(a), json.loads(b)
            differ = {k: (ma.get(k), mb.get(k)) for k in sorted(set(ma) | set(mb)) if ma.get(k) != mb.get(k)}
            print(f"== metadata: {len(differ)} fields differ: {json.dumps(differ, default=str)[:2000]}")
            continue
        if a == b:
            print(f"== {stage}: identical")
            continue
        diff = list(difflib.unified_diff((a or "").splitlines(), (b or "").splitlines(), "worker", "this process",
                                         lineterm="", n=0))
        print(f"== {stage}: {len(diff)} diff lines; the first {args.lines}:")
        print("\n".join(diff[: args.lines]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
