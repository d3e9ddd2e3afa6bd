"""What a user of `model.generate(batching=...)` sees, first call included, beside a held Engine.

    python benchmarks/gpu_generate_runtime.py --shape llama3.2-1b --requests 64 --prompt 128 --new 256 \
        --stock --loop 20 --json out.json

In one fresh process, on random weights:
1. the first generate(batching="async") call (model built beforehand; kernels compiled, graphs
   captured, pool sized inside the call), then calls 2..4: greedy, then sampled;
2. the same workload on the runtime's engine held directly (Engine.generate): what generate() adds;
3. `--loop N`: a warm-up pass over batch sizes 1..64, then N calls of random sizes, each timed
   beside the held engine on the same batch, with the kernel compiles and graph captures counted;
4. `--stock`: stock generate on the same workload.
Set TRITON_CACHE_DIR to an empty folder for a cold first call, reuse it for a warm one.
"""

from __future__ import annotations

import argparse
import json
import random

import torch

import hf_async_cb
from hf_async_cb.generate import runtime
from hf_async_cb.kernels import compiled_keys, compiled_variants
from hf_async_cb.tools.bench import SAMPLING, _prompts, build_model, copy_bandwidth, floor_ms_per_step
from hf_async_cb.tools.timing import timed

CUDA = torch.device("cuda")


def through_generate(model, prompts, new, sample=False, seed=0):
    hf_async_cb.clear_prefix_cache(model)  # every timed call prefills its prompts, as stock's does
    ids = torch.tensor(prompts, device="cuda")
    decoding = dict(SAMPLING) if sample else dict(do_sample=False)
    config = hf_async_cb.BatchingConfig(seed=seed) if sample else None
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, batching="async",
                          batching_config=config, eos_token_id=None, pad_token_id=0, **decoding)


def held(model, prompts, new, sample=False):
    engine = runtime._RUNTIMES[model].engine
    engine.clear_prefix_cache()  # as through_generate: no reuse of an earlier call's prompts
    decoding = dict(SAMPLING) if sample else dict(do_sample=False)
    engine.config = hf_async_cb.BatchingConfig(seed=0) if sample else hf_async_cb.BatchingConfig()
    return engine.generate(prompts, max_new_tokens=new, **decoding)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama3.2-1b")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument("--calls", type=int, default=3, help="warm calls after the first, per decoding")
    parser.add_argument("--loop", type=int, default=0, help="calls of random batch sizes 1..64 (64 new tokens)")
    parser.add_argument("--stock", action="store_true")
    parser.add_argument("--json")
    args = parser.parse_args()
    report: dict = {"shape": args.shape, "requests": args.requests, "prompt": args.prompt, "new": args.new,
                    "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    model = build_model(args.shape, torch.device("cuda"), torch.bfloat16)
    prompts = _prompts(args.requests, args.prompt, model.config.vocab_size)
    tokens = args.requests * args.new
    bandwidth = copy_bandwidth(torch.device("cuda"))
    report["floor_s"] = floor_ms_per_step(model, args.requests, args.prompt, args.new, bandwidth) * args.new / 1e3
    rows = []

    def record(what, seconds, **extra):
        rows.append(dict(what=what, seconds=seconds, tokens_per_s=tokens / seconds, **extra))
        print(f"{what:<34} {seconds:8.3f} s {tokens / seconds:10,.0f} tok/s  {extra or ''}", flush=True)

    compiles = compiled_variants()
    seconds, _ = timed(lambda: through_generate(model, prompts, args.new), CUDA)
    rt = runtime._RUNTIMES[model]
    record("generate, first call in the process", seconds, compiles=compiled_variants() - compiles,
           captures=rt.engine.graphs.num_captured, capture_s=sum(rt.engine.graphs.capture_seconds))
    for sample in (False, True):
        label = "sampled" if sample else "greedy"
        for i in range(args.calls + sample):  # the first sampled call captures the sampled buckets
            captures, compiles = rt.engine.graphs.num_captured, compiled_variants()
            seconds, _ = timed(lambda: through_generate(model, prompts, args.new, sample), CUDA)
            record(f"generate {label}, call {i + 2 - sample}", seconds,
                   captures=rt.engine.graphs.num_captured - captures, compiles=compiled_variants() - compiles)
        for i in range(args.calls):
            seconds, _ = timed(lambda: held(model, prompts, args.new, sample), CUDA)
            record(f"held engine {label}, run {i + 1}", seconds)
    if args.loop:
        rng = random.Random(0)
        vocab = model.config.vocab_size

        def batch(n):
            return [[rng.randrange(3, vocab) for _ in range(rng.randrange(64, 201))] for _ in range(n)]

        for n in (1, 2, 4, 8, 16, 32, 64, 3, 12, 48):  # warm-up: every bucket once
            through_generate_ragged(model, batch(n), 64)
        compiles, captures, builds = compiled_variants(), rt.engine.graphs.num_captured, rt.builds
        keys_before = compiled_keys()
        loop = []
        for _ in range(args.loop):
            b = batch(rng.randrange(1, 65))
            t_gen, _ = timed(lambda: through_generate_ragged(model, b, 64), CUDA)
            t_held, _ = timed(lambda: held(model, b, 64), CUDA)
            loop.append(dict(batch=len(b), generate_s=t_gen, held_s=t_held, overhead_ms=1e3 * (t_gen - t_held)))
            print(f"loop: batch {len(b):3d}  generate {t_gen:6.3f} s  held {t_held:6.3f} s  "
                  f"overhead {1e3 * (t_gen - t_held):6.1f} ms", flush=True)
        report["loop"] = dict(calls=loop, compiles=compiled_variants() - compiles,
                              captures=rt.engine.graphs.num_captured - captures, builds=rt.builds - builds,
                              max_overhead_ms=max(c["overhead_ms"] for c in loop),
                              median_overhead_ms=sorted(c["overhead_ms"] for c in loop)[len(loop) // 2])
        report["loop"]["new_variants"] = {name: sorted(set(keys) - set(keys_before.get(name, [])))
                                          for name, keys in compiled_keys().items()
                                          if set(keys) - set(keys_before.get(name, []))}
        for name, new in report["loop"]["new_variants"].items():
            print("compiled in the loop:", name, *new, sep="\n  ", flush=True)
        print("loop summary:", {k: v for k, v in report["loop"].items() if k != "calls"}, flush=True)
    report["capture_ms"] = [round(1e3 * s, 1) for s in rt.engine.graphs.capture_seconds]
    report["runtime"] = hf_async_cb.runtime_info(model)
    if args.stock:
        hf_async_cb.release(model)
        ids = torch.tensor(prompts, device="cuda")
        seconds, _ = timed(lambda: model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new,
                                                  batching="off", do_sample=False, eos_token_id=None,
                                                  pad_token_id=0), CUDA)
        record("stock generate greedy", seconds)
    report["rows"] = rows
    print(f"floor {report['floor_s']:.3f} s = {tokens / report['floor_s']:,.0f} tok/s; {report['runtime']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


def through_generate_ragged(model, prompts, new):
    """A left-padded batch of prompts of different lengths, as a tokenizer would give it."""
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return model.generate(ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=new, batching="async",
                          do_sample=False, eos_token_id=None, pad_token_id=0)


if __name__ == "__main__":
    main()
