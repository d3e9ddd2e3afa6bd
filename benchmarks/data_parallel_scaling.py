"""Data-parallel scaling: DataParallel over 1, 2, ... N devices against one device, threads and
processes side by side, on random weights in a real shape.

    python benchmarks/data_parallel_scaling.py                       # every visible GPU, Llama-3.2-1B shape
    python benchmarks/data_parallel_scaling.py --gpus 1 2 8 --requests-per-gpu 256 --new 256
    python benchmarks/data_parallel_scaling.py --cpu                 # 2 CPU replicas, tiny shape (a smoke run)

Weak scaling: each device count gets `--requests-per-gpu` requests per device, so every replica runs
the batch one device runs alone. Each row builds the replicas, runs the workload once (the warm-up:
process start, engine, graphs, compiles) and times a second run; speed-up is tokens/s against the
one-device row of the same kind.

Prediction (issue 19's targets: >= 1.9x on 2 GPUs and >= 7.2x on 8, 1B shape): processes scale
with the devices (each replica's host work on its own core, the GPUs independent); threads stop
scaling once the replicas' host work, serialised by the interpreter lock, outlasts a GPU step: at
~0.6 ms of host work per ~1.5 ms step (1B, 64 requests, docs/benchmarks.md) that is near 2-3
replicas, so ~2.5x at 8.
"""

from __future__ import annotations

import argparse
import time

import torch

from hf_async_cb import BatchingConfig, DataParallel, SamplingParams
from hf_async_cb.tools.bench import _prompts, build_model


def run(model, devices: list[str], workers: str, prompts, new: int, config: BatchingConfig) -> tuple[float, float]:
    """(warm-up seconds, timed seconds) of two identical calls on a DataParallel over `devices`."""
    params = SamplingParams(max_new_tokens=new)
    start = time.perf_counter()
    with DataParallel(model, devices=devices, config=config, workers=workers) as dp:
        dp.generate(prompts, params)
        warm = time.perf_counter() - start
        start = time.perf_counter()
        outputs = dp.generate(prompts, params)
        seconds = time.perf_counter() - start
    assert sum(len(o.output_token_ids) for o in outputs) == len(prompts) * new
    return warm, seconds


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default=None, help="bench.SHAPES name (default: llama3.2-1b, tiny with --cpu)")
    parser.add_argument("--gpus", type=int, nargs="+", help="device counts (default: 1, 2, 4, ... every GPU)")
    parser.add_argument("--requests-per-gpu", type=int, default=None)
    parser.add_argument("--prompt", type=int, default=None)
    parser.add_argument("--new", type=int, default=None)
    parser.add_argument("--workers", nargs="+", default=["processes", "threads"], choices=["processes", "threads"])
    parser.add_argument("--cpu", action="store_true", help="CPU replicas (a smoke run; nothing is measured)")
    args = parser.parse_args(argv)
    cpu = args.cpu or not torch.cuda.is_available()
    shape = args.shape or ("tiny" if cpu else "llama3.2-1b")
    per, prompt, new = (args.requests_per_gpu or (4 if cpu else 256), args.prompt or (16 if cpu else 128),
                        args.new or (8 if cpu else 256))
    available = 2 if cpu else torch.cuda.device_count()
    counts = args.gpus or sorted({1, *[n for n in (2, 4, 8) if n <= available], available})
    device = torch.device("cpu" if cpu else "cuda:0")
    model = build_model(shape, device, torch.float32 if cpu else torch.bfloat16)
    vocab = model.config.vocab_size
    config = BatchingConfig(max_running_requests=max(per, 1))
    print(f"{shape}, {per} requests per device x prompt {prompt} x {new} new, "
          f"{'CPU (smoke run)' if cpu else torch.cuda.get_device_name(0)}")
    print("| devices | workers | tokens/s | speed-up | s | warm-up s |\n|---|---|---|---|---|---|")
    rows, base = [], {}
    for workers in args.workers:
        for n in counts:
            devices = ["cpu"] * n if cpu else [f"cuda:{i}" for i in range(n)]
            prompts = _prompts(per * n, prompt, vocab)
            warm, seconds = run(model, devices, workers, prompts, new, config)
            rate = per * n * new / seconds
            base.setdefault(workers, rate if n == counts[0] else None)
            speedup = rate / base[workers] * counts[0] if base[workers] else float("nan")
            rows.append(dict(devices=n, workers=workers, tokens_per_s=rate, speedup=speedup, seconds=seconds,
                             warmup=warm))
            print(f"| {n} | {workers} | {rate:,.0f} | {speedup:.2f}x | {seconds:.2f} | {warm:.1f} |", flush=True)
    return rows


if __name__ == "__main__":
    main()
