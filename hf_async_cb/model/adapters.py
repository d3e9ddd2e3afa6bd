"""Attention modules that bypass transformers' attention interface, routed through it for a call.

Most modeling code looks its attention function up in `ALL_ATTENTION_FUNCTIONS`, which is how the
paged attention gets in. A few families still hard-code SDPA or eager attention inside their
attention module (Falcon up to transformers 5.24, and the ALiBi families Bloom and MPT, which add
their position biases as a dense tensor). For those, this module holds a forward that does the same projections, rotary
and cache update and then calls the registered attention (with the ALiBi slopes, which the paged
attention applies per key position): `attach()` puts it on each such module as an instance
attribute for an engine call, `detach()` removes it, so that between calls the module is stock.
The parity check (engine/parity.py) compares the result with the stock forward.
"""

from __future__ import annotations

import inspect
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
    attend = ALL_ATTENTION_FUNCTIONS[self.hf_async_cb_attention_name()]
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


def _bloom_attention_forward(self, hidden_states, residual, alibi, attention_mask, layer_past=None, use_cache=False,
                             output_attentions=False, **kwargs):
    """BloomAttention.forward with its ALiBi attention through the registered attention function:
    scores q.k / sqrt(head_dim) + slope x key position, as stock's alibi.baddbmm (up to a per-row
    constant, which the softmax cancels)."""
    from transformers.models.bloom.modeling_bloom import dropout_add

    batch, length, _ = hidden_states.shape
    query, key, value = self._reshape(self.query_key_value(hidden_states))
    key, value = layer_past.update(key, value, self.layer_idx)
    attend = ALL_ATTENTION_FUNCTIONS[self.hf_async_cb_attention_name()]
    out, _ = attend(self, query, key, value, None, scaling=self.inv_norm_factor,
                    alibi_slopes=self.hf_async_cb_alibi_slopes, **kwargs)
    out = self.dense(out.reshape(batch, length, self.num_heads * self.head_dim))
    return dropout_add(out, residual, self.hidden_dropout, self.training), None


def _mpt_attention_forward(self, hidden_states, position_bias, cache=None, attention_mask=None, past_key_values=None,
                           **kwargs):
    """MptAttention.forward with its ALiBi attention through the registered attention function."""
    cache = cache if cache is not None else past_key_values
    batch, length = hidden_states.shape[:2]
    qkv = self.Wqkv(hidden_states)
    if self.clip_qkv:
        qkv = qkv.clamp(min=-self.clip_qkv, max=self.clip_qkv)
    query, key, value = (x.reshape(batch, length, self.n_heads, self.head_dim).transpose(1, 2) for x in qkv.chunk(3, 2))
    key, value = cache.update(key, value, self.layer_idx)
    attend = ALL_ATTENTION_FUNCTIONS[self.hf_async_cb_attention_name()]
    options = {} if position_bias is None else {"alibi_slopes": self.hf_async_cb_alibi_slopes}
    out, _ = attend(self, query, key, value, None, scaling=self.softmax_scale, **options, **kwargs)
    return self.out_proj(out.reshape(batch, length, -1)), None


def _bloom_slopes(model: torch.nn.Module, num_heads: int, device: torch.device) -> torch.Tensor:
    """Bloom's per-head slopes, read off its own ALiBi tensor (bias of key 1 minus key 0)."""
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    bias = build_alibi_tensor(torch.ones(1, 2, device=device), num_heads, torch.float32).view(num_heads, 2)
    return bias[:, 1] - bias[:, 0]


def _mpt_slopes(model: torch.nn.Module, num_heads: int, device: torch.device) -> torch.Tensor:
    """MPT's per-head slopes (their own formula, alibi_bias_max), read off its ALiBi tensor."""
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    bias_max = getattr(getattr(model.config, "attn_config", None), "alibi_bias_max", 8)
    bias = build_mpt_alibi_tensor(num_heads, 2, bias_max, device=device).float().view(num_heads, 2)
    return bias[:, 1] - bias[:, 0]


# Attention classes (by name, so that no modeling module is imported) -> the forward used in calls,
# and for ALiBi families how to get the slopes and the head count.
_FORWARDS = {"FalconAttention": _falcon_attention_forward, "BloomAttention": _bloom_attention_forward,
             "MptAttention": _mpt_attention_forward}
_SLOPES = {"BloomAttention": (_bloom_slopes, "num_heads"), "MptAttention": (_mpt_slopes, "n_heads")}


def _needs_adapter(module: torch.nn.Module) -> bool:
    """Falcon's attention bypasses the attention interface only up to transformers 5.24 (its forward
    took the ALiBi tensor then); since 5.25 it calls the interface with one K/V per KV head itself."""
    if type(module).__name__ == "FalconAttention":
        return "alibi" in inspect.signature(type(module).forward).parameters
    return True


class AttentionAdapters:
    """The model's modules that need an adapted forward (see the module docstring)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.modules = [m for m in model.modules() if type(m).__name__ in _FORWARDS and _needs_adapter(m)]
        self._config = model.config
        self._slopes: dict[str, torch.Tensor] = {}  # per class, made once, on the model's device
        for module in self.modules:
            name = type(module).__name__
            if name in _SLOPES and name not in self._slopes:
                make, heads = _SLOPES[name]
                device = next(module.parameters()).device
                self._slopes[name] = make(model, getattr(module, heads), device)

    def __bool__(self) -> bool:
        return bool(self.modules)

    def attach(self) -> None:
        config = self._config
        for module in self.modules:
            name = type(module).__name__
            module.forward = types.MethodType(_FORWARDS[name], module)
            module.hf_async_cb_attention_name = lambda: config._attn_implementation
            if name in self._slopes:
                module.hf_async_cb_alibi_slopes = self._slopes[name]

    def detach(self) -> None:
        for module in self.modules:
            for attr in ("forward", "hf_async_cb_attention_name", "hf_async_cb_alibi_slopes"):
                module.__dict__.pop(attr, None)
