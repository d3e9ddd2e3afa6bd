"""The skinny GEMM's weight forms besides the activations' own dtype: what each reads, how its tiles
are rebuilt in x's dtype, and the checks of its arguments (kernels/skinny_gemm.py launches them).

- scaled int8 (torchao's weight-only int8; `skinny_linear(..., scale=)`): converted exactly tile
  by tile, the scale per output row applied after the product;
- grouped 4-bit (HQQ's layout; `skinny_linear_4bit`): the packed nibbles rebuilt tile by tile as
  HQQ's dequantize rounds them, with a scale and a zero per group along K;
- pre-scaled (optimum-quanto's int8 or float8_e4m3fn; `skinny_linear(..., row_scale=)`): each weight
  times its row's scale, rounded to x's dtype as qbytes_mm rounds `scale * weight`, before the product.

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

PRESCALED_WEIGHTS = (torch.int8, torch.float8_e4m3fn)  # the pre-scaled form's (quanto's qint8, qfloat8; torchao's float8)


@dataclass(frozen=True)
class WeightForm:
    """How the kernel reads a weight: `dtype` its stored elements (None: the activations' own),
    `group` the grouped 4-bit form's group size along K, `prescaled` the row scale applied before
    the product (else an int8 weight's scale is applied after it). Hashable: ModelFacts holds it."""

    dtype: torch.dtype | None = None
    group: int = 0
    prescaled: bool = False
    scale_dtype: torch.dtype | None = None  # the pre-scaled form's row scales (None: the activations' dtype)

    def __post_init__(self) -> None:
        self.name  # noqa: B018 (raises for a combination no launch makes)

    @property
    def name(self) -> str:
        if self.scale_dtype is None or (self.prescaled and self.scale_dtype == torch.float32):  # (torchao's)
            if self.dtype is None and not self.group and not self.prescaled:
                return "plain"
            if self.dtype == torch.int8 and not self.group and not self.prescaled:
                return "scaled_int8"
            if self.dtype == torch.uint8 and self.group > 0 and not self.prescaled:
                return "grouped_4bit"
            if self.dtype in PRESCALED_WEIGHTS and not self.group and self.prescaled:
                return "prescaled"
        raise ValueError(f"no skinny GEMM weight form reads {self.dtype} with group {self.group}, "
                         f"prescaled={self.prescaled} and scales in {self.scale_dtype}")

    @property
    def scaled(self) -> bool:
        """Whether the scale per output row comes after the product (the kernel's SCALED)."""
        return self.name == "scaled_int8"


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


def check_grouped_4bit(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                       group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The grouped 4-bit form's scale and zero, flat, once its arguments are checked (ValueError
    otherwise; skinny_linear_4bit says what it takes)."""
    if packed.dim() != 2 or packed.dtype != torch.uint8:
        raise ValueError(f"skinny_linear_4bit takes a packed uint8 weight [N / 2, K], got {packed.dtype} "
                         f"{tuple(packed.shape)}")
    N, K = 2 * packed.shape[0], packed.shape[1]
    if not (isinstance(group_size, int) and 16 <= group_size <= 256 and group_size & (group_size - 1) == 0
            and K % group_size == 0):
        raise ValueError(f"skinny_linear_4bit takes a group size that is a power of two from 16 to 256 dividing "
                         f"K = {K}, got {group_size!r}")
    groups = N * K // group_size
    for name, t in (("scale", scale), ("zero", zero)):
        if t.dtype != x.dtype or t.numel() != groups or t.device != x.device:
            raise ValueError(f"skinny_linear_4bit: {name} must hold {groups} values in x's dtype ({x.dtype}) on "
                             f"x's device, got {t.numel()} in {t.dtype} on {t.device}")
    return scale.reshape(-1).contiguous(), zero.reshape(-1).contiguous()


@triton.jit
def _grouped_4bit_pointers(w_ptr, s_ptr, z_ptr, n0, k0, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           GROUP: tl.constexpr):
    """A program's first grouped 4-bit tile: (packed byte pointers, the nibble's shift per row, the
    groups' scale and zero pointers [BLOCK_N, BLOCK_K / GROUP]). Row n < N / 2 is the high nibbles
    of packed row n, row n >= N / 2 the low nibbles of row n - N / 2."""
    rows = n0 + tl.arange(0, BLOCK_N)
    low = rows >= N // 2
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + tl.where(low, rows - N // 2, rows).to(tl.int64)[:, None] * K + (k0 + offs_k)[None, :]
    shift = tl.where(low, 0, 4).to(tl.uint8)[:, None]
    offs_g = tl.arange(0, BLOCK_K // GROUP)
    g_offs = rows.to(tl.int64)[:, None] * (K // GROUP) + (k0 // GROUP + offs_g)[None, :]  # weight n's groups
    return w_ptrs, shift, s_ptr + g_offs, z_ptr + g_offs


@triton.jit
def _grouped_4bit_tile(w_ptrs, s_ptrs, z_ptrs, shift, n_ok, k_at, K, dtype: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, GROUP: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr):
    """The grouped 4-bit tile at K offset `k_at` in `dtype`: its packed bytes, zeros and scales loaded
    (masked past N, and past K unless EVEN_K), rebuilt by _dequantize_4bit."""
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
    return _dequantize_4bit(packed, shift, zero, scale, dtype, BLOCK_N, BLOCK_K, GROUP)


@triton.jit
def _dequantize_4bit(packed, shift, zero, scale, dtype: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, GROUP: tl.constexpr):
    """A [BLOCK_N, BLOCK_K] weight tile in `dtype` from its packed bytes (the nibble `shift` selects) and
    its groups' zero and scale ([BLOCK_N, BLOCK_K / GROUP]), rounded as HQQ's dequantize rounds:
    (q - zero) rounded to dtype, times scale, rounded to dtype (q, 0..15, is exact in any of them)."""
    q = ((packed >> shift) & 0xF).to(tl.float32)
    d = tl.reshape(q, (BLOCK_N, BLOCK_K // GROUP, GROUP)) - zero.to(tl.float32)[:, :, None]
    w = d.to(dtype).to(tl.float32) * scale.to(tl.float32)[:, :, None]
    return tl.reshape(w.to(dtype), (BLOCK_N, BLOCK_K))


@triton.jit
def _prescaled_tile(w, row_scale, dtype: tl.constexpr):
    """A pre-scaled 8-bit tile in `dtype`: rnd(scale * q) per weight, as quanto rounds it (the
    product of the two is exact in fp32 for 16-bit x); row_scale: [BLOCK_N, 1] in fp32."""
    return (w.to(tl.float32) * row_scale).to(dtype)
