#!/usr/bin/env python
"""Time the sampling step alone on the GPU: [rows, vocab] bf16 logits -> packed tokens/log-probs.

    python benchmarks/gpu_sampling.py                 # 64 and 256 rows of a 128,256 vocabulary
    python benchmarks/gpu_sampling.py --rows 64 --vocab 32000

Each case is timed inside a CUDA graph (as the decode loop runs it), median of 50 replays, with
the greedy one-pass kernel as the yardstick: the torch sampler (`sampling.sample`, its sort and its
hash noise alone) against the kernels of `kernels/draw_sampled.py`.
"""

from __future__ import annotations

import argparse

import torch

from hf_async_cb.engine.requests import SamplingParams
from hf_async_cb.kernels import graph_timing
from hf_async_cb.kernels.draw_greedy import greedy_packed
from hf_async_cb.kernels.draw_sampled import sampled_packed
from hf_async_cb.sampling.sampler import SamplingTensors, gumbel_noise, pack, sample

CASES = {
    "pure (T=1)": dict(temperature=1.0),
    "T=0.8 top-p 0.95": dict(temperature=0.8, top_p=0.95),
    "T=0.8 top-k 50 top-p 0.95": dict(temperature=0.8, top_k=50, top_p=0.95),
    "T=0.7 min-p 0.05": dict(temperature=0.7, min_p=0.05),
}


def graph_ms(fn) -> float:
    """ms of one fn() replayed from a CUDA graph, median of 50 replays (as the decode loop runs it)."""
    return graph_timing.graph_ms(lambda i: fn(), calls=1, replays=50)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="*", default=[64, 256])
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--sweep", action="store_true",
                        help="also time the search's launch parameters (ladder, gather, per-row resolve) for the top-p cases")
    args = parser.parse_args()
    device = torch.device("cuda")
    print("| rows | case | torch sampler ms | sampling kernels ms | greedy kernel ms | tokens differing |")
    print("|---|---|---|---|---|---|")
    for rows in args.rows:
        logits = (torch.randn(rows, args.vocab, device=device) * 3).to(torch.bfloat16)
        greedy = graph_ms(lambda: greedy_packed(logits))
        for name, options in CASES.items():
            params = [SamplingParams(max_new_tokens=8, do_sample=True, seed=i, **options) for i in range(rows)]
            tensors = SamplingTensors.build(params, device, token_index=list(range(rows)))
            torch_ms = graph_ms(lambda: pack(*sample(logits.float(), tensors)))
            fast = graph_ms(lambda: sampled_packed(logits, tensors))
            differ = int((sampled_packed(logits, tensors)[0] != sample(logits.float(), tensors)[0]).sum())
            print(f"| {rows} | {name} | {torch_ms:.3f} | {fast:.3f} | {greedy:.3f} | {differ} |")
        floats = logits.float()
        seed = torch.arange(rows, device=device)
        sort_ms = graph_ms(lambda: floats.sort(dim=-1, descending=True))
        hash_ms = graph_ms(lambda: gumbel_noise(seed, seed, args.vocab))
        print(f"| {rows} | torch pieces: sort {sort_ms:.3f}, hash noise {hash_ms:.3f} | | | | |")
        if args.sweep:
            sweep(logits, device)


SWEEP = {  # each group swept with the others at their defaults
    ("LADDER_BLOCK", "LADDER_WARPS"): [(256, 4), (512, 4), (512, 8), (1024, 8)],
    ("GATHER_BLOCK", "GATHER_WARPS"): [(512, 4), (1024, 4), (1024, 8), (2048, 8)],
    ("CAP", "CUT_BLOCK", "CUT_WARPS"): [(256, 1024, 8), (512, 1024, 8), (512, 2048, 8), (1024, 1024, 8),
                                        (512, 1024, 4)],
    ("GATHER",): [(8192,), (16384,), (32768,)],
}


def sweep(logits: torch.Tensor, device: torch.device) -> None:
    """The kernels' time per launch configuration of the threshold search (the top-p cases)."""
    import hf_async_cb.kernels.draw_sampled as sampled

    rows = logits.shape[0]
    for name in ("T=0.8 top-p 0.95", "T=0.8 top-k 50 top-p 0.95"):
        params = [SamplingParams(max_new_tokens=8, do_sample=True, seed=i, **CASES[name]) for i in range(rows)]
        tensors = SamplingTensors.build(params, device, token_index=list(range(rows)))
        expected = sample(logits.float(), tensors)[0]
        for names, values in SWEEP.items():
            default = tuple(getattr(sampled, n) for n in names)
            cells = []
            for value in values:
                for n, v in zip(names, value):
                    setattr(sampled, n, v)
                ms = graph_ms(lambda: sampled_packed(logits, tensors))
                differ = int((sampled_packed(logits, tensors)[0] != expected).sum())
                cells.append("x".join(map(str, value)) + f": {ms:.3f}" + (f" ({differ} differ)" if differ else ""))
            for n, v in zip(names, default):
                setattr(sampled, n, v)
            print(f"| {rows} | sweep {name} {'x'.join(names)} | {'; '.join(cells)} | | | |")


if __name__ == "__main__":
    main()
