"""Attention modules that bypass transformers' attention interface, routed through it for a call.

Most modeling code looks its attention function up in `ALL_ATTENTION_FUNCTIONS`, which is how the
paged attention gets in. A few families still hard-code SDPA or eager attention inside their
attention module (Falcon). For those, this module holds a forward that does the same projections,
rotary and cache update and then calls the registered attention: `attach()` puts it on each such
module as an instance attribute for an engine call, `detach()` removes it, so that between calls
the module is stock. The parity check (engine/parity.py) compares the result with the stock forward.
"""

from __future__ import annotations

import math
import types

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS


def _falcon_attention_forward(self, hidden_states, alibi, attention_mask, position_ids=None, layer_past=None,
                              use_cache=False, output_attentions=False, position_embeddings=None, **kwargs):
    """FalconAttention.forward (rotary Falcon: 7B's multi-query, 40B's grouped heads, and the
    original multi-head form) with its attention through the registered attention function (the
    paged attention, in engine calls)."""
    if alibi is not None:
        raise ValueError("Falcon with ALiBi position biases is not supported by hf_async_cb.")
    from transformers.models.falcon.modeling_falcon import apply_rotary_pos_emb

    query, key, value = (x.transpose(1, 2) for x in _falcon_split_heads(self, self.query_key_value(hidden_states)))
    batch, _, length, _ = query.shape
    cos, sin = position_embeddings
    query, key = apply_rotary_pos_emb(query, key, cos, sin)
    key, value = layer_past.update(key, value, self.layer_idx)
    attend = ALL_ATTENTION_FUNCTIONS[self.config._attn_implementation]
    out, _ = attend(self, query, key, value, None, scaling=1.0 / math.sqrt(self.head_dim), **kwargs)
    return self.dense(out.reshape(batch, length, self.num_heads * self.head_dim)), None


def _falcon_split_heads(self, fused: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[batch, tokens, heads, head_dim] queries, keys and values of Falcon's fused projection.

    Unlike FalconAttention._split_heads: slices, not list indexing (which uploads an index tensor
    from the host, so no CUDA graph could capture it), and grouped keys and values stay one per
    KV head (stock broadcasts them to every query head, and caches them that way: 16x the memory
    for Falcon-40B); the attention reads each group's K/V for all its query heads."""
    batch, length, _ = fused.shape
    if self.new_decoder_architecture:  # per KV head: its query heads, then its key, then its value
        qkv = fused.view(batch, length, self.num_kv_heads, self.num_heads // self.num_kv_heads + 2, self.head_dim)
        return qkv[..., :-2, :].flatten(2, 3), qkv[..., -2, :], qkv[..., -1, :]
    if not self.multi_query:
        qkv = fused.view(batch, length, self.num_heads, 3, self.head_dim)
        return qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]
    qkv = fused.view(batch, length, self.num_heads + 2, self.head_dim)
    return qkv[..., :-2, :], qkv[..., -2:-1, :], qkv[..., -1:, :]


# Attention classes (by name, so that no modeling module is imported) -> the forward used in calls.
_FORWARDS = {"FalconAttention": _falcon_attention_forward}


class AttentionAdapters:
    """The model's modules that need an adapted forward (see the module docstring)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.modules = [m for m in model.modules() if type(m).__name__ in _FORWARDS]

    def __bool__(self) -> bool:
        return bool(self.modules)

    def attach(self) -> None:
        for module in self.modules:
            module.forward = types.MethodType(_FORWARDS[type(module).__name__], module)

    def detach(self) -> None:
        for module in self.modules:
            module.__dict__.pop("forward", None)
