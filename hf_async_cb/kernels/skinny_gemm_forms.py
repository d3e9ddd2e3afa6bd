"""The skinny GEMM's weight forms besides the activations' own dtype: what each reads, how its tiles
are rebuilt in x's dtype, and the checks of its arguments (kernels/skinny_gemm.py launches them).

- scaled int8 (torchao's weight-only int8; `skinny_linear(..., scale=)`): converted exactly tile
  by tile, the scale per output row applied after the product;
- grouped (HQQ's layouts; `skinny_linear_grouped`): 8, 4, 3, 2 or 1 bits a weight, packed as HQQ
  packs them (8 // bits weights a byte, from rows N * bits / 8 apart; at 3 bits ten a 32-bit word),
  rebuilt tile by tile as HQQ's dequantize rounds them, with a scale and a zero per group along K;
  its other `dequant` rules read optimum-quanto's 4- and 2-bit weights (GROUPED_DEQUANTS);
- pre-scaled (optimum-quanto's int8 or float8_e4m3fn; `skinny_linear(..., row_scale=)`): each weight
  times its row's scale, rounded to x's dtype as qbytes_mm rounds `scale * weight`, before the product;
- codebook 4-bit (bitsandbytes' nf4 and fp4; `skinny_linear_codebook_4bit`): two weights per byte
  along K, each a 16-entry table's value times its block's absmax, rounded as bitsandbytes'
  dequantize rounds it.

All read the quantized bytes once, where the libraries' own forwards write and read a converted copy
of the whole weight at every call. A `WeightForm` names one: a launch and the listing of variants to
compile ahead (kernels/model_variants.py) derive the kernel's constexprs from the same record.

The Triton helpers here are globals of the kernel's module (skinny_gemm imports them), so that the
kernel's cache key counts them (kernels/variant.py's settle_cache_keys walks its globals).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

CODEBOOK_ROUNDING = (torch.bfloat16, torch.float16, torch.float32)  # what the codebook form's weights round to
PRESCALED_WEIGHTS = (torch.int8, torch.float8_e4m3fn)  # the pre-scaled form's (quanto's qint8, qfloat8; torchao's float8)
GROUPED_BITS = (8, 4, 3, 2, 1)  # the grouped form's widths: HQQ's "8bit_u8", "4bit_u8", "3bit_32", "2bit_u8", "1bit_u8"
# How the grouped form rebuilds a weight q (an unsigned field) from its group's scale s and zero z, by the
# `dequant` name (the kernel's DEQUANT is its index), and where a byte holds its parts' rows:
#  "hqq"          rnd(rnd(q - z) * s): HQQ's dequantize; the first part of the rows in the highest bits;
#  "scale_shift"  rnd(rnd(q * s) - z): optimum-quanto's WeightQBitsTensor (z its shift); first part lowest;
#  "fma"          rnd(q * s + z), one rounding: quanto's AWQ kernel (z its shift); first part lowest;
#  "fma_centered" rnd((q - 2**(bits-1)) * s + z), one rounding: the tinygemm kernel quanto's bf16 int4
#                 runs (z its zero); first part lowest.
GROUPED_DEQUANTS = ("hqq", "scale_shift", "fma", "fma_centered")


@dataclass(frozen=True)
class WeightForm:
    """How the kernel reads a weight: `dtype` its stored elements (None: the activations' own),
    `group` the grouped form's group size along K, `prescaled` the row scale applied before
    the product (else an int8 weight's scale is applied after it), `bits` the grouped form's bits per
    weight (GROUPED_BITS; 4 for every other form). Hashable: ModelFacts holds it."""

    dtype: torch.dtype | None = None
    group: int = 0
    prescaled: bool = False
    scale_dtype: torch.dtype | None = None  # the pre-scaled form's row scales (None: the activations' dtype)
    codebook: bool = False  # the codebook 4-bit form (group: its absmax block along K)
    round_dtype: torch.dtype | None = None  # the codebook form's rebuilt weights' dtype (None: the activations')
    bits: int = 4  # the grouped form's bits per weight
    dequant: str = "hqq"  # the grouped form's rule (GROUPED_DEQUANTS)

    def __post_init__(self) -> None:
        self.name  # noqa: B018 (raises for a combination no launch makes)

    @property
    def name(self) -> str:
        if self.bits != 4 and not (self.dtype == grouped_word(self.bits) and self.group > 0 and not self.codebook
                                   and self.bits in GROUPED_BITS):
            raise ValueError(f"only the grouped form reads {self.bits}-bit weights (of {GROUPED_BITS}); "
                             f"got {self.bits} bits with {self.dtype}, group {self.group}, codebook={self.codebook}")
        if self.dequant != "hqq" and not (self.dequant in GROUPED_DEQUANTS and self.bits in (4, 2)
                                          and self.dtype == torch.uint8 and self.group > 0 and not self.codebook
                                          and not self.prescaled and self.scale_dtype is None):
            raise ValueError(f"the grouped form's {self.dequant!r} rule (of {GROUPED_DEQUANTS}) reads 4- or 2-bit "
                             f"bytes in groups; got {self.bits} bits with {self.dtype}, group {self.group}")
        if self.codebook or self.round_dtype is not None:
            if (self.codebook and self.dtype == torch.uint8 and self.group > 0 and not self.prescaled
                    and self.scale_dtype is None and self.round_dtype in (None, *CODEBOOK_ROUNDING)):
                return "codebook_4bit"
        elif self.scale_dtype is None or (self.prescaled and self.scale_dtype == torch.float32):  # (torchao's)
            if self.dtype is None and not self.group and not self.prescaled:
                return "plain"
            if self.dtype == torch.int8 and not self.group and not self.prescaled:
                return "scaled_int8"
            if self.dtype == grouped_word(self.bits) and self.group > 0 and not self.prescaled:
                return f"grouped_{self.bits}bit" + ("" if self.dequant == "hqq" else f"_{self.dequant}")
            if self.dtype in PRESCALED_WEIGHTS and not self.group and self.prescaled:
                return "prescaled"
        raise ValueError(f"no skinny GEMM weight form reads {self.dtype} with group {self.group}, "
                         f"prescaled={self.prescaled}, scales in {self.scale_dtype}, codebook={self.codebook} "
                         f"and weights rounded to {self.round_dtype}")

    def rounding(self, dtype: torch.dtype) -> int:
        """The kernel's CODEBOOK constexpr for activations in `dtype`: 0 for the other forms; 1 when the
        codebook form's weights round to `dtype` alone; 2 (bf16) or 3 (fp16) when they round to that
        first (bitsandbytes' dequantize in the model's dtype, the product in a wider compute dtype)."""
        if not self.codebook:
            return 0
        if self.round_dtype is None or self.round_dtype == dtype or self.round_dtype == torch.float32:
            return 1  # (an fp32 product rounded to fp32, then to dtype: one rounding, to dtype)
        return 2 + CODEBOOK_ROUNDING.index(self.round_dtype)

    @property
    def dequant_code(self) -> int:
        """The kernel's DEQUANT constexpr: the grouped form's rule, by its index in GROUPED_DEQUANTS."""
        return GROUPED_DEQUANTS.index(self.dequant)

    @property
    def scaled(self) -> bool:
        """Whether the scale per output row comes after the product (the kernel's SCALED)."""
        return self.name == "scaled_int8"


def grouped_word(bits: int) -> torch.dtype:
    """The dtype HQQ packs `bits`-bit weights in: ten 3-bit fields an int32 ("3bit_32"), else bytes."""
    return torch.int32 if bits == 3 else torch.uint8


def grouped_words(bits: int, n: int, k: int, group_size: int) -> int:
    """How many packed words (grouped_word) HQQ stores for an [n, k] weight: 8 // bits weights a byte,
    or at 3 bits ten groups' fields a word column, the last part padded: ceil(n * k / group / 10)
    rows of `group_size` words."""
    if bits == 3:
        return -(-n * k // group_size // 10) * group_size
    return n * k * bits // 8


PLAIN = WeightForm()
SCALED_INT8 = WeightForm(torch.int8)


def check_scaled_int8(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      scale: torch.Tensor) -> torch.Tensor:
    """The scaled int8 form's scale, flat, once its arguments are checked (ValueError otherwise)."""
    N = weight.shape[0]
    if weight.dtype != torch.int8 or bias is not None or scale.dtype != x.dtype or scale.numel() != N:
        raise ValueError(f"skinny_linear with a scale takes an int8 weight, a scale of {N} values in x's dtype "
                         f"and no bias; got {weight.dtype}, {scale.dtype} ({scale.numel()}), "
                         f"bias {'given' if bias is not None else None}")
    return scale.reshape(-1).contiguous()


def check_prescaled(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    row_scale: torch.Tensor) -> torch.Tensor:
    """The pre-scaled form's row scale, flat, once its arguments are checked (ValueError otherwise)."""
    N = weight.shape[0]
    if (weight.dtype not in PRESCALED_WEIGHTS or bias is not None or row_scale.dtype not in (x.dtype, torch.float32)
            or row_scale.numel() != N or row_scale.device != x.device):
        raise ValueError(f"skinny_linear with a row_scale takes an int8 or float8_e4m3fn weight, a scale of {N} "
                         f"values in x's dtype or float32 on x's device and no bias; got {weight.dtype}, {row_scale.dtype} "
                         f"({row_scale.numel()}), bias {'given' if bias is not None else None}")
    return row_scale.reshape(-1).contiguous()


def check_grouped(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                  group_size: int, bits: int, shape: tuple[int, int] | None = None, dequant: str = "hqq"
                  ) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int]]:
    """The grouped form's scale and zero, flat, and the weight's (N, K), once its arguments are
    checked (ValueError otherwise; skinny_linear_grouped says what it takes)."""
    if bits not in GROUPED_BITS:
        raise ValueError(f"skinny_linear_grouped reads {GROUPED_BITS} bits a weight, got {bits!r}")
    if dequant not in GROUPED_DEQUANTS or (dequant != "hqq" and bits not in (4, 2)):
        raise ValueError(f"skinny_linear_grouped: dequant {dequant!r} is not one of {GROUPED_DEQUANTS} "
                         f"(other than 'hqq': 4 or 2 bits), at {bits} bits")
    if not (isinstance(group_size, int) and 16 <= group_size <= 256 and group_size & (group_size - 1) == 0):
        raise ValueError(f"skinny_linear_grouped takes a group size that is a power of two from 16 to 256, "
                         f"got {group_size!r}")
    if bits == 3:  # ten fields a word, in parts of the flat groups: the packing does not tell N and K
        if shape is None:
            raise ValueError("skinny_linear_grouped at 3 bits needs the weight's shape (N, K)")
        N, K = shape
        words = grouped_words(3, N, K, group_size)
        if packed.dtype != torch.int32 or packed.numel() != words or not packed.is_contiguous():
            raise ValueError(f"skinny_linear_grouped at 3 bits takes HQQ's int32 packing of {words} words for "
                             f"({N}, {K}), got {packed.dtype} {tuple(packed.shape)}")
    else:
        parts = 8 // bits
        if packed.dim() != 2 or packed.dtype != torch.uint8:
            raise ValueError(f"skinny_linear_grouped takes a packed uint8 weight [N / {parts}, K] at {bits} bits, "
                             f"got {packed.dtype} {tuple(packed.shape)}")
        N, K = parts * packed.shape[0], packed.shape[1]
        if shape is not None and tuple(shape) != (N, K):
            raise ValueError(f"skinny_linear_grouped: shape {tuple(shape)} is not the packing's ({N}, {K})")
    if K % group_size:
        raise ValueError(f"skinny_linear_grouped takes a group size dividing K = {K}, got {group_size}")
    groups = N * K // group_size
    for name, t in (("scale", scale), ("zero", zero)):
        if t.dtype != x.dtype or t.numel() != groups or t.device != x.device:
            raise ValueError(f"skinny_linear_grouped: {name} must hold {groups} values in x's dtype ({x.dtype}) "
                             f"on x's device, got {t.numel()} in {t.dtype} on {t.device}")
    return scale.reshape(-1).contiguous(), zero.reshape(-1).contiguous(), (N, K)


@triton.jit
def _grouped_pointers(w_ptr, s_ptr, z_ptr, n0, k0, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      GROUP: tl.constexpr, BITS: tl.constexpr, DEQUANT: tl.constexpr):
    """A program's first grouped tile: (packed byte pointers, each row's shift, the groups' scale and
    zero pointers [BLOCK_N, BLOCK_K / GROUP]). HQQ packs 8 / BITS parts of N * BITS / 8 rows each into
    one byte, the first part in the highest bits: row n is in part p = n // (N * BITS / 8), held in
    packed row n - p * N * BITS / 8 at bit 8 - BITS * (p + 1) (BITS 4: row n < N / 2 in the high
    nibbles of packed row n, the others in the low nibbles of row n - N / 2). quanto's packing
    (DEQUANT > 0) holds the parts the other way round: part p at bit BITS * p."""
    rows = n0 + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    if BITS == 3:  # (its words are found tile by tile: _three_bit_words)
        w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * 0 + offs_k[None, :] * 0
        shift = tl.zeros([BLOCK_N, 1], dtype=tl.int32)
    else:
        part = tl.minimum(rows // (N // (8 // BITS)), 8 // BITS - 1)  # (rows past N: masked, a shift in range)
        w_ptrs = w_ptr + (rows - part * (N // (8 // BITS))).to(tl.int64)[:, None] * K + (k0 + offs_k)[None, :]
        if DEQUANT == 0:
            shift = (8 - BITS * (part + 1)).to(tl.uint8)[:, None]
        else:
            shift = (BITS * part).to(tl.uint8)[:, None]
    offs_g = tl.arange(0, BLOCK_K // GROUP)
    g_offs = rows.to(tl.int64)[:, None] * (K // GROUP) + (k0 // GROUP + offs_g)[None, :]  # weight n's groups
    return w_ptrs, shift, s_ptr + g_offs, z_ptr + g_offs


@triton.jit
def _three_bit_words(w_ptr, n0, k_at, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr):
    """(word pointers, shifts) [BLOCK_N, BLOCK_K] of the 3-bit tile at rows n0.. and K offset `k_at` in
    HQQ's "3bit_32": the [N * K / GROUP, GROUP] groups of the weight cut in ten parts of
    step = ceil(N * K / GROUP / 10) groups, part p in bits 27 - 3p of the int32 words [step, GROUP],
    group r at word row r - p * step. A part need not start at a row, so the part is found per group."""
    step = (N * (K // GROUP) + 9) // 10
    rows = (n0 + tl.arange(0, BLOCK_N)).to(tl.int64)
    groups = rows[:, None] * (K // GROUP) + (k_at // GROUP + tl.arange(0, BLOCK_K // GROUP))[None, :]
    part = tl.minimum(groups // step, 9)  # (groups past the weight: masked, a shift in range)
    words = (groups - part * step)[:, :, None] * GROUP + tl.arange(0, GROUP)[None, None, :]
    shift = tl.broadcast_to((27 - 3 * part).to(tl.int32)[:, :, None], (BLOCK_N, BLOCK_K // GROUP, GROUP))
    return w_ptr + tl.reshape(words, (BLOCK_N, BLOCK_K)), tl.reshape(shift, (BLOCK_N, BLOCK_K))


@triton.jit
def _grouped_tile(w_ptr, w_ptrs, s_ptrs, z_ptrs, shift, n0, n_ok, k_at, N, K, dtype: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr, EVEN_K: tl.constexpr,
                  EVEN_N: tl.constexpr, BITS: tl.constexpr, DEQUANT: tl.constexpr):
    """The grouped tile at K offset `k_at` in `dtype`: its packed bytes (3 bits: words), zeros and
    scales loaded (masked past N, and past K unless EVEN_K), rebuilt by _dequantize_grouped."""
    if BITS == 3:
        w_ptrs, shift = _three_bit_words(w_ptr, n0, k_at, N, K, BLOCK_N, BLOCK_K, GROUP)
    if EVEN_K:
        if EVEN_N:
            packed = tl.load(w_ptrs)
            zero = tl.load(z_ptrs)
            scale = tl.load(s_ptrs)
        else:
            packed = tl.load(w_ptrs, mask=n_ok[:, None], other=0)
            zero = tl.load(z_ptrs, mask=n_ok[:, None], other=0.0)
            scale = tl.load(s_ptrs, mask=n_ok[:, None], other=0.0)
    else:
        k_ok = (k_at + tl.arange(0, BLOCK_K)) < K
        g_ok = n_ok[:, None] & ((k_at + tl.arange(0, BLOCK_K // GROUP) * GROUP) < K)[None, :]
        packed = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0)
        zero = tl.load(z_ptrs, mask=g_ok, other=0.0)
        scale = tl.load(s_ptrs, mask=g_ok, other=0.0)
    return _dequantize_grouped(packed, shift, zero, scale, dtype, BLOCK_N, BLOCK_K, GROUP, BITS, DEQUANT)


@triton.jit
def _dequantize_grouped(packed, shift, zero, scale, dtype: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, GROUP: tl.constexpr, BITS: tl.constexpr, DEQUANT: tl.constexpr):
    """A [BLOCK_N, BLOCK_K] weight tile in `dtype` from its packed bytes or words (the BITS at `shift`)
    and its groups' zero and scale ([BLOCK_N, BLOCK_K / GROUP]), rounded by the DEQUANT rule
    (GROUPED_DEQUANTS): HQQ's (q - zero) rounded to dtype, times scale, rounded to dtype (q, 0..255, is
    exact in any of them); quanto's q * scale rounded, minus zero, rounded; or q * scale + zero (q
    centred first for tinygemm's) in fp32, rounded once (the product of a 16-bit scale and a small
    integer is exact in fp32, so fp32's rounding of the sum is the only one before dtype's)."""
    q = ((packed >> shift) & ((1 << BITS) - 1)).to(tl.float32)
    q = tl.reshape(q, (BLOCK_N, BLOCK_K // GROUP, GROUP))
    s = scale.to(tl.float32)[:, :, None]
    z = zero.to(tl.float32)[:, :, None]
    if DEQUANT == 0:
        w = (q - z).to(dtype).to(tl.float32) * s
    elif DEQUANT == 1:
        p = q * s
        if dtype == tl.float32:  # (a select between the two keeps them apart: fused, they round once, not twice)
            p = tl.where(p == p, p, s)
        w = p.to(dtype).to(tl.float32) - z
    elif DEQUANT == 2:
        w = q * s + z
    else:
        w = (q - (1 << (BITS - 1))) * s + z
    return tl.reshape(w.to(dtype), (BLOCK_N, BLOCK_K))


@triton.jit
def _prescaled_tile(w, row_scale, dtype: tl.constexpr):
    """A pre-scaled 8-bit tile in `dtype`: rnd(scale * q) per weight, as quanto rounds it (the
    product of the two is exact in fp32 for 16-bit x); row_scale: [BLOCK_N, 1] in fp32."""
    return (w.to(tl.float32) * row_scale).to(dtype)


def check_codebook_4bit(x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor,
                        blocksize: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The codebook 4-bit form's absmax and code, flat, once its arguments are checked (ValueError
    otherwise; skinny_linear_codebook_4bit says what it takes)."""
    if packed.dim() != 2 or packed.dtype != torch.uint8:
        raise ValueError(f"skinny_linear_codebook_4bit takes a packed uint8 weight [N, K / 2], got {packed.dtype} "
                         f"{tuple(packed.shape)}")
    N, K = packed.shape[0], 2 * packed.shape[1]
    if not (isinstance(blocksize, int) and 16 <= blocksize <= 256 and blocksize & (blocksize - 1) == 0
            and K % blocksize == 0):
        raise ValueError(f"skinny_linear_codebook_4bit takes a block size that is a power of two from 16 to 256 "
                         f"dividing K = {K}, got {blocksize!r}")
    if absmax.dtype != torch.float32 or absmax.numel() != N * K // blocksize or absmax.device != x.device:
        raise ValueError(f"skinny_linear_codebook_4bit: absmax must hold {N * K // blocksize} float32 values on x's "
                         f"device, got {absmax.numel()} in {absmax.dtype} on {absmax.device}")
    if code.dtype != torch.float32 or code.numel() != 16 or code.device != x.device:
        raise ValueError(f"skinny_linear_codebook_4bit: code must hold 16 float32 values on x's device, got "
                         f"{code.numel()} in {code.dtype} on {code.device}")
    return absmax.reshape(-1).contiguous(), code.reshape(-1).contiguous()


@triton.jit
def _codebook_4bit_pointers(w_ptr, s_ptr, n0, k0, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            GROUP: tl.constexpr):
    """A program's first codebook 4-bit tile: (packed byte pointers [BLOCK_N, BLOCK_K / 2], absmax
    pointers [BLOCK_N, BLOCK_K / GROUP]). Byte j of row n holds weight (n, 2j) in its high nibble and
    (n, 2j + 1) in its low one (bitsandbytes' order over the flat weight)."""
    rows = (n0 + tl.arange(0, BLOCK_N)).to(tl.int64)
    w_ptrs = w_ptr + rows[:, None] * (K // 2) + (k0 // 2 + tl.arange(0, BLOCK_K // 2))[None, :]
    g_offs = rows[:, None] * (K // GROUP) + (k0 // GROUP + tl.arange(0, BLOCK_K // GROUP))[None, :]
    return w_ptrs, s_ptr + g_offs


@triton.jit
def _codebook_4bit_tile(w_ptrs, s_ptrs, code_ptr, n_ok, k_at, K, dtype: tl.constexpr, CODEBOOK: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr, EVEN_K: tl.constexpr,
                        EVEN_N: tl.constexpr):
    """The [BLOCK_N, BLOCK_K] weight tile at K offset `k_at` in `dtype`, each weight code[q] * absmax
    in fp32, rounded as bitsandbytes' dequantize rounds it (CODEBOOK 2 / 3: to bf16 / fp16 first),
    masked past N and K. The high and low nibbles' values are interleaved back into K's order
    (tl.join), so that the product is one dot with x's contiguous columns: two half-K dots with x's
    even and odd columns (strided loads) took 3-4x as long on the H200 at 32 rows
    (benchmarks/codebook_gemm_probe.py)."""
    if EVEN_K:
        if EVEN_N:
            packed = tl.load(w_ptrs)
            absmax = tl.load(s_ptrs)
        else:
            packed = tl.load(w_ptrs, mask=n_ok[:, None], other=0)
            absmax = tl.load(s_ptrs, mask=n_ok[:, None], other=0.0)
    else:
        k_ok = (k_at + 2 * tl.arange(0, BLOCK_K // 2)) < K
        g_ok = n_ok[:, None] & ((k_at + tl.arange(0, BLOCK_K // GROUP) * GROUP) < K)[None, :]
        packed = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0)
        absmax = tl.load(s_ptrs, mask=g_ok, other=0.0)
    # The 16 values held in registers, gathered (a load from global memory per weight took twice as
    # long on the H200).
    table = tl.broadcast_to(tl.load(code_ptr + tl.arange(0, 16))[None, :], (BLOCK_N, 16))
    high = tl.gather(table, (packed >> 4).to(tl.int32), 1)
    low = tl.gather(table, (packed & 0xF).to(tl.int32), 1)
    value = tl.reshape(tl.join(high, low), (BLOCK_N, BLOCK_K // GROUP, GROUP))
    w = value * absmax[:, :, None]
    if CODEBOOK == 2:
        w = w.to(tl.bfloat16)
    elif CODEBOOK == 3:
        w = w.to(tl.float16)
    return tl.reshape(w.to(dtype), (BLOCK_N, BLOCK_K))
