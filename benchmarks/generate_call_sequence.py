"""Per-call times of a run of `model.generate(batching="async")` calls in one process, each on prompts
it has not seen (the shared-prefix tool's timed call is a runtime's second call): whether a call's
place in the sequence costs it time (issue 28: the tool's timed call ~50 ms over a held Engine), and
how much of it is Python's garbage collector (collections per generation during each call, and the
same sequence with the collector off), and what else a call paid for (in brackets, from the second call
on: runtime builds, graph captures and their milliseconds, prefix-cache evictions). Group workload, caching on and off.

    python benchmarks/generate_call_sequence.py [--shape llama3.2-1b] [--calls 5]
"""
import argparse
import gc
import time

import torch

import hf_async_cb
from hf_async_cb.tools import bench, shared_prefix, timing

parser = argparse.ArgumentParser()
parser.add_argument("--shape", default="llama3.2-1b")
parser.add_argument("--workload", default="group")
parser.add_argument("--calls", type=int, default=5)
parser.add_argument("--new", type=int, default=None)
args = parser.parse_args()
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
model = bench.build_model(args.shape, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
collections: list[tuple[int, float]] = []


def on_gc(phase, info):
    if phase == "start":
        on_gc.started = time.perf_counter()
    else:
        collections.append((info["generation"], time.perf_counter() - on_gc.started))


gc.callbacks.append(on_gc)


def state() -> dict:
    """What a call may have paid for beyond its steps: runtime builds, graph captures (and their
    seconds), prefix-cache evictions."""
    from hf_async_cb.generate import runtime

    rt = runtime._RUNTIMES.get(model)
    engine = None if rt is None else rt.engine
    graphs = None if engine is None else engine.graphs
    stats = (engine.prefix_cache_stats() if engine is not None else None) or {}
    return {"builds": 0 if rt is None else rt.builds,
            "captures": 0 if graphs is None else graphs.num_captured,
            "capture_ms": 0 if graphs is None else round(sum(graphs.capture_seconds) * 1e3),
            "evictions": stats.get("evictions", 0)}
for collector in ("on", "off"):
    for caching in (True, False):
        config = hf_async_cb.BatchingConfig(prefix_caching=caching, seed=0)
        line = []
        before = state()
        for i in range(args.calls):
            prompts, new = shared_prefix.workload_prompts(args.workload, model.config.vocab_size, seed=10 + i)
            ids = torch.tensor(prompts, device=device)
            if collector == "off":
                gc.disable()
            collections.clear()
            seconds, _ = timing.timed(lambda: model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new or new, do_sample=False,
                batching="async", batching_config=config, eos_token_id=None, pad_token_id=0), device)
            gc.enable()
            full = [s for g, s in collections if g == 2]
            now = state()
            moved = {k: now[k] - before[k] for k in now if now[k] != before[k]}
            before = now
            line.append(f"{seconds:.3f}" + (f" (gc2 x{len(full)} {sum(full) * 1e3:.0f} ms)" if full else "")
                        + (" [" + " ".join(f"{k} +{v:g}" for k, v in moved.items()) + "]" if moved and i else ""))
        hf_async_cb.release(model)
        print(f"collector {collector}, caching {'on ' if caching else 'off'}: " + ", ".join(line), flush=True)
