"""Compile every kernel variant a model shape implies for an H200 (sm_90), on a CPU, and time each.

    python benchmarks/compile_census_cpu.py --shape llama3.2-1b [--workers 2] [--json out.json]

No GPU needed: the kernels' JIT compiles for the H200's target (kernels/variant.py TargetDriver,
with the ptxas Triton's wheel ships), into a fresh Triton cache, so every compile is cold. The list
is kernels/model_variants.py's for the shape's facts (bf16, a Triton-attention engine with fused
element-wise kernels, greedy and sampled draws; skinny GEMMs only with --gemm, since which shapes
run them is the GPU's measured choice). For each variant: seconds, and the constexprs and launch
options that make it one of its kernel's variants (those whose values differ between them).
With --workers N, the whole list again into another fresh cache through the compile workers
(kernels/compile_workers.py), for the wall time a build would wait.

Run it with TRITON_INTERPRET unset. A CPU core here is slower than the H200 host's: compare ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import defaultdict

if os.environ.get("TRITON_INTERPRET"):
    sys.exit("unset TRITON_INTERPRET: the census compiles for the GPU")

import torch  # noqa: E402


def shape_facts(shape: str, page_size: int = 16, pages: int = 4096, gemm: bool = False):
    """ModelFacts of a tools/bench.py shape in bf16, as an H200 engine would read them."""
    from hf_async_cb.kernels import skinny_gemm
    from hf_async_cb.kernels.model_variants import AttentionKind, GemmFacts, ModelFacts
    from hf_async_cb.kernels.skinny_gemm_forms import PLAIN
    from hf_async_cb.tools.bench import SHAPES

    c = SHAPES[shape]
    heads, kv_heads = c["num_attention_heads"], c["num_key_value_heads"]
    hidden, inter, vocab = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    head_dim = c.get("head_dim", hidden // heads)
    dtype = torch.bfloat16
    pool = torch.empty(pages * page_size, kv_heads, head_dim, dtype=dtype, device="meta")
    gemms = ()
    if gemm:  # the lm_head through the kernel at every rows bucket, with its default config
        gemms = tuple(GemmFacts(vocab, hidden, False, b,
                                tuple(sorted(skinny_gemm.default_config(b, vocab, hidden, dtype).items())), PLAIN)
                      for b in (1 << i for i in range(9)))
    return ModelFacts(device_type="cuda", dtype=dtype, vocab=vocab, page_size=page_size,
                      attention=(AttentionKind(heads, pool, pool),), norms=((hidden, dtype, False),),
                      add_norms=((hidden, dtype),), rotary=((heads, kv_heads, head_dim),), mlps=((inter, False),),
                      gemms=gemms)


def settings(variant) -> dict:
    """A variant's constexprs, launch options and argument dtypes (tensors' element types)."""
    dtypes = {name: str(a).removeprefix("torch.") for name, a in zip(variant.kernel.arg_names, variant.args)
              if isinstance(a, torch.dtype)}
    return {**variant.constexprs, **variant.options, **dtypes}


def what_varies(variants) -> dict[str, set[str]]:
    """Per kernel, the constexprs, options and argument dtypes whose values differ between its variants."""
    values: dict[str, dict[str, set]] = defaultdict(lambda: defaultdict(set))
    for v in variants:
        kernel = values[v.name]
        for k, x in settings(v).items():
            kernel[k].add(repr(x))
    return {name: {k for k, xs in keys.items() if len(xs) > 1} for name, keys in values.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama3.2-1b")
    parser.add_argument("--gemm", action="store_true", help="include the lm_head's skinny GEMM at every bucket")
    parser.add_argument("--workers", type=int, default=0, help="also compile the list through N compile workers")
    parser.add_argument("--only", default="", help="comma-separated kernel names to compile (default: all)")
    parser.add_argument("--json")
    args = parser.parse_args()
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="census-")
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # (triton 3.9 warns when unset; 1 is its default)

    from hf_async_cb.kernels.compile_workers import compile_in_workers
    from hf_async_cb.kernels.model_variants import model_variants
    from hf_async_cb.kernels.variant import compiling_for, sm90

    variants = model_variants(shape_facts(args.shape, gemm=args.gemm))
    if args.only:
        variants = [v for v in variants if v.name.rsplit(".", 1)[-1] in args.only.split(",")]
    varies = what_varies(variants)
    target = sm90()
    report = dict(shape=args.shape, target="cuda sm_90")
    if args.workers:  # first, while this process's JIT holds nothing (the forked workers would inherit it)
        started = time.perf_counter()
        compiled = compile_in_workers(variants, target, args.workers)
        wall = time.perf_counter() - started
        failed = [c for c in compiled if c.error]
        print(f"through {args.workers} compile workers: {wall:.1f} s wall for {len(compiled)} variants"
              f" ({sum(c.seconds for c in compiled):.1f} s of compiling, {len(failed)} failed"
              f"{': ' + failed[0].error if failed else ''})\n", flush=True)
        report.update(workers=args.workers, workers_wall_s=round(wall, 2))
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="census-serial-")  # cold again
    with compiling_for(target):
        from hf_async_cb.kernels.store_kv import variants as store_variants  # a small compile: one-time set-up

        pool = torch.empty(16, 2, 16, dtype=torch.bfloat16, device="meta")
        started = time.perf_counter()
        store_variants(pool, pool, torch.float16, torch.float16)[0].warmup()
        setup = time.perf_counter() - started
        rows = []
        for v in variants:
            started = time.perf_counter()
            v.warmup()
            seconds = time.perf_counter() - started
            why = {k: x for k, x in settings(v).items() if k in varies[v.name]}
            rows.append(dict(kernel=v.name, seconds=round(seconds, 3), varies=why))
            print(f"{seconds:7.2f} s  {v.name:<40} {why or ''}", flush=True)
    total = sum(r["seconds"] for r in rows)
    per_kernel: dict[str, list[float]] = defaultdict(list)
    for r in rows:
        per_kernel[r["kernel"]].append(r["seconds"])
    print(f"\n{len(rows)} variants, {total:.1f} s compiled one after another (one-time set-up {setup:.1f} s)")
    for name, times in sorted(per_kernel.items(), key=lambda kv: -sum(kv[1])):
        print(f"  {name:<40} {len(times):3d} variants {sum(times):7.1f} s  (max {max(times):.2f} s)"
              f"  varies in: {', '.join(sorted(varies[name])) or '-'}")
    report.update(variants=rows, serial_s=round(total, 2), setup_s=round(setup, 2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
