"""Classifier-free guidance through generate: stock against the engine's loops on one workload, one
process (`guidance_scale` with a negative prompt per row; generate/guidance.py batches the rows'
unconditional forwards). Prints each path's time (best of `--repeat`, after a first call) and
whether its tokens equal stock's.

    PYTHONPATH=. python benchmarks/guidance_bench.py [--shape llama3.2-1b --rows 32 --prompt 128 --new 128]
    PYTHONPATH=. python benchmarks/guidance_bench.py --device cpu --shape tiny   (checks the script)
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import hf_async_cb  # noqa: F401 (registers batching=)
from hf_async_cb.tools.bench import _prompts, build_model


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama3.2-1b")
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--scale", type=float, default=1.5)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    model = build_model(args.shape, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    vocab = model.config.vocab_size
    ids = torch.tensor(_prompts(args.rows, args.prompt, vocab), device=device)
    negative = torch.tensor(_prompts(args.rows, max(1, args.prompt // 4), vocab), device=device).flip(0)
    options = dict(attention_mask=torch.ones_like(ids), max_new_tokens=args.new, min_new_tokens=args.new,
                   do_sample=False, pad_token_id=0, guidance_scale=args.scale, negative_prompt_ids=negative)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def timed(**extra):
        sync()
        started = time.perf_counter()
        out = model.generate(ids, **options, **extra)
        sync()
        return time.perf_counter() - started, out

    report, reference = {}, None
    for path in ("stock", "sync", "async"):
        extra = {} if path == "stock" else {"batching": path}
        first, out = timed(**extra)
        best = min(timed(**extra)[0] for _ in range(args.repeat))
        if reference is None:
            reference = out
        equal = int((out == reference).all(dim=1).sum())
        report[path] = dict(first_s=round(first, 3), best_s=round(best, 3), rows_equal_stock=equal)
        print(f"{path}: first call {first:.3f} s, best {best:.3f} s, {equal}/{args.rows} rows equal stock's",
              flush=True)
    report["speedup_async"] = round(report["stock"]["best_s"] / report["async"]["best_s"], 2)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(json.dumps(dict(vars(args), gpu=name, **report)))
    return report


if __name__ == "__main__":
    main()
