"""Pure-torch attention over the paged KV cache: the CPU path and the oracle for GPU kernels."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .metadata import StepMetadata


def paged_attention_reference(
    query: torch.Tensor,
    key_pool: torch.Tensor,
    value_pool: torch.Tensor,
    meta: StepMetadata,
    scaling: float | None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """query [1, H, T, D] (packed), pools [slots, KVH, D] -> output [1, T, H, D].

    Each request's queries attend to its own context gathered from the pool, causally.
    """
    _, num_heads, total, head_dim = query.shape
    num_kv_heads = key_pool.shape[1]
    n_rep = num_heads // num_kv_heads
    out = query.new_empty((1, total, num_heads, head_dim))
    masks = meta.masks(sliding_window, query.device)
    for i in range(meta.num_requests):
        qs, ql, ctx, ks = meta.query_start[i], meta.query_lens[i], meta.context_lens[i], meta.kv_start[i]
        slots = meta.kv_slots[ks : ks + ctx]
        k = key_pool.index_select(0, slots).transpose(0, 1)  # [KVH, ctx, D]
        v = value_pool.index_select(0, slots).transpose(0, 1)
        if n_rep > 1:
            k = k.repeat_interleave(n_rep, dim=0)
            v = v.repeat_interleave(n_rep, dim=0)
        q = query[0, :, qs : qs + ql]  # [H, ql, D]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=masks[i], scale=scaling)
        out[0, qs : qs + ql] = o.transpose(0, 1)
    return out
