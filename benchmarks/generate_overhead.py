"""Where a `model.generate(batching=...)` call spends host time that a held Engine does not (issue 28:
~50 ms per call on the 1B group workload on the H100). Times both on the same workload, then profiles
one call of each with cProfile and prints the functions whose cumulative time differs most.

    python benchmarks/generate_overhead.py [--shape llama3.2-1b] [--workload group] [--new 128] [--path async]
"""
import argparse
import cProfile
import pstats
import time

import torch

import hf_async_cb
from hf_async_cb import BatchingConfig, Engine, SamplingParams
from hf_async_cb.tools import bench, shared_prefix, timing

parser = argparse.ArgumentParser()
parser.add_argument("--shape", default="llama3.2-1b")
parser.add_argument("--workload", default="group")
parser.add_argument("--new", type=int, default=None, help="new tokens per row (default: the workload's)")
parser.add_argument("--path", default="async", choices=("async", "sync"))
parser.add_argument("--repeats", type=int, default=3)
parser.add_argument("--top", type=int, default=25)
args = parser.parse_args()

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
model = bench.build_model(args.shape, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
prompts, new = shared_prefix.workload_prompts(args.workload, model.config.vocab_size)
new = args.new or new
config = BatchingConfig(prefix_caching=True, seed=0)
ids = torch.tensor(prompts, device=device)
engine = Engine(model, config)
params = SamplingParams(max_new_tokens=new)
calls = {
    "generate": (lambda: model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                                        batching=args.path, batching_config=config, eos_token_id=None, pad_token_id=0),
                 model),
    "held": (lambda: engine.generate(prompts, params, mode=args.path), engine),
}
profiles = {}
for name, (call, owner) in calls.items():
    call(); call()
    times = [timing.timed(call, device, unseen=owner)[0] for _ in range(args.repeats)]
    print(f"{name:8} {' '.join(f'{t:.3f}' for t in times)} s", flush=True)
    profile = cProfile.Profile()
    timing.timed(lambda: (profile.enable(), call(), profile.disable()), device, unseen=owner)
    profiles[name] = pstats.Stats(profile)


def cumulative(stats):
    out = {}
    for (file, line, func), (_, _, _, cum, _) in stats.items():
        key = f"{file.split('site-packages/')[-1].split('hf_async_cb/')[-1]}:{line}({func})"
        out[key] = out.get(key, 0.0) + cum
    return out


gen, held = cumulative(profiles["generate"].stats), cumulative(profiles["held"].stats)
rows = sorted(((gen.get(k, 0) - held.get(k, 0), gen.get(k, 0), held.get(k, 0), k) for k in set(gen) | set(held)),
              reverse=True)
print(f"functions by cumulative seconds, generate minus held (top {args.top}):")
for diff, g, h, key in rows[:args.top]:
    print(f"  {diff * 1e3:8.1f} ms  (generate {g * 1e3:8.1f}, held {h * 1e3:8.1f})  {key[:140]}")

# What generate's own call does around the engine's run, child by child (cumulative seconds).
print("generate's call, its callees:")
profiles["generate"].sort_stats("cumulative").print_callees("_engine_generate|engine_generate|hook.py.*generate")
print("the held Engine's call, its callees:")
profiles["held"].sort_stats("cumulative").print_callees("engine.py.*\\(generate\\)")
