"""Pure-torch attention over the paged KV cache: the CPU path and the oracle for GPU kernels.

The packed step is viewed as a padded batch (requests x their longest query x their longest
context) through index tensors derived once per step (StepMetadata.padded_view); each layer then does one gather of its K/V
and one scaled_dot_product_attention call, whatever the number of requests.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from hf_async_cb.model.step_metadata import StepMetadata


def paged_attention_reference(
    query: torch.Tensor,
    key_pool: torch.Tensor,
    value_pool: torch.Tensor,
    meta: StepMetadata,
    scaling: float | None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """query [1, H, T, D] (packed), pools [slots, KVH, D] -> output [1, T, H, D]."""
    _, num_heads, total, head_dim = query.shape
    n_rep = num_heads // key_pool.shape[1]
    view = meta.padded_view()
    batch, max_q = view["q_index"].shape
    q = query[0].transpose(0, 1)[view["q_index"]].permute(0, 2, 1, 3)  # [B, H, max_q, D]
    k = key_pool[view["kv_index"]].permute(0, 2, 1, 3)  # [B, KVH, max_ctx, D]
    v = value_pool[view["kv_index"]].permute(0, 2, 1, 3)
    if n_rep > 1:
        k = k.repeat_interleave(n_rep, dim=1)
        v = v.repeat_interleave(n_rep, dim=1)
    with _backends(query.device):
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=meta.mask(sliding_window), scale=scaling)
    o = o.permute(0, 2, 1, 3).reshape(batch * max_q, num_heads, head_dim)[view["out_index"]]
    return o[None]


def _backends(device: torch.device):
    """On CUDA, keep SDPA off cuDNN: it builds an execution plan per new shape (~4 ms of CPU per
    layer on the H200 machine), and the padded context length changes every few steps."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    return sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])
