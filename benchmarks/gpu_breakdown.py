"""Where a decode step's GPU time goes, on the H200: kernel microbenchmarks and a per-kind split.

1. Paged attention for decode, Triton vs the pure-torch reference, at the bench shapes: time per
   call and the KV bytes read per second.
2. One async run of a bench workload under torch.profiler: kernel time summed by kind (GEMMs,
   attention, everything else) per decode step, from the kernels the graph replays launch.

    python benchmarks/gpu_breakdown.py --shape llama3-8b --requests 32 --prompt 128 --new 128
"""

from __future__ import annotations

import argparse
import collections

import torch

from hf_async_cb import BatchingConfig, Engine
from hf_async_cb.kernels.graph_timing import graph_ms
from hf_async_cb.kernels.attention_launch import choose_splits
from hf_async_cb.kernels.paged_attention import paged_attention_triton
from hf_async_cb.kernels.paged_attention_reference import paged_attention_reference
from hf_async_cb.tools.bench import SHAPES, _prompts, build_model
from tune_kernels import decode_case  # (benchmarks/, the script's own folder)


def time_ms(fn, graph: bool = True, iters: int = 20) -> float:
    """ms per call of fn(): replayed from a CUDA graph (as the engine runs it: no launch cost), or
    eagerly between CUDA events (graph=False: for the reference, which syncs with the host)."""
    if graph:
        return graph_ms(lambda i: fn())
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def attention_table(shape: str, requests: int, contexts: list[int], page: int = 16) -> None:
    """Decode attention per layer as the engine runs it (tune_kernels.decode_case: the new K/V stored
    by the kernel, pools rotated so that no call finds its K/V in L2), beside the reference."""
    c = SHAPES[shape]
    heads, kv_heads = c["num_attention_heads"], c["num_key_value_heads"]
    head_dim = c["hidden_size"] // heads
    print(f"\n{shape} decode attention, {requests} requests, one layer (bf16, page {page}, cold L2)")
    print("| context | triton ms | splits | KV GB/s | reference ms | speed-up |\n|---|---|---|---|---|---|")
    for ctx in contexts:
        q, pools, new_kv, meta, kv_bytes = decode_case(requests, ctx, heads, kv_heads, head_dim, page)
        t_tri = graph_ms(lambda i: paged_attention_triton(q, *pools[i % len(pools)], meta, None, new_kv=new_kv))
        t_ref = time_ms(lambda: (meta.begin_forward(), paged_attention_reference(q, *pools[0], meta, None)), graph=False)
        print(f"| {ctx} | {t_tri:.3f} | {choose_splits(meta, kv_heads, q.device)} | {kv_bytes / t_tri / 1e6:,.0f} | "
              f"{t_ref:.3f} | {t_ref / t_tri:.1f}x |")


def kind(name: str) -> str:
    n = name.lower()
    if "paged_attention" in n or "merge_splits" in n:
        return "attention"
    if any(k in n for k in ("gemm", "cutlass", "xmma", "nvjet", "matmul", "splitk")):
        return "GEMMs"
    return "rest"


def step_breakdown(shape: str, requests: int, prompt: int, new: int, config: BatchingConfig) -> None:
    from torch.profiler import ProfilerActivity, profile

    model = build_model(shape, torch.device("cuda"), torch.bfloat16)
    prompts = _prompts(requests, prompt, model.config.vocab_size)
    engine = Engine(model, config)
    engine.generate(prompts, max_new_tokens=new)  # warm-up: graph captures
    engine.clear_prefix_cache()  # the profiled run prefills its prompts, as a first sight of them would
    pipeline = engine.pipeline(config.mode)
    before = pipeline.num_steps
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.generate(prompts, max_new_tokens=new)
        torch.cuda.synchronize()
    steps = pipeline.num_steps - before
    totals: dict = collections.defaultdict(float)
    names: dict = collections.defaultdict(float)
    launches = 0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and "memcpy" not in e.name.lower():
            totals[kind(e.name)] += e.device_time_total / 1e3
            names[e.name] += e.device_time_total / 1e3
            launches += 1
    total = sum(totals.values())
    print(f"\n{shape}, {requests} x prompt {prompt} x {new} new, {config.mode}: kernel time per step "
          f"over {steps} steps (prefill included)")
    print("| kind | ms/step | share |\n|---|---|---|")
    for k in ("GEMMs", "attention", "rest"):
        print(f"| {k} | {totals[k] / steps:.3f} | {100 * totals[k] / total:.0f}% |")
    print(f"| all kernels | {total / steps:.3f} | 100% |")
    print(f"kernels per step: {launches / steps:.0f}")
    print("top kernels (ms/step):")
    for name, ms in sorted(names.items(), key=lambda kv: -kv[1])[:25]:
        print(f"  {ms / steps:8.3f}  {name[:110]}")
    engine.close()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="llama3-8b")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--contexts", default="256,640,1152,4096,16384")
    p.add_argument("--attention", default="auto")
    p.add_argument("--skip-steps", action="store_true")
    args = p.parse_args()
    attention_table(args.shape, args.requests, [int(c) for c in args.contexts.split(",")])
    if not args.skip_steps:
        config = BatchingConfig(mode="async", attention=args.attention, max_running_requests=args.requests,
                                max_batch_tokens=2048)
        step_breakdown(args.shape, args.requests, args.prompt, args.new, config)


if __name__ == "__main__":
    main()
