#!/usr/bin/env python
"""Where the codebook 4-bit form's time goes (bitsandbytes nf4 at decode shapes), on a CUDA GPU.

    PYTHONPATH=. python benchmarks/codebook_gemm_probe.py [--rows 1,2,4,...,256] [--probes joined|all|none]
                                                          [--hqq] [--json out.json]

Per Llama-3-8B projection shape and rows count, microseconds per product (CUDA events over a CUDA
graph of 50 calls, as decode steps run; weights rotated over copies that together exceed the L2, so
every call streams from HBM): cuBLAS on bf16
weights, bitsandbytes' own Linear4bit path (`bnb.matmul_4bit`), the skinny GEMM's codebook form
(`skinny_linear_codebook_4bit`) and its grouped 4-bit form (HQQ's layout) for comparison, and a
probe kernel that reads the same bytes in the codebook layout with four ways of turning a nibble
into its value: a load from the 16-entry table in global memory, `tl.gather` from the table held in
registers (what the form does since), arithmetic (`q - 8`, no table: the cost of the rest), and
"block tables": each absmax block's 16 weights computed and rounded once, then gathered (no
multiply or rounding per weight; the same values), each with two half-K dots on x's even and odd
columns (the form's first version) and with the halves joined back into one tile for one dot
("joined", the form's since). `--probes joined` (the default) runs the joined variants without the
global-memory table only, `all` the eight. Each row also gives the bandwidth the form's 4-bit bytes
stream at and the form's time over bitsandbytes' (below 1: the form wins, what decode_gemm's
routing of Linear4bit modules on CUDA is set from).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import triton
import triton.language as tl

SHAPES = {"q/o_proj": (4096, 4096), "gate/up_proj": (14336, 4096), "down_proj": (4096, 14336),
          "k/v_proj": (1024, 4096)}
PER_LAYER = {"q/o_proj": 2, "gate/up_proj": 2, "down_proj": 1, "k/v_proj": 2}  # (Linear4bit modules are never fused)
LOOKUPS = {"table load": 0, "tl.gather": 1, "arithmetic": 2, "block tables": 3}


@triton.jit
def _probe_kernel(x_ptr, w_ptr, s_ptr, code_ptr, out_ptr, M, N, K, k_per_split, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr, LOOKUP: tl.constexpr,
                  JOIN: tl.constexpr):
    """out[:, tile] += x @ w.T over one K split (fp32 atomics), w in bitsandbytes' 4-bit layout.
    JOIN: the high and low nibbles' weights interleaved back into one [BLOCK_N, BLOCK_K] tile
    (tl.join) for one dot with x's contiguous columns, instead of two dots with its even and odd ones."""
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    rows = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    half = tl.arange(0, BLOCK_K // 2)
    k0 = pid_k * k_per_split
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    dtype = x_ptr.dtype.element_ty
    if LOOKUP == 1:
        table = tl.broadcast_to(tl.load(code_ptr + tl.arange(0, 16))[None, :], (BLOCK_N, 16))
    for k in range(0, k_per_split, BLOCK_K):
        at = k0 + k
        packed = tl.load(w_ptr + rows[:, None] * (K // 2) + (at // 2 + half)[None, :])
        absmax = tl.load(s_ptr + rows[:, None] * (K // GROUP) + (at // GROUP + tl.arange(0, BLOCK_K // GROUP))[None, :])
        hi = (packed >> 4).to(tl.int32)
        lo = (packed & 0xF).to(tl.int32)
        if LOOKUP == 0:
            vh = tl.load(code_ptr + hi)
            vl = tl.load(code_ptr + lo)
        elif LOOKUP == 1:
            vh = tl.gather(table, hi, 1)
            vl = tl.gather(table, lo, 1)
        elif LOOKUP == 2:
            vh = (hi - 8).to(tl.float32)
            vl = (lo - 8).to(tl.float32)
        if LOOKUP == 3:
            # Each block's 16 weights code[j] * absmax rounded once (the same values the rebuilt
            # weights take), then gathered: no multiply or rounding per weight.
            tables = (tl.load(code_ptr + tl.arange(0, 16))[None, None, :] * absmax[:, :, None]).to(dtype)
            shape = (BLOCK_N, BLOCK_K // GROUP, GROUP // 2)
            wh = tl.gather(tables, tl.reshape(hi, shape), 2)
            wl = tl.gather(tables, tl.reshape(lo, shape), 2)
            if JOIN:
                w = tl.reshape(tl.join(wh, wl), (BLOCK_N, BLOCK_K))
            else:
                wh = tl.reshape(wh, (BLOCK_N, BLOCK_K // 2))
                wl = tl.reshape(wl, (BLOCK_N, BLOCK_K // 2))
        elif JOIN:
            v = tl.reshape(tl.join(vh, vl), (BLOCK_N, BLOCK_K // GROUP, GROUP))
            w = tl.reshape(v * absmax[:, :, None], (BLOCK_N, BLOCK_K)).to(dtype)
        else:
            wh = tl.reshape(tl.reshape(vh, (BLOCK_N, BLOCK_K // GROUP, GROUP // 2)) * absmax[:, :, None],
                            (BLOCK_N, BLOCK_K // 2)).to(dtype)
            wl = tl.reshape(tl.reshape(vl, (BLOCK_N, BLOCK_K // GROUP, GROUP // 2)) * absmax[:, :, None],
                            (BLOCK_N, BLOCK_K // 2)).to(dtype)
        if JOIN:
            xj = tl.load(x_ptr + offs_m[:, None] * K + (at + tl.arange(0, BLOCK_K))[None, :],
                         mask=(offs_m < M)[:, None], other=0.0)
            acc += tl.dot(xj, tl.trans(w))
        else:
            xp = x_ptr + offs_m[:, None] * K + (at + 2 * half)[None, :]
            xe = tl.load(xp, mask=(offs_m < M)[:, None], other=0.0)
            xo = tl.load(xp + 1, mask=(offs_m < M)[:, None], other=0.0)
            acc += tl.dot(xe, tl.trans(wh))
            acc += tl.dot(xo, tl.trans(wl))
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.atomic_add(out_ptr + offs_m[:, None] * N + cols[None, :], acc, mask=(offs_m < M)[:, None])


def _probe(x, packed, absmax, code, lookup: int, split: int, join: int = 0):
    M, K = x.shape
    N = packed.shape[0]
    out = torch.zeros(M, N, dtype=torch.float32, device=x.device)
    _probe_kernel[(N // 64, split)](x, packed, absmax, code, out, M, N, K, K // split, BLOCK_M=max(16, triton.next_power_of_2(M)),
                                    BLOCK_N=64, BLOCK_K=128, GROUP=64, LOOKUP=lookup, JOIN=join, num_warps=4,
                                    num_stages=3)
    return out


def _time_us(fn, calls: int = 50) -> float:
    """Microseconds per call replayed from a CUDA graph of `calls` calls (as the engine's decode steps
    run: no host time between kernels); eager launches where the call cannot be captured."""
    fn(0)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(calls):
                fn(i)
        graph.replay()
        torch.cuda.synchronize()
        start.record()
        graph.replay()
        end.record()
    except Exception:  # noqa: BLE001 - not capturable: eager, host time included
        from hf_async_cb.kernels.graph_timing import eager_ms

        return eager_ms(fn, calls) * 1000
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / calls


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default="1,2,4,8,16,32,64,128,256")
    p.add_argument("--probes", choices=("joined", "all", "none"), default="joined")
    p.add_argument("--hqq", action="store_true", help="time the grouped 4-bit form (HQQ's layout) too")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    import bitsandbytes as bnb
    import bitsandbytes.functional as F

    from hf_async_cb.kernels.skinny_gemm import skinny_linear_grouped, skinny_linear_codebook_4bit

    dev = torch.device("cuda")
    results = []
    for name, (N, K) in SHAPES.items():
        copies = max(2, int(160e6 // (N * K // 2)) + 1)  # > the L2 in 4-bit bytes
        w16 = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) for _ in range(2)]
        states = [F.quantize_4bit(w16[i % 2], blocksize=64, quant_type="nf4") for i in range(copies)]
        packed = [q.view(N, K // 2) for q, _ in states]
        hqq = [] if not args.hqq else [(torch.randint(0, 255, (N // 2, K), device=dev, dtype=torch.uint8),
                torch.rand(N * K // 64, device=dev, dtype=torch.bfloat16),
                torch.rand(N * K // 64, device=dev, dtype=torch.bfloat16)) for _ in range(copies)]
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, K, device=dev, dtype=torch.bfloat16)
            row = dict(shape=name, n=N, k=K, rows=rows, copies=copies)
            row["cublas_bf16_us"] = _time_us(lambda i: torch.nn.functional.linear(x, w16[i % 2]))
            row["bnb_own_us"] = _time_us(lambda i: bnb.matmul_4bit(x, packed[i % copies].view(-1, 1),
                                                                   states[i % copies][1]))
            row["codebook_form_us"] = _time_us(lambda i: skinny_linear_codebook_4bit(
                x, packed[i % copies], states[i % copies][1].absmax, states[i % copies][1].code, 64))
            if args.hqq:
                row["hqq_form_us"] = _time_us(lambda i: skinny_linear_grouped(x, *hqq[i % copies], 64))
            split = max(1, min(16, 264 // max(1, N // 64)))
            probes = {"all": [(j, lk) for j in (0, 1) for lk in LOOKUPS.items()],
                      "joined": [(1, lk) for lk in LOOKUPS.items() if lk[1]], "none": []}[args.probes]
            for join, (label, lookup) in probes:
                column = f"probe_{label}{', joined' if join else ''}_us"
                try:
                    row[column] = _time_us(lambda i: _probe(x, packed[i % copies], states[i % copies][1].absmax,
                                                            states[i % copies][1].code, lookup, split, join))
                except Exception as e:  # noqa: BLE001 - a variant this Triton cannot build: say so in its cell
                    row[column] = f"{type(e).__name__}: {str(e)[:80]}"
            bytes_4bit = N * K / 2 + N * K / 64 * 4
            row["codebook_form_tb_s"] = round(bytes_4bit / row["codebook_form_us"] / 1e6, 3)
            row["form_over_bnb"] = round(row["codebook_form_us"] / row["bnb_own_us"], 3)
            results.append(row)
            print(json.dumps({k: (round(v, 1) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
    wins = form_wins(results)
    print(json.dumps({"form_wins_at_rows": wins}), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


def form_wins(results: list[dict]) -> list[int]:
    """The rows counts at which a decoder layer's seven projections take less time in the codebook
    form than in bitsandbytes' own path, summed (what decode_gemm.BNB_4BIT_CUDA_BUCKETS is set from)."""
    wins = []
    for rows in sorted({r["rows"] for r in results}):
        at = [r for r in results if r["rows"] == rows]
        if sum(PER_LAYER[r["shape"]] * r["codebook_form_us"] for r in at) < \
                sum(PER_LAYER[r["shape"]] * r["bnb_own_us"] for r in at):
            wins.append(rows)
    return wins


if __name__ == "__main__":
    sys.exit(main())
