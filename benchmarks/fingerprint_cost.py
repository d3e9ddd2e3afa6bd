"""What the weights' content check costs each generate() call (model/kv_fingerprint.py, content=True:
one pass over the weights, so that a write no version counter sees cannot leave stale cached K/V),
against the version-counter check, on a real shape with random weights.

    PYTHONPATH=. python benchmarks/fingerprint_cost.py [--shape llama3-8b] [--repeat 10]
    PYTHONPATH=. python benchmarks/fingerprint_cost.py --narrow --repeat 150   # the walk alone, on a CPU
                                       (and a serving loop's check at each admission: WeightVersions)

--narrow keeps the shape's structure (its layers and modules) at hidden size 64, so that what is timed
is the Python walk over the modules, not the reads of the weights (a CPU figure of the walk).
"""
import argparse
import json
import time

import torch

from hf_async_cb.model.kv_fingerprint import WeightVersions, kv_fingerprint
from hf_async_cb.model.numerics_key import numerics_key
from hf_async_cb.tools.bench import SHAPES, build_model, copy_bandwidth, default_device


def timed(fn, repeat: int, device: torch.device) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=tuple(SHAPES), default="llama3-8b")
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--narrow", action="store_true", help="the shape's structure at hidden size 64, on the CPU")
    args = p.parse_args()
    device = torch.device("cpu") if args.narrow else default_device()
    if args.narrow:
        from transformers import AutoConfig, AutoModelForCausalLM

        fields = dict(SHAPES[args.shape], hidden_size=64, intermediate_size=128, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=256)
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(fields.pop("model_type", "llama"), **fields))
        numerics = timed(lambda: numerics_key(model), args.repeat, device)
        versions = WeightVersions(model)  # a serving loop's check at each admission
        print(json.dumps(dict(shape=args.shape, narrow=True, counters_ms=round(timed(lambda: kv_fingerprint(model),
                                                                                   args.repeat, device) * 1e3, 2),
                              content_ms=round(timed(lambda: kv_fingerprint(model, content=True), args.repeat,
                                                     device) * 1e3, 2),
                              numerics_key_ms=round(numerics * 1e3, 2),
                              admission_read_us=round(timed(versions.read, args.repeat, device) * 1e6, 1),
                              admission_restructured_us=round(timed(versions.restructured, args.repeat, device) * 1e6,
                                                              1))))
        return
    model = build_model(args.shape, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    weight_bytes = sum(t.numel() * t.element_size() for t in model.parameters())
    counters = timed(lambda: kv_fingerprint(model), args.repeat, device)
    content = timed(lambda: kv_fingerprint(model, content=True), args.repeat, device)
    data = [t.detach() for t in model.parameters()]
    parts = dict(  # the content check's reductions, alone and in cheaper forms
        norms_f64=lambda: torch._foreach_norm(data, 2, dtype=torch.float64),
        norms_f32=lambda: torch._foreach_norm(data, 2, dtype=torch.float32),
        bits16_sum=lambda: [t.view(torch.int16).sum(dtype=torch.int64) for t in data],
        bits32_sum=lambda: [t.view(torch.int32).sum(dtype=torch.int64) for t in data if t.numel() % 2 == 0],
        bits32_sum_i32=lambda: [t.view(torch.int32).sum(dtype=torch.int32) for t in data if t.numel() % 2 == 0],
        f32_sum=lambda: [t.sum(dtype=torch.float32) for t in data])
    part_ms = {name: round(timed(fn, args.repeat, device) * 1e3, 2) for name, fn in parts.items()}
    bandwidth = copy_bandwidth(device) if device.type == "cuda" else None
    report = dict(shape=args.shape, weight_gb=round(weight_bytes / 1e9, 2), counters_ms=round(counters * 1e3, 2),
                  content_ms=round(content * 1e3, 2),
                  one_read_ms=round(weight_bytes / bandwidth * 1e3, 2) if bandwidth else None, parts_ms=part_ms)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
