"""LLM.int8() products for decode steps: bitsandbytes' Linear8bitLt computed as its own forward
computes it, in kernels a CUDA graph can record.

Why: bitsandbytes' forward finds the activation columns at or above its outlier threshold (6.0 by
default) with `argwhere`, which waits for the GPU and sizes tensors by the count: no CUDA graph can
hold it, and every projection of every step pays a host round trip. On the H200 an 8B model then
ran slower through the engine than through stock generate (0.82x, docs/benchmarks.md). Here the
outlier columns are a flag per column on the device, and the weight is read once as int8.

What bitsandbytes computes (0.45 to 0.50, `MatMul8bitLt` in inference), for x [M, K] and the int8
weight CB [N, K] with a scale SCB per output row:
1. x is cast to fp16. A column holds an outlier where any row's |x| reaches the threshold.
2. Each row is quantized on its own: absmax over its values below the threshold, q = round(x * 127
   / absmax) (round half to even), its values at or above the threshold 0; then (with more than one
   row) every outlier column is 0 in every row.
3. The int8 product is summed exactly in int32 and dequantized with the row's absmax and the
   weight row's SCB, the bias added, in the output dtype.
4. Outlier columns are added back in x's own dtype: x[:, cols] @ (CB[:, cols] * SCB / 127, rounded
   to x's dtype).T, added to the product of 3 (one rounding).
The rounding of 2 and 3 differs between bitsandbytes' CUDA kernels (a fast division for 127 /
absmax; the product dequantized as fma(acc * absmax * SCB, 1 / 127^2, fp16 bias) rounded to fp16,
any other bias added in fp16 after, then cast) and its PyTorch implementation on the CPU (127 times
the rounded 1 / absmax, as torch divides a number by a tensor; (acc * (absmax * SCB)) / 127^2 + bias
in fp32, then cast): the kernels' CUDA constexpr picks the device's.

The outlier columns depend on every row of the call. So a CUDA-graph bucket's padding rows must not
count: `real` flags the rows that do (the step's real tokens; model/decode_gemm.py passes them).

Kernels, three a call (each a CUDA graph holds; none branches per K tile of its main loop, so loads
pipeline):
- `_int8_stats_kernel`, one program per 128 columns over all rows: each row's absmax over those
  columns, the columns' outlier flags, and whether the block holds any;
- `_int8_gemm_kernel`, one program per (BLOCK_N weight rows, K split): reduces the absmax, quantizes
  x tile by tile as it reads it, and sums int8 x int8 in int32 (exact: the splits' partial sums add
  up to the very integers bitsandbytes' cuBLASLt product gives); then, over the statistics' blocks of
  its K range that hold an outlier column (one scalar test a block, after the main loop), the outlier
  columns' product in x's dtype, summed in fp32, reading weight tiles the loop has just brought into L2;
- `_int8_finish_kernel`, one program per BLOCK_N columns: adds the splits, dequantizes, adds the
  bias, then the splits' outlier sums in split order (deterministic), the splits without an outlier
  block skipped.
On the H200 a first version with the outlier product inside the GEMM's K loop (a branch per tile)
and no split streamed the 8B projections at 0.1-1 TB/s, and a second with the outlier product in the
finish kernel (N / 64 programs walking every outlier block one after the other) was slow where most
blocks hold one, as random weights' down-projection inputs do (docs/benchmarks.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from hf_async_cb.devices import num_sms
from hf_async_cb.kernels.skinny_gemm import H200_SMS, MAX_M, block_m, runs_on
from hf_async_cb.kernels.variant import Variant

STATS_BLOCK_K = 128  # columns per program of the statistics kernel
STATS_ROWS = 32  # rows it loads at a time
ABSMAX_BLOCK = 32  # statistics blocks the GEMM reduces at a time
FINISH_BLOCK_N = 64  # output columns per program of the finish kernel
OUTLIER_K_MANY_ROWS = 32  # columns per outlier-product tile in the GEMM above 64 rows (with 128, ptxas spilled at 256 rows)
_ROUND = tl.constexpr(12582912.0)  # 1.5 * 2^23: (v + _ROUND) - _ROUND rounds |v| < 2^22 half to even in fp32
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# The launch options: no fused multiply-adds but those written (tl.fma), so that every rounding is
# the one bitsandbytes makes (the rounding above would otherwise become fma(x, scale, _ROUND)).
_OPTIONS = dict(enable_fp_fusion=False)


@triton.jit(do_not_specialize=["M"])
def _int8_stats_kernel(x_ptr, real_ptr, flags_ptr, chunks_ptr, absmax_ptr, M, K, blocks, stride_xm, threshold,
                       BLOCK_K: tl.constexpr, ROWS: tl.constexpr, OUTLIERS: tl.constexpr, MASKED: tl.constexpr):
    """Program j, columns [j * BLOCK_K, (j + 1) * BLOCK_K) of x, read as fp16: absmax[m, j] = the
    largest |x[m, k]| below the threshold (every one without OUTLIERS); flags[k] = 1 where a row
    (a real one, with MASKED: real[m] != 0) reaches it, else 0; chunks[j] = 1 where any flag is."""
    j = tl.program_id(0)
    offs_k = j * BLOCK_K + tl.arange(0, BLOCK_K)
    k_ok = offs_k < K
    flag = tl.zeros([BLOCK_K], dtype=tl.int32)
    for m0 in range(0, M, ROWS):
        rows = m0 + tl.arange(0, ROWS)
        m_ok = rows < M
        x = tl.load(x_ptr + rows[:, None] * stride_xm + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        a = tl.abs(x.to(tl.float16).to(tl.float32))
        if OUTLIERS:
            big = a >= threshold
            if MASKED:
                counts = m_ok & (tl.load(real_ptr + rows, mask=m_ok, other=0) != 0)
            else:
                counts = m_ok
            flag = tl.maximum(flag, tl.max((big & counts[:, None]).to(tl.int32), axis=0))
            a = tl.where(big, 0.0, a)
        tl.store(absmax_ptr + rows * blocks + j, tl.max(a, axis=1), mask=m_ok)
    if OUTLIERS:
        tl.store(flags_ptr + offs_k, flag.to(tl.int8), mask=k_ok)
        tl.store(chunks_ptr + j, tl.max(flag, axis=0).to(tl.int8))


@triton.jit
def _row_scales(absmax_ptr, offs_m, m_ok, blocks, BLOCK_M: tl.constexpr, ABSMAX_BLOCK: tl.constexpr,
                CUDA: tl.constexpr):
    """(absmax, 127 / absmax as bitsandbytes computes it; 0 for a row without values) of each row,
    from the statistics kernel's blocks. (The blocks' maxima are taken element-wise and reduced
    once after the loop: a reduction accumulated inside it crashed Triton 3.6's thread-locality pass
    for sm_90.)"""
    widest = tl.zeros([BLOCK_M, ABSMAX_BLOCK], dtype=tl.float32)
    for j0 in range(0, blocks, ABSMAX_BLOCK):
        js = j0 + tl.arange(0, ABSMAX_BLOCK)
        part = tl.load(absmax_ptr + offs_m[:, None] * blocks + js[None, :], mask=m_ok[:, None] & (js < blocks)[None, :],
                       other=0.0)
        widest = tl.maximum(widest, part)
    absmax = tl.max(widest, axis=1)
    some = absmax > 0  # (a row of zeros, or of outliers alone: its product is 0 whatever q holds)
    if CUDA:
        scale = libdevice.fast_dividef(tl.full([BLOCK_M], 127.0, tl.float32), tl.where(some, absmax, 1.0))
    else:
        # torch's `127.0 / row_stats` is `row_stats.reciprocal() * 127.0`: two roundings
        scale = tl.math.div_rn(tl.full([BLOCK_M], 1.0, tl.float32), tl.where(some, absmax, 1.0)) * 127.0
    return absmax, tl.where(some, scale, 0.0)


@triton.jit
def _split_blocks(s, k_per_split, K, CHUNK: tl.constexpr):
    """(end of the GEMM's split s's K range, its first and past-last statistics block): the blocks whose
    outlier product split s sums, and for which the finish kernel reads those sums."""
    k0 = s * k_per_split
    k_end = tl.minimum(k0 + k_per_split, K)
    return k_end, k0 // CHUNK, tl.cdiv(k_end, CHUNK)


@triton.jit(do_not_specialize=["M"])
def _int8_gemm_kernel(x_ptr, w_ptr, flags_ptr, chunks_ptr, scb_ptr, absmax_ptr, part_ptr, outlier_ptr, M, N, K, blocks,
                      k_per_split, stride_xm, threshold, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, ABSMAX_BLOCK: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
                      CHUNK: tl.constexpr, OUTLIER_K: tl.constexpr, OUTLIERS: tl.constexpr, CUDA: tl.constexpr,
                      IEEE: tl.constexpr):
    """Program (i, s): part[s, :, i * BLOCK_N : (i + 1) * BLOCK_N] = the int32 sum over split s's K range
    of q(x) x CB (the module docstring's step 2, and 3 before its dequantization); with OUTLIERS and an
    outlier block (CHUNK columns, the statistics kernel's) overlapping that range, outlier[s, ...] = the
    fp32 sum of the range's outlier columns' products in x's dtype (step 4 before its addition)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = cols < N
    _, scale = _row_scales(absmax_ptr, offs_m, m_ok, blocks, BLOCK_M, ABSMAX_BLOCK, CUDA)
    k0 = pid_k * k_per_split
    offs_k = k0 + tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + cols.to(tl.int64)[:, None] * K + offs_k[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.int32)
    for k in range(0, k_per_split, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
            if EVEN_N:
                w = tl.load(w_ptrs)
            else:
                w = tl.load(w_ptrs, mask=n_ok[:, None], other=0)
        else:
            k_ok = (offs_k + k) < K
            x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0)
        x16 = x.to(tl.float16).to(tl.float32)
        q = (x16 * scale[:, None] + _ROUND) - _ROUND
        if OUTLIERS:  # values at or above the threshold, and every value of an outlier column, are 0
            if EVEN_K:
                flag = tl.load(flags_ptr + offs_k + k)
            else:
                flag = tl.load(flags_ptr + offs_k + k, mask=k_ok, other=0)
            q = tl.where((tl.abs(x16) < threshold) & (flag == 0)[None, :], q, 0.0)
        acc += tl.dot(w, tl.trans(q.to(tl.int8)), out_dtype=tl.int32)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    part = (pid_k * M).to(tl.int64) * N + offs_m[None, :] * N + cols[:, None]
    tl.store(part_ptr + part, acc, mask=n_ok[:, None] & m_ok[None, :])
    if OUTLIERS:
        dtype = x_ptr.dtype.element_ty
        k_end, first, last = _split_blocks(pid_k, k_per_split, K, CHUNK)
        scb = tl.load(scb_ptr + cols, mask=n_ok, other=0.0).to(tl.float32)
        outliers = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        seen = 0
        for j in range(first, last):
            if tl.load(chunks_ptr + j) != 0:
                for h in tl.static_range(0, CHUNK, OUTLIER_K):  # (narrower tiles where the rows are many)
                    kk = j * CHUNK + h + tl.arange(0, OUTLIER_K)
                    flag = tl.load(flags_ptr + kk, mask=(kk >= k0) & (kk < k_end), other=0) != 0
                    xo = tl.load(x_ptr + offs_m[:, None] * stride_xm + kk[None, :],
                                 mask=m_ok[:, None] & flag[None, :], other=0.0)
                    wo = tl.load(w_ptr + cols.to(tl.int64)[:, None] * K + kk[None, :],
                                 mask=n_ok[:, None] & flag[None, :], other=0)
                    w_x = ((wo.to(tl.float32) * scb[:, None]) * 0.007874015718698502).to(dtype)
                    if IEEE:
                        outliers += tl.dot(w_x, tl.trans(xo.to(dtype)), input_precision="ieee")
                    else:
                        outliers += tl.dot(w_x, tl.trans(xo.to(dtype)))
                seen = 1
        if seen != 0:
            tl.store(outlier_ptr + part, outliers, mask=n_ok[:, None] & m_ok[None, :])


@triton.jit(do_not_specialize=["M"])
def _int8_finish_kernel(part_ptr, outlier_ptr, absmax_ptr, scb_ptr, b_ptr, chunks_ptr, out_ptr, M, N, K, blocks,
                        k_per_split, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        ABSMAX_BLOCK: tl.constexpr, CHUNK: tl.constexpr, CHUNKS: tl.constexpr,
                        HAS_BIAS: tl.constexpr, BIAS_F16: tl.constexpr, OUTLIERS: tl.constexpr, CUDA: tl.constexpr):
    """Program i: out[:, i * BLOCK_N : (i + 1) * BLOCK_N] from the GEMM's partial sums (added in
    int32: exact), dequantized and the bias added as bitsandbytes does on x's device (CUDA or its
    PyTorch path), then the outlier columns' product (step 4): the splits' fp32 sums, in split order,
    of the splits whose K range overlaps a statistics block (CHUNK columns) that holds an outlier."""
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = cols < N
    mask = n_ok[:, None] & m_ok[None, :]
    dtype = out_ptr.dtype.element_ty
    absmax, _ = _row_scales(absmax_ptr, offs_m, m_ok, blocks, BLOCK_M, ABSMAX_BLOCK, CUDA)
    offs = offs_m[None, :] * N + cols[:, None]  # [BLOCK_N, BLOCK_M]
    acc = tl.load(part_ptr + offs, mask=mask, other=0)
    for s in tl.static_range(1, SPLIT_K):
        acc += tl.load(part_ptr + s * (M * N).to(tl.int64) + offs, mask=mask, other=0)
    scb = tl.load(scb_ptr + cols, mask=n_ok, other=0.0).to(tl.float32)
    total = acc.to(tl.float32)
    if CUDA:
        product = (total * absmax[None, :]) * scb[:, None]
        if HAS_BIAS and BIAS_F16:
            bias = tl.load(b_ptr + cols, mask=n_ok, other=0.0).to(tl.float32)
            y16 = tl.fma(product, 6.200012e-05, bias[:, None]).to(tl.float16)
        else:
            y16 = (product * 6.200012e-05).to(tl.float16)
            if HAS_BIAS:  # added to the fp16 product, in fp32 (torch's promotion), rounded to fp16
                bias = tl.load(b_ptr + cols, mask=n_ok, other=0.0).to(tl.float32)
                y16 = (y16.to(tl.float32) + bias[:, None]).to(tl.float16)
        y = y16.to(dtype)
    else:
        y = (total * (absmax[None, :] * scb[:, None])) * 6.200124e-05
        if HAS_BIAS:
            y += tl.load(b_ptr + cols, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        y = y.to(dtype)
    if OUTLIERS:
        chunk = tl.arange(0, CHUNKS)
        held = tl.load(chunks_ptr + chunk, mask=chunk < blocks, other=0).to(tl.int32)
        outliers = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for s in tl.static_range(0, SPLIT_K):  # (the splits whose GEMM program wrote its sums)
            _, first, last = _split_blocks(s, k_per_split, K, CHUNK)
            if tl.sum(tl.where((chunk >= first) & (chunk < last), held, 0), axis=0) != 0:
                outliers += tl.load(outlier_ptr + s * (M * N).to(tl.int64) + offs, mask=mask, other=0.0)
        y = (y.to(tl.float32) + outliers).to(dtype)
    tl.store(out_ptr + offs, y, mask=mask)


def _gemm_config(bucket: int, N: int, K: int, sms: int | None = None) -> dict:
    """The GEMM's launch for rows bucket `bucket` (every M of it launches one variant), N weight rows
    and K columns. BLOCK_N 64; BLOCK_K 256 up to 32 rows, 128 up to 64, 64 above (x's tile is
    quantized in registers); SPLIT_K the smallest power of two giving two waves of programs over the
    SMs (132 assumed off CUDA), each split at least two K tiles, at most 16, and the int32 partials
    (SPLIT_K x M x N x 4 bytes) at most a quarter of the weight's bytes (so they stay in L2)."""
    bm = block_m(bucket)
    bn = 64
    bk = 256 if bm <= 32 else 128 if bm <= 64 else 64
    bk = min(bk, max(32, triton.next_power_of_2(K)))
    tiles = triton.cdiv(N, bn)
    cap = min(16, max(1, K // (2 * bk)), max(1, K // (16 * bm)))
    split = 1
    while tiles * split < 2 * (sms or H200_SMS) and split * 2 <= cap:
        split *= 2
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, num_warps=4 if bm <= 64 else 8,
                num_stages=3 if bm <= 64 else 2)


def _plan(bucket: int, N: int, K: int, dtype: torch.dtype, bias: torch.dtype | None, outliers: bool, cuda: bool,
          masked: bool, sms: int | None = None) -> tuple[tuple, tuple, tuple, int]:
    """((constexprs, options) of the statistics kernel, of the GEMM, of the finish, the GEMM's K per
    split): one derivation for a launch and for variants()."""
    cfg = _gemm_config(bucket, N, K, sms)
    split, bk = cfg["SPLIT_K"], cfg["BLOCK_K"]
    k_per_split = triton.cdiv(triton.cdiv(K, split), bk) * bk  # K / split, rounded up to whole K tiles
    stats = dict(BLOCK_K=STATS_BLOCK_K, ROWS=STATS_ROWS, OUTLIERS=outliers, MASKED=masked and outliers)
    gemm = dict(BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=bk, ABSMAX_BLOCK=ABSMAX_BLOCK,
                EVEN_K=split * k_per_split == K, EVEN_N=N % cfg["BLOCK_N"] == 0, CHUNK=STATS_BLOCK_K,
                OUTLIER_K=STATS_BLOCK_K if cfg["BLOCK_M"] <= 64 else OUTLIER_K_MANY_ROWS, OUTLIERS=outliers, CUDA=cuda,
                IEEE=dtype == torch.float32)
    finish = dict(SPLIT_K=split, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=FINISH_BLOCK_N, ABSMAX_BLOCK=ABSMAX_BLOCK,
                  CHUNK=STATS_BLOCK_K, CHUNKS=max(16, triton.next_power_of_2(triton.cdiv(K, STATS_BLOCK_K))),
                  HAS_BIAS=bias is not None, BIAS_F16=bias == torch.float16, OUTLIERS=outliers, CUDA=cuda)
    small = dict(num_warps=4 if cfg["BLOCK_M"] <= 64 else 8, **_OPTIONS)
    return ((stats, dict(num_warps=4, **_OPTIONS)), (gemm, dict(num_warps=cfg["num_warps"],
                                                              num_stages=cfg["num_stages"], **_OPTIONS)),
            (finish, small), k_per_split)


def llm_int8_linear(x: torch.Tensor, weight: torch.Tensor, scb: torch.Tensor, threshold: float,
                    bias: torch.Tensor | None = None, *, real: torch.Tensor | None = None) -> torch.Tensor:
    """bitsandbytes' Linear8bitLt product (inference, `MatMul8bitLt`) of x [..., K] (bf16, fp16 or
    fp32; at most MAX_M rows once flattened) with its int8 weight [N, K] (`CB`) and row scales `scb`
    (float32 [N], `SCB`), the outlier threshold (0: none; else a value fp16 holds exactly, as the
    module's comparisons in fp16 need), bias [N] in any float dtype or None: the result its forward
    gives, in x's dtype, rounded as on x's device (module docstring). `real` (bool or integer [M]):
    the rows whose outliers count (the others' results are computed but meaningless to them); None:
    every row. Raises ValueError for what it does not take."""
    K = x.shape[-1] if x.dim() else 0
    if weight.dim() != 2 or weight.dtype != torch.int8 or weight.shape[1] != K or not weight.is_contiguous():
        raise ValueError(f"llm_int8_linear takes x [..., K] and a contiguous int8 weight [N, K], got x "
                         f"{tuple(x.shape)}, weight {weight.dtype} {tuple(weight.shape)}")
    N = weight.shape[0]
    if x.dtype not in _DTYPES:
        raise ValueError(f"llm_int8_linear takes x in one of {_DTYPES}, got {x.dtype}")
    if scb.dtype != torch.float32 or scb.numel() != N:
        raise ValueError(f"llm_int8_linear takes {N} float32 row scales, got {scb.numel()} in {scb.dtype}")
    if not (threshold >= 0.0 and float(torch.tensor(threshold, dtype=torch.float16)) == threshold):
        raise ValueError(f"llm_int8_linear takes a threshold >= 0 that fp16 holds exactly, got {threshold!r}")
    if bias is not None and (tuple(bias.shape) != (N,) or bias.dtype not in _DTYPES):
        raise ValueError(f"llm_int8_linear takes a float bias of shape ({N},), got {bias.dtype} {tuple(bias.shape)}")
    tensors = [weight, scb] + [t for t in (bias, real) if t is not None]
    if any(t.device != x.device for t in tensors) or not runs_on(x.device):
        raise ValueError(f"llm_int8_linear runs on CUDA (or in Triton's interpreter), all tensors on x's device, "
                         f"not {x.device}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    if M > MAX_M or K == 0 or N == 0:
        raise ValueError(f"llm_int8_linear takes 1 to {MAX_M} rows and K, N > 0, got {M} rows of {K}, N = {N}")
    if real is not None and real.numel() != M:
        raise ValueError(f"llm_int8_linear: `real` flags {real.numel()} rows, x has {M}")
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return out.reshape(*lead, N)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    outliers = threshold > 0.0
    (stats, stats_options), (gemm, gemm_options), (finish, finish_options), k_per_split = _plan(
        M, N, K, x.dtype, None if bias is None else bias.dtype, outliers, x.device.type == "cuda", real is not None,
        num_sms(x.device))
    blocks = triton.cdiv(K, STATS_BLOCK_K)
    flags = torch.empty(K if outliers else 1, dtype=torch.int8, device=x.device)
    chunks = torch.empty(blocks if outliers else 1, dtype=torch.int8, device=x.device)
    absmax = torch.empty(M, blocks, dtype=torch.float32, device=x.device)
    split = finish["SPLIT_K"]
    part = torch.empty(split, M, N, dtype=torch.int32, device=x.device)
    outlier_sums = torch.empty(split if outliers else 1, M, N, dtype=torch.float32, device=x.device)
    stride = x2.stride(0) if M > 1 else K  # (one row's stride is never read: K keeps it from specialising)
    real = flags if real is None else real.reshape(-1).to(torch.int8)
    threshold = float(threshold)
    _int8_stats_kernel[(blocks,)](x2, real, flags, chunks, absmax, M, K, blocks, stride, threshold, **stats,
                                  **stats_options)
    _int8_gemm_kernel[(triton.cdiv(N, gemm["BLOCK_N"]), split)](
        x2, weight, flags, chunks, scb, absmax, part, outlier_sums, M, N, K, blocks, k_per_split, stride, threshold,
        **gemm, **gemm_options)
    _int8_finish_kernel[(triton.cdiv(N, FINISH_BLOCK_N),)](
        part, outlier_sums, absmax, scb, bias.contiguous() if bias is not None else scb, chunks, out, M, N, K, blocks,
        k_per_split, **finish, **finish_options)
    return out.reshape(*lead, N)


def variants(N: int, K: int, dtype: torch.dtype, bias: torch.dtype | None, outliers: bool, bucket: int,
             cuda: bool = True, masked: bool = True) -> list[Variant]:
    """The compiled variants an [M, K] x [N, K].T LLM.int8() product in `dtype` launches at the rows
    bucket `bucket` (M is not specialised), with a bias of dtype `bias` or none, an outlier threshold
    or not, the real rows flagged (`masked`, what the engine's steps pass) or not."""
    (stats, stats_options), (gemm, gemm_options), (finish, finish_options), k_per_split = _plan(
        bucket, N, K, dtype, bias, outliers, cuda, masked)
    threshold = 6.0 if outliers else 0.0  # (a float either way: never specialised)
    blocks = triton.cdiv(K, STATS_BLOCK_K)
    i8, f32 = torch.int8, torch.float32
    return [
        Variant(_int8_stats_kernel, (dtype, i8, i8, i8, f32, 2, K, blocks, K, threshold), stats, stats_options),
        Variant(_int8_gemm_kernel, (dtype, i8, i8, i8, f32, f32, torch.int32, f32, 2, N, K, blocks, k_per_split, K,
                                    threshold), gemm, gemm_options),
        Variant(_int8_finish_kernel, (torch.int32, f32, f32, f32, bias or f32, i8, dtype, 2, N, K, blocks, k_per_split),
                finish, finish_options),
    ]
