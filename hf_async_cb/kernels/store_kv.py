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


@triton.jit(do_not_specialize_on_alignment=["slots_ptr"])
def _store_kv_kernel(k_ptr, v_ptr, k_pool_ptr, v_pool_ptr, slots_ptr,
                     stride_kh, stride_kt, stride_vh, stride_vt, stride_pool_t, stride_pool_h,
                     NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < NUM_HEADS) & (d < HEAD_DIM)
    dst = slot * stride_pool_t + h * stride_pool_h + d
    k = tl.load(k_ptr + h * stride_kh + t * stride_kt + d, mask=mask)
    tl.store(k_pool_ptr + dst, k.to(k_pool_ptr.dtype.element_ty), mask=mask)
    v = tl.load(v_ptr + h * stride_vh + t * stride_vt + d, mask=mask)
    tl.store(v_pool_ptr + dst, v.to(v_pool_ptr.dtype.element_ty), mask=mask)


def store_kv(key_pool: torch.Tensor, value_pool: torch.Tensor, key_states: torch.Tensor,
             value_states: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """key/value_states [1, kv_heads, T, head_dim] -> pools [slots, kv_heads, head_dim] at slot_mapping [T]."""
    _, heads, total, head_dim = key_states.shape
    k, v = key_states[0], value_states[0]
    if k.stride(-1) != 1 or v.stride(-1) != 1 or key_pool.stride(-1) != 1 or key_pool.stride() != value_pool.stride():
        raise ValueError("store_kv needs K/V and pools contiguous in the head dimension, both pools alike")
    if total == 0:
        return
    _store_kv_kernel[(total,)](
        k, v, key_pool, value_pool, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), key_pool.stride(0), key_pool.stride(1),
        NUM_HEADS=heads, HEAD_DIM=head_dim, BLOCK_H=triton.next_power_of_2(heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
