"""Where the 1B group workload's time goes (issue 28: 32 prompts x 1,024 tokens, each 8 rows, -> 128):
held Engine, async and sync, caching on and off: wall time, steps, GPU-busy fraction and ms per decode
step; then the prefill/decode split of one async caching-on run from per-step CUDA events, and with
--kernels its kernels by device time. --quick: only the async rows and the split.

    python benchmarks/group_step_probe.py [--quick] [--kernels]
"""
import sys
import time

import torch
from hf_async_cb import BatchingConfig
from hf_async_cb.tools import bench, shared_prefix
model = bench.build_model("llama3.2-1b", torch.device("cuda"), torch.bfloat16)
prompts, new = shared_prefix.workload_prompts("group", model.config.vocab_size)
for path in ("async",) if "--quick" in sys.argv else ("async", "sync"):
    for caching in (True, False):
        r = bench.run_path(path, model, prompts, new, config=BatchingConfig(prefix_caching=caching))
        print(f"{path:5} caching={caching}: {r.seconds:.3f} s, {r.steps} steps, decode busy {r.gpu_busy}, "
              f"decode ms/step {r.decode_ms_per_step}, extra {r.extra}", flush=True)
# per-step event times of one async caching-on run
from hf_async_cb import Engine, SamplingParams
engine = Engine(model, BatchingConfig(prefix_caching=True))
pipe = engine.pipeline("async")
params = SamplingParams(max_new_tokens=new)
engine.generate(prompts, params); torch.cuda.synchronize()
engine.clear_prefix_cache()
pipe.record_step_times = True; pipe.step_times.clear()
t = time.perf_counter(); engine.generate(prompts, params); torch.cuda.synchronize(); wall = time.perf_counter() - t
ts = [(d, b.elapsed_time(e)) for d, b, e in pipe.step_times]
pre = [x for d, x in ts if not d]; dec = [x for d, x in ts if d]
span = pipe.step_times[0][1].elapsed_time(pipe.step_times[-1][2])
print(f"wall {wall*1e3:.1f} ms, GPU span {span:.1f} ms; prefill/mixed steps {len(pre)}: {sum(pre):.1f} ms "
      f"(max {max(pre) if pre else 0:.2f}); decode steps {len(dec)}: {sum(dec):.1f} ms (median {sorted(dec)[len(dec)//2]:.3f})")
print("first steps (decode?, ms):", [(d, round(x, 2)) for d, x in ts[:12]])

# The kernels of the run with caching on (held Engine, graphs), by device time: the prompts' pages are
# cached already (the run just before), so this is the decode steps' mix (and one short prefill).
if "--kernels" in sys.argv:
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.generate(prompts, params)
        torch.cuda.synchronize()
    rows = [(e.device_time_total / 1e3, e.count, e.key) for e in prof.key_averages() if e.device_time_total > 0]
    total = sum(r[0] for r in rows)
    print(f"kernels: {total:.1f} ms of device time")
    for ms, count, name in sorted(rows, reverse=True)[:18]:
        print(f"  {ms:8.2f} ms {100 * ms / total:5.1f}% x{count:<6} {name[:110]}")
