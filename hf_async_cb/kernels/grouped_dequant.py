"""A grouped weight (HQQ's packings, optimum-quanto's 4- and 2-bit ones: kernels/skinny_gemm_forms.py)
rebuilt whole in the activations' dtype, in one pass, for steps of more rows than the skinny GEMM takes.

Why: above MAX_M rows (prefill) a grouped projection ran its library's own forward. HQQ's and quanto's
plain forms dequantize there in several passes (quanto's unpacking on the legacy stream); quanto's bf16
int4 runs tinygemm, a kernel made for a few rows, over every prompt token. Here each weight is rebuilt by
the rule the skinny GEMM's decode steps use (the library's own rounding, bit for bit) and cuBLAS
multiplies (model/decode_gemm.py): what HQQ's and quanto's dequantize-then-matmul forwards compute.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_async_cb.kernels.skinny_gemm_forms import WeightForm, _grouped_pointers, _grouped_tile, check_grouped, grouped_word
from hf_async_cb.kernels.variant import Variant

BLOCK_N = 64


def _block_k(group_size: int) -> int:
    return max(128, group_size)


@triton.jit(do_not_specialize=["row0"])
def _dequantize_grouped_kernel(w_ptr, s_ptr, z_ptr, out_ptr, N, K, row0, BLOCK_N: tl.constexpr,
                               BLOCK_K: tl.constexpr, GROUP: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
                               BITS: tl.constexpr, DEQUANT: tl.constexpr):
    """Program (n tile, k tile): the weights of that tile from row `row0` on (a multiple of BLOCK_N),
    rebuilt in out's dtype at out's row (row - row0)."""
    n0 = row0 + tl.program_id(0) * BLOCK_N
    k0 = tl.program_id(1) * BLOCK_K
    rows = n0 + tl.arange(0, BLOCK_N)
    cols = k0 + tl.arange(0, BLOCK_K)
    n_ok = rows < N
    w_ptrs, shift, s_ptrs, z_ptrs = _grouped_pointers(w_ptr, s_ptr, z_ptr, n0, k0, N, K, BLOCK_N, BLOCK_K, GROUP,
                                                      BITS, DEQUANT)
    w = _grouped_tile(w_ptr, w_ptrs, s_ptrs, z_ptrs, shift, n0, n_ok, k0, N, K, out_ptr.dtype.element_ty,
                      BLOCK_N, BLOCK_K, GROUP, EVEN_K, EVEN_N, BITS, DEQUANT)
    out_ptrs = out_ptr + (rows - row0).to(tl.int64)[:, None] * K + cols[None, :]
    if EVEN_K and EVEN_N:
        tl.store(out_ptrs, w)
    else:
        tl.store(out_ptrs, w, mask=n_ok[:, None] & (cols < K)[None, :])


def _constexprs(N: int, K: int, group_size: int, bits: int, dequant: str) -> dict:
    block_k = _block_k(group_size)
    return dict(BLOCK_N=BLOCK_N, BLOCK_K=block_k, GROUP=group_size, EVEN_K=K % block_k == 0, EVEN_N=N % BLOCK_N == 0,
                BITS=bits, DEQUANT=WeightForm(grouped_word(bits), group_size, bits=bits, dequant=dequant).dequant_code)


def dequantize_grouped(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int, *,
                       bits: int, shape: tuple[int, int] | None, dequant: str,
                       rows: tuple[int, int] | None = None) -> torch.Tensor:
    """The weight [N, K] that skinny_linear_grouped(x, packed, scale, zero, ...) multiplies x by, in the
    dtype of `scale` (the activations'), each weight rounded as that kernel rounds it; `rows` (start,
    stop): only those rows (each a multiple of BLOCK_N, or stop N). Raises ValueError for what
    skinny_linear_grouped does not take."""
    probe = torch.empty(0, packed.shape[-1] if bits != 3 else shape[1], dtype=scale.dtype, device=packed.device)
    scale, zero, (N, K) = check_grouped(probe, packed, scale, zero, group_size, bits, shape, dequant)
    start, stop = rows or (0, N)
    if start % BLOCK_N or (stop % BLOCK_N and stop != N) or not 0 <= start < stop <= N:
        raise ValueError(f"dequantize_grouped: rows {rows} are not a range of the {N} rows from a multiple of {BLOCK_N}")
    out = torch.empty(stop - start, K, dtype=scale.dtype, device=packed.device)
    constexprs = _constexprs(N, K, group_size, bits, dequant)
    grid = (triton.cdiv(stop - start, BLOCK_N), triton.cdiv(K, constexprs["BLOCK_K"]))
    _dequantize_grouped_kernel[grid](packed, scale, zero, out, N, K, start, **constexprs, num_warps=4)
    return out


def variants(N: int, K: int, dtype: torch.dtype, form: WeightForm) -> list[Variant]:
    """The compiled variant dequantize_grouped launches for a weight [N, K] in the grouped `form` with
    activations in `dtype`."""
    word = grouped_word(form.bits)
    return [Variant(_dequantize_grouped_kernel, (word, dtype, dtype, dtype, N, K, 0),
                    _constexprs(N, K, form.group, form.bits, form.dequant), dict(num_warps=4))]
