"""Where a decode step's time goes, sync vs async (CUDA): torch.profiler over a short run.

Prints the top CPU-side and GPU-side ops of each loop and the kernel-busy fraction (union of
kernel intervals over the profiled wall time), next to the stream-occupancy figure of the bench.
"""

import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from hf_async_cb import BatchingConfig, Engine
from hf_async_cb.tools.bench import _prompts, build_model


def kernel_busy(prof) -> float:
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    if not spans:
        return float("nan")
    busy, cur_s, cur_e = 0, *spans[0]
    for s, e in spans[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    return busy / (spans[-1][1] - spans[0][0])


def main(shape="llama3.2-1b", requests=64, prompt=128, new=48):
    model = build_model(shape, torch.device("cuda"), torch.bfloat16)
    prompts = _prompts(requests, prompt, model.config.vocab_size)
    for mode in ("sync", "async"):
        engine = Engine(model, BatchingConfig(mode=mode, max_batch_tokens=8192, max_running_requests=requests))
        engine.generate(prompts, max_new_tokens=4)  # warm-up
        engine.clear_prefix_cache()  # the profiled run prefills its prompts, as a first sight of them would
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            engine.generate(prompts, max_new_tokens=new)
            torch.cuda.synchronize()
            wall = time.perf_counter() - start
        steps = engine.pipeline(mode).num_steps
        print(f"\n=== {mode}: {wall * 1e3 / new:.1f} ms per generated token-step, kernel-busy "
              f"{100 * kernel_busy(prof):.1f}% (steps so far {steps})")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=60))
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=8, max_name_column_width=60))
        del engine


if __name__ == "__main__":
    main(*[int(a) if a.isdigit() else a for a in sys.argv[1:]])
