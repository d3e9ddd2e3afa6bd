"""Skinny GEMMs for decode steps: y = x @ weight.T (+ bias) for a few rows x (M <= 256).

Why: a decode step multiplies one row per running request by every weight matrix. At such M the
work is bound by streaming the weight [N, K] from memory once, not by arithmetic (M = 32 in bf16
is 32 flop per weight byte, against the H200's ~200 at its ridge), so the step is as fast as the
weights stream. On the H200 (docs/benchmarks.md) the Llama-3-8B shape at 32 rows spends 5.18 ms
of a 5.96 ms step in GEMMs against a 4.38 ms floor for the whole step: cuBLAS streams a lone
4096 x 4096 projection at ~1.1 TB/s and the fused gate/up at ~3.9 TB/s, of a 4.27 TB/s copy
bandwidth. A kernel made for few rows can aim at the copy bandwidth for every shape.

How: one program per BLOCK_N rows of the weight (and per K range with split-K). Each program
loads its weight tile once, as [BLOCK_N, BLOCK_K] blocks walked along K, and multiplies it with
all M rows of x at once (BLOCK_M = M rounded up to a power of two, at least 16 for tl.dot), with
an fp32 accumulator. The weight is read exactly once over the grid; x (M x K, small) is re-read by
every N tile, from L2. With few N tiles (N = 4096 at BLOCK_N = 64 is 64 programs for 132 SMs) the
K dimension is split over SPLIT_K programs as well, so that every SM streams: each writes an fp32
partial sum to a [SPLIT_K, M, N] buffer and a small second kernel adds the partials in a fixed
order, adds the bias and casts to the output dtype. That reduction is deterministic (the same
inputs give the same bits, every run), which fp32 atomics into a workspace would not be (their
order of arrival varies), and it needs no zeroed workspace, so it costs no extra memset launch;
the partials (SPLIT_K x M x N x 4 bytes, capped by default_config to a quarter of the weight's
bytes) stay mostly in L2. Towards M = 256 the picture changes: x is as large as a weight tile,
every N tile re-reads it, and arithmetic starts to count, so cuBLAS may well win there (GemmChoice
measures which does).

SWAP_AB (a config option) computes the transposed product weight_tile @ x_tile.T, so that the
weight's BLOCK_N rows, not the few rows of x, fill the MMA's M dimension (on Hopper, Triton can
then use wgmma for tiles of 64 rows or more); whether that streams faster is the H200's to say
(benchmarks/tune_gemm.py sweeps both).

Weight forms besides the activations' own dtype (scaled int8, HQQ's grouped 8/4/2/1-bit, pre-scaled,
codebook 4-bit: each read as its quantized bytes, rebuilt tile by tile) are kernels/skinny_gemm_forms.py's;
a `WeightForm` record names the one a launch or a listed variant runs.

M is a `do_not_specialize` argument: one compiled variant serves every M of a BLOCK_M bucket, so
the engine's CUDA-graph buckets compile a bounded number of variants. N and K are the weight's,
fixed per layer, and are specialised as usual (divisibility by 16 lets loads vectorise).

GemmChoice (kernels/gemm_choice.py) decides per shape between this kernel and cuBLAS (F.linear)
from measurements taken at warm-up (`tune`), remembered in memory and on disk. Measured on the
H200 in CUDA graphs (docs/benchmarks.md, 2026-12-01), cuBLAS streams the large decode shapes at
3.3-4.0 TB/s already and this kernel wins only the lm_head, by 5-8%: the numbers quoted above for
cuBLAS came from eager profiles, which count launch gaps.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_async_cb.devices import num_sms
# The forms' Triton helpers are the kernel's globals: its cache key counts them (variant.settle_cache_keys).
from hf_async_cb.kernels.skinny_gemm_forms import (PLAIN, SCALED_INT8, WeightForm, _codebook_4bit_pointers,
                                                   _codebook_4bit_tile, _grouped_pointers, _grouped_tile,
                                                   _prescaled_tile, check_codebook_4bit, check_grouped,
                                                   check_prescaled, check_scaled_int8, grouped_word)
from hf_async_cb.kernels.variant import Variant

MAX_M = 256
H200_SMS = 132  # the SM count assumed off CUDA (the heuristic's target machine)
SHARED_MEMORY_BUDGET = 128 * 1024  # the defaults' share of the H200's ~227 KB a block may take
MAX_SHARED_MEMORY = 200 * 1024  # the most a candidate config may take, with room for Triton's scratch
CONFIG_KEYS = ("BLOCK_N", "BLOCK_K", "SPLIT_K", "num_warps", "num_stages", "SWAP_AB")
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit(do_not_specialize=["M"])
def _skinny_gemm_kernel(x_ptr, w_ptr, b_ptr, out_ptr, s_ptr, z_ptr, M, N, K, k_per_split, stride_xm,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
                        HAS_BIAS: tl.constexpr, SWAP_AB: tl.constexpr, IEEE: tl.constexpr,
                        SCALED: tl.constexpr, GROUP: tl.constexpr, PRESCALED: tl.constexpr,
                        CODEBOOK: tl.constexpr, BITS: tl.constexpr, DEQUANT: tl.constexpr):
    """Program (n tile, k split): out[:, tile] (SPLIT_K = 1) or partial[split, :, tile] (fp32).
    The weight forms (kernels/skinny_gemm_forms.py): an int8 weight is converted to x's dtype exactly;
    SCALED: the rounded product times its output row's scale (s_ptr), rounded again (with split-K,
    the reduce kernel does this); GROUP > 0: w_ptr BITS-bit weights packed as HQQ (DEQUANT > 0: quanto) packs them,
    s_ptr and z_ptr a scale and a zero per GROUP weights along K, rebuilt by the DEQUANT rule; PRESCALED: each int8 (or fp8) weight
    times its row's scale (s_ptr) before the product, so the partials of split-K are only added;
    CODEBOOK > 0: w_ptr two 4-bit codes per byte along K, z_ptr their 16 values, s_ptr an absmax
    per GROUP weights along K."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n0 = pid_n * BLOCK_N
    k0 = pid_k * k_per_split  # k_per_split is a multiple of BLOCK_K (and of GROUP)
    m_ok = offs_m < M
    n_ok = (n0 + offs_n) < N
    if CODEBOOK > 0:
        w_ptrs, s_ptrs = _codebook_4bit_pointers(w_ptr, s_ptr, n0, k0, K, BLOCK_N, BLOCK_K, GROUP)
    elif GROUP > 0:
        w_ptrs, shift, s_ptrs, z_ptrs = _grouped_pointers(w_ptr, s_ptr, z_ptr, n0, k0, N, K, BLOCK_N, BLOCK_K,
                                                          GROUP, BITS, DEQUANT)
    else:
        # The tile's first row in 64 bits (an lm_head may hold 2**31 elements or more); offsets inside it in 32.
        w_ptrs = w_ptr + n0.to(tl.int64) * K + offs_n[:, None] * K + (k0 + offs_k)[None, :]
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + (k0 + offs_k)[None, :]
    if PRESCALED:
        row_scale = tl.load(s_ptr + n0 + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    if SWAP_AB:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, k_per_split, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
        else:
            k_ok = (k0 + k + offs_k) < K
            x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        if CODEBOOK > 0:
            w = _codebook_4bit_tile(w_ptrs, s_ptrs, z_ptr, n_ok, k0 + k, K, x_ptr.dtype.element_ty, CODEBOOK, BLOCK_N,
                                    BLOCK_K, GROUP, EVEN_K, EVEN_N)
            s_ptrs += BLOCK_K // GROUP
        elif GROUP > 0:
            w = _grouped_tile(w_ptr, w_ptrs, s_ptrs, z_ptrs, shift, n0, n_ok, k0 + k, N, K, x_ptr.dtype.element_ty,
                              BLOCK_N, BLOCK_K, GROUP, EVEN_K, EVEN_N, BITS, DEQUANT)
            s_ptrs += BLOCK_K // GROUP
            z_ptrs += BLOCK_K // GROUP
        else:
            if not EVEN_K:
                w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            elif EVEN_N:
                w = tl.load(w_ptrs)
            else:
                w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
            if PRESCALED:
                w = _prescaled_tile(w, row_scale, x_ptr.dtype.element_ty)
            elif w_ptr.dtype.element_ty != x_ptr.dtype.element_ty:  # int8 (the scaled form): exact in x's dtype
                w = w.to(tl.float32).to(x_ptr.dtype.element_ty)
        if SWAP_AB:
            if IEEE:
                acc += tl.dot(w, tl.trans(x), input_precision="ieee")
            else:
                acc += tl.dot(w, tl.trans(x))
        else:
            if IEEE:
                acc += tl.dot(x, tl.trans(w), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(w))
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K // 2 if CODEBOOK > 0 else BLOCK_K  # (two codes a byte along K)
    if SWAP_AB:
        acc = tl.trans(acc)
    mask = m_ok[:, None] & n_ok[None, :]
    cols = n0 + offs_n
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        y = acc.to(out_ptr.dtype.element_ty)
        if SCALED:
            scale = tl.load(s_ptr + cols, mask=n_ok, other=0.0).to(tl.float32)
            y = (y.to(tl.float32) * scale[None, :]).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + offs_m[:, None] * N + cols[None, :], y, mask=mask)
    else:
        part = out_ptr + (pid_k * M).to(tl.int64) * N
        tl.store(part + offs_m[:, None] * N + cols[None, :], acc, mask=mask)


@triton.jit(do_not_specialize=["total"])
def _splitk_reduce_kernel(part_ptr, b_ptr, out_ptr, s_ptr, total, N,
                          SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr,
                          SCALED: tl.constexpr):
    """out[i] = sum over splits, in order, of partial[split, i] (+ bias[i % N]), over the flat M x N;
    SCALED: rounded to the output dtype, then times the scale of row i % N (the GEMM's SCALED)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < total
    acc = tl.load(part_ptr + offs, mask=ok, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        acc += tl.load(part_ptr + s * total.to(tl.int64) + offs, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs % N, mask=ok, other=0.0).to(tl.float32)
    y = acc.to(out_ptr.dtype.element_ty)
    if SCALED:
        scale = tl.load(s_ptr + offs % N, mask=ok, other=0.0).to(tl.float32)
        y = (y.to(tl.float32) * scale).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + offs, y, mask=ok)


REDUCE_BLOCK = 1024


def block_m(m: int) -> int:
    """The rows of a program's x tile: M rounded up to a power of two, at least 16 (tl.dot's minimum)."""
    return max(16, triton.next_power_of_2(max(1, m)))


def m_bucket(m: int) -> int:
    """M rounded up to a power of two: the engine's CUDA-graph batch buckets, and GemmChoice's key."""
    return triton.next_power_of_2(max(1, m))


def shared_memory_estimate(block_m_: int, block_n: int, block_k: int, num_stages: int, itemsize: int) -> int:
    """Bytes of shared memory the pipelined x and weight tiles take (every stage buffered)."""
    return max(1, num_stages) * (block_m_ + block_n) * block_k * itemsize


def default_config(M: int, N: int, K: int, dtype: torch.dtype = torch.bfloat16, num_sms: int | None = None) -> dict:
    """Launch parameters for an [M, K] x [N, K].T product, not measured yet (the H200 decides later).
    They depend on M only through its BLOCK_M bucket (M rounded up to a power of two, at least 16),
    so every M of a bucket launches the same compiled variant.

    - BLOCK_N 64 for M <= 64 (small tiles: many programs for a bandwidth-bound stream), 128 above
      (more reuse of each x tile once arithmetic starts to count); BLOCK_K 128 in 16-bit, 64 in
      fp32 or above 64 rows (keeping a stage of x and weight tiles to 16-48 KB).
    - num_warps 4, or 8 once the fp32 accumulator (BLOCK_M x BLOCK_N) passes 64 x 64, which keeps
      it at <= 128 registers a thread.
    - num_stages: the deepest of 4, 3, 2 whose tiles fit SHARED_MEMORY_BUDGET (128 KB), to keep
      many weight bytes in flight per SM (what a stream at copy bandwidth needs).
    - SPLIT_K: the smallest power of two with (N / BLOCK_N) x SPLIT_K >= 2 x SMs, i.e. at least two
      waves of programs over the SMs (132 on the H200, assumed when `num_sms` is None), so no SM
      idles while others stream and the tail of the last wave is short. Capped so that every split
      still walks at least two K blocks, at 16, and so that the fp32 partials
      (SPLIT_K x M x N x 4 bytes, written then read back) stay under a quarter of the weight's bytes.
      The Llama-3-8B projections at M = 32 get 4 (q/k/v, 96 tiles), 8 (o and down, 64 tiles) and 1
      (gate/up, 448 tiles; lm_head, 2004)."""
    sms = num_sms or H200_SMS
    itemsize = dtype.itemsize
    bm = block_m(M)
    M = bm
    bn = 64 if bm <= 64 else 128
    bk = 128 if itemsize <= 2 and bm <= 64 else 64
    bn = min(bn, max(16, triton.next_power_of_2(N)))
    bk = min(bk, max(16, triton.next_power_of_2(K)))
    warps = 4 if bm * bn <= 64 * 64 else 8
    stages = next((s for s in (4, 3, 2) if shared_memory_estimate(bm, bn, bk, s, itemsize) <= SHARED_MEMORY_BUDGET), 1)
    tiles = -(-N // bn)
    cap = min(16, max(1, K // (2 * bk)), max(1, K * itemsize // (16 * M)))
    split = 1
    while tiles * split < 2 * sms and split * 2 <= cap:
        split *= 2
    return dict(BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, num_warps=warps, num_stages=stages, SWAP_AB=False)


def candidate_configs(M: int, N: int, K: int, dtype: torch.dtype = torch.bfloat16,
                      num_sms: int | None = None) -> list[dict]:
    """A few configs around the default to time (GemmChoice.tune, benchmarks/tune_gemm.py): the
    default, then one knob at a time: SPLIT_K halved/doubled, BLOCK_N and BLOCK_K halved/doubled,
    the other warp count, one stage fewer, SWAP_AB. Duplicates, tiles under 16, splits with no K
    block of their own and tiles over MAX_SHARED_MEMORY are dropped."""
    base = default_config(M, N, K, dtype, num_sms)
    variants = [base]
    for key, values in (("SPLIT_K", (base["SPLIT_K"] // 2, base["SPLIT_K"] * 2)),
                        ("BLOCK_N", (base["BLOCK_N"] // 2, base["BLOCK_N"] * 2)),
                        ("BLOCK_K", (base["BLOCK_K"] // 2, base["BLOCK_K"] * 2)),
                        ("num_warps", (12 - base["num_warps"],)),
                        ("num_stages", (base["num_stages"] - 1,)),
                        ("SWAP_AB", (not base["SWAP_AB"],))):
        for value in values:
            variants.append({**base, key: value})
    out: list[dict] = []
    for config in variants:
        if config["SPLIT_K"] < 1 or config["BLOCK_N"] < 16 or config["BLOCK_K"] < 16 or config["num_stages"] < 1:
            continue
        if config["SPLIT_K"] > 1 and K < config["SPLIT_K"] * config["BLOCK_K"]:
            continue  # some split would have nothing to do
        if shared_memory_estimate(block_m(M), config["BLOCK_N"], config["BLOCK_K"], config["num_stages"],
                                  dtype.itemsize) > MAX_SHARED_MEMORY:
            continue
        if config not in out:
            out.append(config)
    return out


def _check_config(config: dict) -> dict:
    unknown = set(config) - set(CONFIG_KEYS)
    if unknown:
        raise ValueError(f"skinny_linear config: unknown keys {sorted(unknown)} (known: {', '.join(CONFIG_KEYS)})")
    for key in ("BLOCK_N", "BLOCK_K"):
        v = config[key]
        if not isinstance(v, int) or v < 16 or v & (v - 1):
            raise ValueError(f"skinny_linear config: {key} must be a power of two >= 16, got {v!r}")
    for key in ("SPLIT_K", "num_warps", "num_stages"):
        if not isinstance(config[key], int) or config[key] < 1:
            raise ValueError(f"skinny_linear config: {key} must be a positive int, got {config[key]!r}")
    return config


def runs_on(device: torch.device) -> bool:
    """Whether the kernel can run for tensors on `device` (the CPU only under the interpreter)."""
    return device.type == "cuda" or bool(triton.knobs.runtime.interpret)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                  config: dict | None = None, scale: torch.Tensor | None = None,
                  row_scale: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ weight.T (+ bias), the contract of torch.nn.functional.linear for x [..., K] with at
    most MAX_M (256) rows once the leading dims are flattened, weight [N, K] contiguous (nn.Linear's
    layout), bias [N] or None, all of one dtype (bf16, fp16 or fp32); fp32 accumulation, output in
    x's dtype. `config` overrides default_config's keys (BLOCK_N, BLOCK_K, SPLIT_K, num_warps,
    num_stages, SWAP_AB). With `scale` ([N], x's dtype), weight is int8 with a scale per output row
    (weight-only int8 quantization) and y = (x @ weight.to(dtype).T, rounded) * scale, rounded, with
    no bias. With `row_scale` ([N], x's dtype or float32), weight is int8 or float8_e4m3fn, scaled
    before the product as optimum-quanto's qbytes_mm and torchao's float8 weight-only linear do:
    y = x @ (row_scale * weight, in fp32, rounded to x's dtype).T, with no bias (both add it to the
    rounded product). Raises ValueError for what it does not
    take, so that a caller can fall back to F.linear."""
    if x.dim() < 1 or weight.dim() != 2:
        raise ValueError(f"skinny_linear needs x [..., K] and weight [N, K], got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    N, K = weight.shape
    if x.shape[-1] != K:
        raise ValueError(f"skinny_linear: x has {x.shape[-1]} features, weight [N, K] = {tuple(weight.shape)} "
                         f"expects {K}")
    if scale is not None:
        return _launch(x, weight, None, config, SCALED_INT8, check_scaled_int8(x, weight, bias, scale))
    if row_scale is not None:
        row_scale = check_prescaled(x, weight, bias, row_scale)
        return _launch(x, weight, None, config, WeightForm(weight.dtype, prescaled=True, scale_dtype=(
            torch.float32 if row_scale.dtype == torch.float32 and x.dtype != torch.float32 else None)), row_scale)
    if x.dtype not in _DTYPES or weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        raise ValueError(f"skinny_linear takes one dtype of {_DTYPES} for x, weight and bias, got {x.dtype}, "
                         f"{weight.dtype}, {None if bias is None else bias.dtype}")
    return _launch(x, weight, bias, config, PLAIN)


def skinny_linear_grouped(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                          group_size: int, *, bits: int = 4, shape: tuple[int, int] | None = None,
                          dequant: str = "hqq", config: dict | None = None) -> torch.Tensor:
    """y = x @ w.T for a weight w [N, K] of `bits` (8, 4, 3, 2 or 1) bits per weight in HQQ's layout
    (axis=1; the "8bit_u8", "4bit_u8", "3bit_32", "2bit_u8", "1bit_u8" packings): `packed` [N * bits / 8,
    K] uint8 holds 8 / bits parts of w's rows, the first N * bits / 8 rows in its highest bits (at 4
    bits: row n < N / 2 in the high nibbles of row n, row n + N / 2 in the low ones); at 3 bits, int32
    words [ceil(N * K / group_size / 10), group_size] hold ten parts of w's groups (HQQ's order), and
    `shape` must give (N, K), which that packing does not tell; `scale` and `zero` hold one
    value per `group_size` weights along K, in x's dtype, weight n's groups at n * K / group_size on
    (N * K / group_size values in all). Each tile is rebuilt in x's dtype as HQQ's dequantize rounds
    ((q - zero) rounded, times scale, rounded), then multiplied as skinny_linear does (fp32
    accumulation, output in x's dtype). group_size: a power of two from 16 to 256 dividing K; a
    config's BLOCK_K must be a multiple of it (the default is). `dequant` other than "hqq" reads
    optimum-quanto's 4- or 2-bit weights (skinny_gemm_forms.GROUPED_DEQUANTS): the parts of the rows
    in a byte from its lowest bits up (row n < N / 2 in the low nibbles at 4 bits), each weight
    rebuilt by that rule. Raises ValueError for what it does not take."""
    scale, zero, dims = check_grouped(x, packed, scale, zero, group_size, bits, shape, dequant)
    return _launch(x, packed, None, config, WeightForm(grouped_word(bits), group_size, bits=bits, dequant=dequant),
                   scale, zero, dims)


def skinny_linear_codebook_4bit(x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor,
                                blocksize: int, bias: torch.Tensor | None = None, *,
                                round_dtype: torch.dtype | None = None, config: dict | None = None) -> torch.Tensor:
    """y = x @ w.T (+ bias) for a 4-bit weight w [N, K] in bitsandbytes' layout (nf4 or fp4): `packed`
    [N, K / 2] uint8 holds weight (n, 2j) in the high nibble of byte (n, j) and (n, 2j + 1) in its low
    one; `code` the 16 values a nibble stands for and `absmax` one scale per `blocksize` weights along
    K (N * K / blocksize values, weight n's blocks at n * K / blocksize on), both float32. Each weight
    is rebuilt as bitsandbytes' dequantize rounds it: code[q] * absmax in fp32, rounded to
    `round_dtype` (the dtype the model was quantized from; None: x's), then to x's dtype. bias, in x's
    dtype, is added to the fp32 product before it is rounded (as F.linear adds it). blocksize: a power
    of two from 16 to 256 dividing K; a config's BLOCK_K must be a multiple of it.
    Raises ValueError for what it does not take."""
    absmax, code = check_codebook_4bit(x, packed, absmax, code, blocksize)
    if bias is not None and bias.dtype != x.dtype:
        raise ValueError(f"skinny_linear_codebook_4bit takes a bias in x's dtype ({x.dtype}), got {bias.dtype}")
    form = WeightForm(torch.uint8, blocksize, codebook=True,
                      round_dtype=None if round_dtype == x.dtype else round_dtype)
    return _launch(x, packed, bias, config, form, absmax, code)


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: dict | None,
            form: WeightForm, scale: torch.Tensor | None = None, zero: torch.Tensor | None = None,
            dims: tuple[int, int] | None = None) -> torch.Tensor:
    """skinny_linear (or a packed form's) once its form's arguments are checked: the shapes' checks
    and the launch. `dims`: the product's (N, K) where the weight's packing does not tell them."""
    N, K = dims or _dims(weight, form)
    if x.dtype not in _DTYPES:
        raise ValueError(f"skinny_linear takes x in one of {_DTYPES}, got {x.dtype}")
    if weight.device != x.device or (bias is not None and bias.device != x.device):
        raise ValueError("skinny_linear: x, weight and bias must be on one device")
    if not runs_on(x.device):
        raise ValueError(f"skinny_linear runs on CUDA (or in Triton's interpreter), not on {x.device}")
    if not weight.is_contiguous():
        raise ValueError("skinny_linear needs a contiguous weight [N, K] (nn.Linear's layout)")
    if bias is not None and tuple(bias.shape) != (N,):
        raise ValueError(f"skinny_linear: bias has shape {tuple(bias.shape)}, expected ({N},)")
    if K == 0 or N == 0:
        raise ValueError(f"skinny_linear needs K and N > 0, got weight {tuple(weight.shape)}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    if M > MAX_M:
        raise ValueError(f"skinny_linear takes at most {MAX_M} rows, got {M} (use F.linear)")
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return out.reshape(*lead, N)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if bias is not None:
        bias = bias.contiguous()
    cfg, k_per_split, gemm, reduce = _plan(M, N, K, x.dtype, bias is not None, form, num_sms(x.device), config)
    split = gemm["SPLIT_K"]
    target = out if split == 1 else torch.empty(split, M, N, dtype=torch.float32, device=x.device)
    _skinny_gemm_kernel[(triton.cdiv(N, gemm["BLOCK_N"]), split)](
        # One row's stride is never read: K keeps it from specialising a variant of its own (a stride of 1).
        x2, weight, bias if bias is not None else weight, target, scale if scale is not None else x2,
        zero if zero is not None else x2, M, N, K, k_per_split, x2.stride(0) if M > 1 else K,
        **gemm, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    if reduce is not None:
        total = M * N
        _splitk_reduce_kernel[(triton.cdiv(total, REDUCE_BLOCK),)](
            target, bias if bias is not None else target, out, scale if form.scaled else target, total, N,
            **reduce, num_warps=4,
        )
    return out.reshape(*lead, N)


def _dims(weight: torch.Tensor, form: WeightForm) -> tuple[int, int]:
    """The product's (N, K) of a weight as `form` stores it (the packed forms hold several weights a
    byte: HQQ's along N, 8 / bits of them; bitsandbytes' two along K)."""
    if form.codebook:
        return weight.shape[0], 2 * weight.shape[1]
    return weight.shape[0] * (8 // form.bits if form.group else 1), weight.shape[1]


def _config(M: int, N: int, K: int, dtype: torch.dtype, weight_dtype: torch.dtype, sms: int | None,
            config: dict | None, group: int) -> dict:
    """default_config's launch parameters under `config`'s overrides; the grouped and codebook forms' BLOCK_K
    is a multiple of its group (by default the group itself where the default is less). Unless
    `config` sets num_stages, the stages are cut to what fits MAX_SHARED_MEMORY with x's tile in
    x's `dtype` (default_config counts both tiles in the weight's): a group of 128 doubles BLOCK_K,
    and at 256 rows four stages of a bf16 x tile asked 296 KB of an H200's 227 KB."""
    base = default_config(M, N, K, weight_dtype, sms)
    if group:
        base["BLOCK_K"] = max(base["BLOCK_K"], group)
    cfg = _check_config({**base, **(config or {})})
    if group and cfg["BLOCK_K"] % group:
        raise ValueError(f"skinny GEMM packed forms: BLOCK_K ({cfg['BLOCK_K']}) must be a multiple of the group "
                         f"(block) size ({group})")
    if "num_stages" not in (config or {}):
        weight_bytes = 0.5 if group and weight_dtype == torch.uint8 else weight_dtype.itemsize  # (3 bits: words)
        stage = block_m(M) * cfg["BLOCK_K"] * dtype.itemsize + cfg["BLOCK_N"] * cfg["BLOCK_K"] * weight_bytes
        while cfg["num_stages"] > 1 and cfg["num_stages"] * stage > MAX_SHARED_MEMORY:
            cfg["num_stages"] -= 1
    return cfg


def _plan(M: int, N: int, K: int, dtype: torch.dtype, has_bias: bool, form: WeightForm, sms: int | None,
          config: dict | None) -> tuple[dict, int, dict, dict | None]:
    """(config, k_per_split, the GEMM's constexprs, the split-K reduction's or None) of a product of
    M rows in `dtype` with a weight in `form`: one derivation for a launch and for variants(), so the
    variants listed to compile ahead are the ones launched."""
    cfg = _config(M, N, K, dtype, form.dtype or dtype, sms, config, form.group)
    bn, bk, split = cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["SPLIT_K"]
    k_per_split = triton.cdiv(triton.cdiv(K, split), bk) * bk  # K / split, rounded up to whole K blocks
    gemm = dict(BLOCK_M=block_m(M), BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, EVEN_K=split * k_per_split == K,
                EVEN_N=N % bn == 0, HAS_BIAS=has_bias and split == 1, SWAP_AB=bool(cfg["SWAP_AB"]),
                IEEE=dtype == torch.float32, SCALED=form.scaled and split == 1, GROUP=form.group,
                PRESCALED=form.prescaled, CODEBOOK=form.rounding(dtype), BITS=form.bits, DEQUANT=form.dequant_code)
    reduce = dict(SPLIT_K=split, BLOCK=REDUCE_BLOCK, HAS_BIAS=has_bias, SCALED=form.scaled) if split > 1 else None
    return cfg, k_per_split, gemm, reduce


def variants(N: int, K: int, dtype: torch.dtype, has_bias: bool, bucket: int, config: dict,
             form: WeightForm = PLAIN) -> list[Variant]:
    """The kernels' compiled variants of a [M, K] x [N, K].T product in `dtype` with a weight in
    `form`, run with `config` at the rows bucket `bucket` (every M of it launches these: M itself is
    not specialised). Quantized forms take no bias but the codebook form."""
    cfg, k_per_split, gemm, reduce = _plan(bucket, N, K, dtype, has_bias, form, None, config)
    weight_dtype = form.dtype or dtype
    target = dtype if reduce is None else torch.float32
    scale_dtype = torch.float32 if form.codebook else form.scale_dtype or dtype  # (the codebook's absmax, code)
    found = [Variant(_skinny_gemm_kernel, (dtype, weight_dtype, dtype if has_bias else weight_dtype, target,
                                           scale_dtype, torch.float32 if form.codebook else dtype, 2, N, K,
                                           k_per_split, K),
                     gemm, dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]))]
    if reduce is not None:
        found.append(Variant(_splitk_reduce_kernel, (torch.float32, torch.float32 if not has_bias else dtype, dtype,
                                                     dtype if form.scaled else torch.float32, 2, N),
                             reduce, dict(num_warps=4)))
    return found
