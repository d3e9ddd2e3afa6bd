"""Skinny GEMMs on the GPU: the Triton kernel (hf_async_cb/kernels/skinny_gemm.py) over a small
config sweep against F.linear (cuBLAS), at the decode shapes of Llama-3-8B and Llama-3.2-1B.

    python benchmarks/tune_gemm.py                      # both models, M in 1 8 32 64 128 256
    python benchmarks/tune_gemm.py --models llama3-8b --shapes o down --m 32 --wide
    python benchmarks/tune_gemm.py --record             # also store the winners for GemmChoice

Prediction. At decode sizes (M <= 256 rows) a GEMM is bound by streaming its weight [N, K] once:
the time floor is N x K x 2 bytes over the copy bandwidth (4.27 TB/s on the H200), and M hardly
matters below ~64 rows. cuBLAS reaches ~1.1 TB/s on a lone 4096 x 4096 projection and ~3.9 TB/s
on the fused gate/up (docs/benchmarks.md); a kernel whose grid covers every SM (split-K for the
narrow projections) should stream every shape at >= 3.5 TB/s. The 8B step reads 15.0 GB of
GEMM weights (32 layers x 436 MB + a 1.05 GB lm_head): at 3.5 TB/s everywhere that is 4.3 ms,
at 4.0 TB/s 3.75 ms, against the 5.18 ms of GEMM time per step measured at 32 rows (a profile
over the whole run, so it also holds the prefill's share). So: from 5.18 ms toward ~3.8-4.3 ms
of GEMMs per step, if the kernel streams at 3.5-4.0 TB/s; the per-model sums at the end of the
output say what this machine gives (layers x the four projections + lm_head, each shape at
the faster of cuBLAS and the best config).

Outcome (H200, 2026-12-01, docs/benchmarks.md): the 5.18 ms the prediction started from was an
eager profile. Timed in graphs, cuBLAS takes 4.19 ms for the 8B step's GEMMs at 32 rows, streaming
the large shapes at 3.3-4.0 TB/s. The kernel ties or loses everywhere but the lm_head (5-8%
faster), so the per-shape choice keeps cuBLAS elsewhere.

Timing: 20 calls replayed from a CUDA graph (graph_timing.graph_ms), median of 7 replays, as the
engine's decode graphs run them: eager timing (do_bench) measured Triton's ~50 us launch path,
not the kernel. The weight is rotated over copies when it would fit in the 50 MB L2 (a decode
step finds no weight in L2).
Every config is checked first (relative error < 1e-2 against an fp32 product); a wrong one is
reported and the script exits non-zero. A config that does not compile is skipped, with its error.
"""

from __future__ import annotations

import argparse
import itertools
import sys

import torch
import torch.nn.functional as F
import triton

from hf_async_cb.devices import num_sms
from hf_async_cb.kernels.graph_timing import cold_copies, graph_ms
from hf_async_cb.kernels.gemm_choice import WIN_MARGIN, GemmChoice, device_name, relative_error
from hf_async_cb.kernels.skinny_gemm import (MAX_SHARED_MEMORY, block_m, candidate_configs, default_config,
                                             shared_memory_estimate, skinny_linear)

# name -> (decoder layers, {projection: (N, K)}); q/k/v and gate/up fused, as the engine runs them.
MODELS = {
    "llama3-8b": (32, {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
                       "lm_head": (128256, 4096)}),
    "llama3.2-1b": (16, {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192),
                         "lm_head": (128256, 2048)}),
}
MS = (1, 8, 32, 64, 128, 256)


def wide_configs(M: int, N: int, K: int, dtype: torch.dtype, sms: int) -> list[dict]:
    """A product sweep around the default (--wide, 100-200 configs: for a few shapes and M at a time):
    BLOCK_N x BLOCK_K x SPLIT_K x stages x SWAP_AB."""
    base = default_config(M, N, K, dtype, sms)
    splits = sorted({1, max(1, base["SPLIT_K"] // 2), base["SPLIT_K"], base["SPLIT_K"] * 2})
    out = []
    for bn, bk, split, stages, swap in itertools.product((32, 64, 128), (64, 128, 256), splits, (2, 3, 4),
                                                         (False, True)):
        if K < split * bk or shared_memory_estimate(block_m(M), bn, bk, stages, dtype.itemsize) > MAX_SHARED_MEMORY:
            continue
        warps = 4 if block_m(M) * bn <= 64 * 64 else 8
        out.append(dict(BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, num_warps=warps, num_stages=stages, SWAP_AB=swap))
    return out


def median_ms(fn, weights: list[torch.Tensor]) -> float:
    return graph_ms(lambda i: fn(weights[i % len(weights)]))


def short(config: dict) -> str:
    return (f"n{config['BLOCK_N']} k{config['BLOCK_K']} s{config['SPLIT_K']} w{config['num_warps']} "
            f"st{config['num_stages']}{' swap' if config['SWAP_AB'] else ''}")


def bench_shape(proj: str, N: int, K: int, ms: list[int], device: torch.device, dtype: torch.dtype, sms: int,
                wide: bool, timer=median_ms) -> list[tuple]:
    """Each M: (M, bytes moved, cuBLAS ms, best config or None, its ms, wrong configs); prints the table rows."""
    gen = torch.Generator(device=device).manual_seed(N + K)
    w = (torch.randn(N, K, generator=gen, device=device, dtype=torch.float32) / K ** 0.5).to(dtype)
    weights = [w] + [w.clone() for _ in range(cold_copies(w.numel() * w.element_size()) - 1)]
    w_ref = w.float()
    rows = []
    for M in ms:
        x = torch.randn(M, K, generator=gen, device=device, dtype=dtype)
        ref = F.linear(x.float(), w_ref)
        moved = (N * K + M * K + M * N) * dtype.itemsize
        cublas = timer(lambda wt, x=x: F.linear(x, wt), weights)
        best, best_ms, wrong = None, float("inf"), 0
        for config in (wide_configs if wide else candidate_configs)(M, N, K, dtype, sms):
            try:
                y = skinny_linear(x, w, config=config)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
            except Exception as e:  # noqa: BLE001 (a config that does not compile or launch)
                print(f"  skip {proj} M={M} {short(config)}: {type(e).__name__}: {str(e)[:120]}", file=sys.stderr)
                continue
            err = relative_error(y, ref)
            if not err < 1e-2:
                wrong += 1
                print(f"  WRONG {proj} M={M} {short(config)}: relative error {err:.3g}", file=sys.stderr)
                continue
            ms_ = timer(lambda wt, x=x, c=config: skinny_linear(x, wt, config=c), weights)
            if ms_ < best_ms:
                best, best_ms = config, ms_
        cells = f"| {proj} {N}x{K} | {M} | {cublas * 1e3:.1f} | {moved / cublas / 1e9:.2f} |"
        if best is None:
            print(f"{cells} none | | | |")
        else:
            print(f"{cells} {short(best)} | {best_ms * 1e3:.1f} | {moved / best_ms / 1e9:.2f} "
                  f"| {cublas / best_ms:.2f}x |")
        rows.append((M, moved, cublas, best, best_ms, wrong))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--shapes", nargs="+", help="only these projections (qkv o gate_up down lm_head)")
    parser.add_argument("--m", nargs="+", type=int, default=list(MS))
    parser.add_argument("--wide", action="store_true", help="a product sweep instead of candidate_configs")
    parser.add_argument("--record", action="store_true", help="store each shape's winner for GemmChoice")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return 1
    device = torch.device("cuda", torch.cuda.current_device())
    dtype = torch.bfloat16
    sms = num_sms(device)
    print(f"{device_name(device)}, {sms} SMs, torch {torch.__version__}, triton {triton.__version__}, bf16")
    choice = GemmChoice() if args.record else None
    failures = 0
    totals: dict[tuple[str, int], list[float]] = {}  # (model, M) -> [cuBLAS ms, best-of-both ms] per step
    for model in args.models:
        layers, shapes = MODELS[model]
        print(f"\n## {model}\n")
        print("| shape | M | cuBLAS us | cuBLAS TB/s | best Triton config | Triton us | Triton TB/s | speed-up |")
        print("|---|---|---|---|---|---|---|---|")
        for proj, (N, K) in shapes.items():
            if args.shapes and proj not in args.shapes:
                continue
            for M, _, cublas, best, best_ms, wrong in bench_shape(proj, N, K, args.m, device, dtype, sms, args.wide):
                failures += wrong
                count = 1 if proj == "lm_head" else layers
                total = totals.setdefault((model, M), [0.0, 0.0])
                total[0] += count * cublas
                total[1] += count * min(cublas, best_ms)
                if choice is not None:
                    choice.record(M, N, K, dtype, device_name(device),
                                  best if best is not None and best_ms < cublas * (1 - WIN_MARGIN) else None)
            torch.cuda.empty_cache()
    print("\nGEMM time per decode step (layers x projections + lm_head; best = the faster of the two per shape):\n")
    print("| model | M | cuBLAS ms | best ms | speed-up |\n|---|---|---|---|---|")
    for (model, M), (cublas, best) in totals.items():
        print(f"| {model} | {M} | {cublas:.3f} | {best:.3f} | {cublas / best:.2f}x |")
    if failures:
        print(f"\n{failures} config(s) gave wrong results", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
