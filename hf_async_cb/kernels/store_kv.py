"""Write a step's new keys and values into their page slots: one Triton kernel per layer.

torch's index_copy_ costs two launches per layer (keys, then values), each a few microseconds of
mostly fixed cost for a few kilobytes of data; a decode step of a 16-layer model spends more time
in them than in its RMSNorms. This kernel writes both in one launch, one program per new token,
reading the model's (possibly transposed) K/V views through their strides. Slots come from
StepMetadata.slot_mapping; padding rows of a CUDA-graph bucket write to the trash slot.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_async_cb.kernels.variant import Variant


@triton.jit
def _store_one(src_ptr, pool_ptr, t, slot, stride_h, stride_t, stride_pool_t, stride_pool_h,
               HEADS: tl.constexpr, DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
               ALIGNED: tl.constexpr):
    heads = tl.arange(0, BLOCK_H)
    at = heads * stride_h + t * stride_t
    if ALIGNED:
        at = tl.multiple_of(at, 16)
    h = heads[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < HEADS) & (d < DIM)
    x = tl.load(src_ptr + at[:, None] + d, mask=mask)
    tl.store(pool_ptr + slot * stride_pool_t + h * stride_pool_h + d, x.to(pool_ptr.dtype.element_ty), mask=mask)


# The model's K/V strides follow its layout (and, for a [1, heads, T, D] tensor, the step's token count):
# not specialised, so every step launches the same variant; ALIGNED (all four multiples of 16, as for
# head sizes that are) lets the loads vectorise as the specialisation did.
@triton.jit(do_not_specialize=["stride_kh", "stride_kt", "stride_vh", "stride_vt"],
            do_not_specialize_on_alignment=["slots_ptr"])
def _store_kv_kernel(k_ptr, v_ptr, k_pool_ptr, v_pool_ptr, slots_ptr,
                     stride_kh, stride_kt, stride_vh, stride_vt,
                     stride_kpool_t, stride_kpool_h, stride_vpool_t, stride_vpool_h,
                     K_HEADS: tl.constexpr, K_DIM: tl.constexpr, V_HEADS: tl.constexpr, V_DIM: tl.constexpr,
                     BLOCK_KH: tl.constexpr, BLOCK_KD: tl.constexpr, BLOCK_VH: tl.constexpr,
                     BLOCK_VD: tl.constexpr, ALIGNED: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    _store_one(k_ptr, k_pool_ptr, t, slot, stride_kh, stride_kt, stride_kpool_t, stride_kpool_h,
               K_HEADS, K_DIM, BLOCK_KH, BLOCK_KD, ALIGNED)
    _store_one(v_ptr, v_pool_ptr, t, slot, stride_vh, stride_vt, stride_vpool_t, stride_vpool_h,
               V_HEADS, V_DIM, BLOCK_VH, BLOCK_VD, ALIGNED)


def store_kv(key_pool: torch.Tensor, value_pool: torch.Tensor, key_states: torch.Tensor,
             value_states: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """key_states [1, key_heads, T, key_dim] -> key_pool [slots, key_heads, key_dim] at slot_mapping [T],
    and the values alike (their heads and dim may differ from the keys')."""
    _, k_heads, total, k_dim = key_states.shape
    _, v_heads, _, v_dim = value_states.shape
    k, v = key_states[0], value_states[0]
    if k.stride(-1) != 1 or v.stride(-1) != 1 or key_pool.stride(-1) != 1 or value_pool.stride(-1) != 1:
        raise ValueError("store_kv needs K/V and pools contiguous in the head dimension")
    if total == 0:
        return
    strides = (k.stride(0), k.stride(1), v.stride(0), v.stride(1))
    _store_kv_kernel[(total,)](
        k, v, key_pool, value_pool, slot_mapping, *strides,
        key_pool.stride(0), key_pool.stride(1), value_pool.stride(0), value_pool.stride(1),
        **_shapes(k_heads, k_dim, v_heads, v_dim), ALIGNED=all(s % 16 == 0 for s in strides),
    )


def _shapes(k_heads: int, k_dim: int, v_heads: int, v_dim: int) -> dict:
    return dict(K_HEADS=k_heads, K_DIM=k_dim, V_HEADS=v_heads, V_DIM=v_dim,
                BLOCK_KH=triton.next_power_of_2(k_heads), BLOCK_KD=triton.next_power_of_2(k_dim),
                BLOCK_VH=triton.next_power_of_2(v_heads), BLOCK_VD=triton.next_power_of_2(v_dim))


def variants(key_pool: torch.Tensor, value_pool: torch.Tensor, k_dtype: torch.dtype, v_dtype: torch.dtype) -> list[Variant]:
    """The kernel's compiled variant for these pools ([slots, heads, dim]) and K/V dtypes: one,
    whatever the tokens (the K/V strides are multiples of the head sizes: aligned when those are)."""
    (_, k_heads, k_dim), (_, v_heads, v_dim) = key_pool.shape, value_pool.shape
    args = (k_dtype, v_dtype, key_pool.dtype, value_pool.dtype, torch.int64, 0, 0, 0, 0,
            key_pool.stride(0), key_pool.stride(1), value_pool.stride(0), value_pool.stride(1))
    return [Variant(_store_kv_kernel, args, dict(_shapes(k_heads, k_dim, v_heads, v_dim),
                                                 ALIGNED=k_dim % 16 == 0 and v_dim % 16 == 0))]
