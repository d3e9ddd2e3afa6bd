"""The skinny GEMM's grouped form (4- and 2-bit weights: HQQ's, quanto's) on the GPU: its default launch
against a sweep of configs, the whole-weight rebuild + cuBLAS and the bf16 product, at the Llama-3-8B
decode shapes, timed in CUDA graphs.

    python benchmarks/tune_grouped.py                    # M = 32, quanto's tinygemm rule and HQQ's, 4 bits
    python benchmarks/tune_grouped.py --m 1,32,128 --forms fma_centered:4:128,scale_shift:2:128

Why: on the H100 (docs/benchmarks.md, 2026-12-08) the grouped form took 7.3 ms a decode step of 32 rows for the 8B
shape's 224 projections at 4 bits and 7.1 ms at 2 bits, about a quarter of the copy bandwidth over their bytes:
its rebuild of each weight, not the bytes it reads, sets its rate. Prediction: some config (more warps, SWAP_AB,
narrower tiles) is 1.3-2x faster than the default on the large shapes; none reaches the byte floor.

Weights are random codes with random scales and zeros (the rate does not depend on their values); each config's
product is checked against the rebuilt weight times x (relative error < 1e-2) before it is timed. Prints, per
shape, the default's time, the best config's, and GB/s over the packed bytes; at the end the step's sum (the
32 layers' projections) for the default and the best configs.
"""

from __future__ import annotations

import argparse
import itertools

import torch

from hf_async_cb.kernels import graph_timing
from hf_async_cb.kernels.grouped_dequant import dequantize_grouped
from hf_async_cb.kernels.skinny_gemm import _config, skinny_linear_grouped

# Llama-3-8B's projections (N, K) and how many of each a layer holds (q, k, v, o, gate, up, down)
SHAPES = {"q/o": (4096, 4096, 2), "k/v": (1024, 4096, 2), "gate/up": (14336, 4096, 2), "down": (4096, 14336, 1)}
LAYERS = 32


def random_weight(n: int, k: int, bits: int, group: int, device, dtype) -> tuple:
    packed = torch.randint(0, 256, (n * bits // 8, k), dtype=torch.uint8, device=device)
    scale = (torch.rand(n * k // group, device=device) * 0.02 + 0.001).to(dtype)
    zero = (torch.randn(n * k // group, device=device) * 0.01).to(dtype)
    return packed, scale, zero


def configs(m: int, n: int, k: int, group: int, dtype) -> list[dict]:
    base = _config(m, n, k, dtype, torch.uint8, None, None, group)
    out = [base]
    for bn, warps, swap in itertools.product((32, 64, 128), (4, 8), (False, True)):
        out.append({**base, "BLOCK_N": bn, "num_warps": warps, "SWAP_AB": swap})
    for split in (1, 2, 4, 8, 16):
        out.append({**base, "SPLIT_K": split})
    for bk in (group, 2 * group, 4 * group):
        if bk >= 64:
            out.append({**base, "BLOCK_K": bk})
    for stages in (1, 2, 3, 4):
        out.append({**base, "num_stages": stages})
    unique = []
    for c in out:
        if c not in unique and c["SPLIT_K"] * c["BLOCK_K"] <= k:
            unique.append(c)
    return unique


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--m", default="32")
    p.add_argument("--forms", default="fma_centered:4:128,hqq:4:64", help="rule:bits:group, comma-separated")
    p.add_argument("--device", default="cuda", help="cpu: a check that the script runs (Triton's interpreter, "
                   "small shapes, nothing timed)")
    args = p.parse_args()
    device = torch.device(args.device)
    if device.type == "cpu":  # (the interpreter: small shapes, and a call's time is no figure)
        SHAPES.clear()
        SHAPES.update({"small": (128, 256, 1)})
        graph_timing.graph_ms = lambda fn, **_: (fn(0), 1.0)[1]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # (the interpreter has no bf16)
    failed = False
    for form in args.forms.split(","):
        rule, bits, group = form.split(":")
        bits, group = int(bits), int(group)
        for m in (int(x) for x in args.m.split(",")):
            sums = {"default": 0.0, "best": 0.0, "rebuild+cuBLAS": 0.0, "bf16 cuBLAS": 0.0}
            print(f"\n{rule}, {bits} bits, groups of {group}, M = {m}", flush=True)
            for name, (n, k, count) in SHAPES.items():
                packed, scale, zero = random_weight(n, k, bits, group, device, dtype)
                x = torch.randn(m, k, device=device, dtype=dtype)
                whole = dequantize_grouped(packed, scale, zero, group, bits=bits, shape=(n, k), dequant=rule)
                expected = (x.float() @ whole.float().t())
                times = []
                candidates = configs(m, n, k, group, dtype)
                for config in candidates:
                    def run(_i, config=config):
                        return skinny_linear_grouped(x, packed, scale, zero, group, bits=bits, shape=(n, k),
                                                     dequant=rule, config=config)
                    try:
                        got = run(0).float()
                    except Exception as error:  # noqa: BLE001 - a config that does not build is skipped
                        print(f"  {name} {config}: {type(error).__name__}: {str(error)[:120]}", flush=True)
                        continue
                    err = ((got - expected).norm() / expected.norm()).item()
                    if err > 1e-2:
                        print(f"  {name} {config}: WRONG (relative error {err:.3g})", flush=True)
                        failed = True
                        continue
                    times.append((graph_timing.graph_ms(run), config))
                if not times:
                    continue
                default_ms = next((ms for ms, c in times if c == candidates[0]), None)
                best_ms, best = min(times, key=lambda t: t[0])
                rebuild_ms = graph_timing.graph_ms(lambda _i: torch.nn.functional.linear(
                    x, dequantize_grouped(packed, scale, zero, group, bits=bits, shape=(n, k), dequant=rule)))
                bf16_ms = graph_timing.graph_ms(lambda _i: torch.nn.functional.linear(x, whole))
                nbytes = packed.numel() + 2 * scale.numel() * scale.element_size()
                print(f"  {name:8} default {default_ms or float('nan'):.4f} ms, best {best_ms:.4f} ms "
                      f"({nbytes / best_ms / 1e6:.0f} GB/s) {best}; rebuild + cuBLAS {rebuild_ms:.4f}, "
                      f"bf16 cuBLAS {bf16_ms:.4f}", flush=True)
                for key, ms in (("default", default_ms or best_ms), ("best", best_ms), ("rebuild+cuBLAS", rebuild_ms),
                                ("bf16 cuBLAS", bf16_ms)):
                    sums[key] += ms * count * LAYERS
            print("  a step's projections (32 layers): " + ", ".join(f"{k} {v:.2f} ms" for k, v in sums.items()),
                  flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
