"""Pure-torch attention over the paged KV cache: the CPU path and the oracle for GPU kernels.

The packed step is viewed as a padded batch (requests x their longest query x their longest
context) through index tensors derived once per step (StepMetadata.padded_view); each layer then does one gather of its K/V
and one scaled_dot_product_attention call, whatever the number of requests.

That padding is cheap when the queries have one length (decode steps: always one batched call, with
no host sync, so that CUDA graphs can capture it) but not in a step that mixes decodes with a long
prefill chunk, where every one-token row would be padded to the chunk's length. Steps with several
query lengths are therefore padded per group of requests of alike query and context lengths
(StepMetadata.padded_groups): the work stays within 4x the sum of query length x context length,
in one call per group (a handful per step).

Two variants SDPA cannot express take an explicit path instead (scores, softmax and the value
product in fp32, the K/V heads broadcast over their query-head groups without a copy):

- softcap (Gemma 2): scores s = (q . k) * scaling become softcap * tanh(s / softcap) before the
  causal / sliding-window mask, as transformers' gemma2 eager attention does;
- sinks (gpt-oss): one learned logit per query head joins every row's softmax as a virtual key
  with a zero value, out = sum_j exp(s_j) v_j / (sum_j exp(s_j) + exp(sink_h));
- ALiBi (Bloom, MPT): slope_h x (key position) is added to the scaled scores, which is the
  models' own bias up to a per-row constant (the softmax cancels it).

The pools may be strided views (only the last dimension must be dense in the Triton kernel; here
any layout works, the pools are gathered), and values may have another head size than keys
(Dv != Dk, DeepSeek's expanded MLA).
"""

from __future__ import annotations

import contextlib
import math

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
    *,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """query [1, H, T, Dk] (packed), pools [slots, KVH, Dk] and [slots, KVH, Dv] -> output
    [1, T, H, Dv] in query's dtype. `scaling` None means 1 / sqrt(Dk). `softcap` None or 0.0: no
    capping; `sinks` [H] (any float dtype, used in fp32) or None; `alibi_slopes` [H] or None."""
    num_heads, num_tokens = query.shape[1], query.shape[2]
    softcap = check_softcap(softcap)
    sinks = check_sinks(sinks, num_heads)
    alibi_slopes = check_sinks(alibi_slopes, num_heads, "alibi_slopes")
    check_shapes(query, key_pool, value_pool)
    variants = (scaling, sliding_window, softcap, sinks, alibi_slopes)
    if meta.is_decode:
        return _padded_attention(query, key_pool, value_pool, meta, *variants)
    groups = meta.padded_groups()
    if len(groups) == 1:  # every request alike: the group is the whole step, in order
        return _padded_attention(query, key_pool, value_pool, groups[0][1], *variants)
    out = None
    for tokens, group in groups:
        part = _padded_attention(query[:, :, tokens], key_pool, value_pool, group, *variants)
        if out is None:  # in the parts' dtype: under autocast, SDPA's, not the query's
            out = part.new_empty(1, num_tokens, num_heads, part.shape[-1])
        out[:, tokens] = part
    return out


def _padded_attention(query, key_pool, value_pool, meta, scaling, sliding_window, softcap, sinks, alibi_slopes):
    """The attention of `meta`'s requests (query [1, H, T, Dk] their packed rows) over one padded
    batch of [requests, longest query, longest context] -> [1, T, H, Dv]."""
    _, num_heads, _, head_dim = query.shape
    n_rep = num_heads // key_pool.shape[1]
    head_dim_v = value_pool.shape[-1]
    view = meta.padded_view()
    batch, max_q = view["q_index"].shape
    q = query[0].transpose(0, 1)[view["q_index"]].permute(0, 2, 1, 3)  # [B, H, max_q, Dk]
    k = key_pool[view["kv_index"]].permute(0, 2, 1, 3)  # [B, KVH, max_ctx, Dk]
    v = value_pool[view["kv_index"]].permute(0, 2, 1, 3)  # [B, KVH, max_ctx, Dv]
    mask = meta.mask(sliding_window)  # [B, 1, max_q, max_ctx]
    if softcap is None and sinks is None and alibi_slopes is None:
        if n_rep > 1:
            k = k.repeat_interleave(n_rep, dim=1)
            v = v.repeat_interleave(n_rep, dim=1)
        with _backends(query.device):
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling)
    else:
        scale = scaling if scaling is not None else 1.0 / math.sqrt(head_dim)
        o = _explicit(q, k, v, mask, scale, softcap, sinks, alibi_slopes).to(query.dtype)
    o = o.permute(0, 2, 1, 3).reshape(batch * max_q, num_heads, head_dim_v)[view["out_index"]]
    return o[None]


def _explicit(q, k, v, mask, scale, softcap, sinks, alibi_slopes=None):
    """Attention by matmuls in fp32: q [B, H, M, Dk], k [B, KVH, N, Dk], v [B, KVH, N, Dv],
    mask [B, 1, M, N] -> [B, H, M, Dv]. Query head h reads KV head h // (H // KVH)."""
    batch, num_heads, max_q, _ = q.shape
    num_kv_heads = k.shape[1]
    n_rep = num_heads // num_kv_heads
    qg = q.float().reshape(batch, num_kv_heads, n_rep * max_q, -1)  # a group's heads stacked on rows
    s = torch.matmul(qg, k.float().transpose(-1, -2)).reshape(batch, num_heads, max_q, -1) * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    if alibi_slopes is not None:
        positions = torch.arange(s.shape[-1], device=s.device, dtype=torch.float32)
        s = s + alibi_slopes.float().to(s.device).view(1, num_heads, 1, 1) * positions
    s = s.masked_fill(~mask, float("-inf"))
    if sinks is None:
        p = torch.softmax(s, dim=-1)
    else:  # softmax over [row, sink], the sink's column dropped
        lse = torch.logaddexp(torch.logsumexp(s, dim=-1), sinks.to(s.device).view(1, num_heads, 1))
        p = torch.exp(s - lse[..., None])
    o = torch.matmul(p.reshape(batch, num_kv_heads, n_rep * max_q, -1), v.float())
    return o.reshape(batch, num_heads, max_q, -1)


def check_softcap(softcap: float | None) -> float | None:
    """None or 0.0 -> None (no capping, the usual kernels' convention); a positive finite float
    as is; anything else is a ValueError."""
    if softcap is None or softcap == 0:
        return None
    softcap = float(softcap)
    if not (math.isfinite(softcap) and softcap > 0):
        raise ValueError(f"softcap must be a positive finite float, 0.0 or None, not {softcap}")
    return softcap


def check_sinks(sinks: torch.Tensor | None, num_heads: int, name: str = "sinks") -> torch.Tensor | None:
    """[H] of any floating dtype (or H elements in any shape) -> a flat [H] view, None stays None
    (sinks, and ALiBi slopes alike)."""
    if sinks is None:
        return None
    if not isinstance(sinks, torch.Tensor) or not sinks.is_floating_point() or sinks.numel() != num_heads:
        raise ValueError(f"{name} must be a floating tensor of one logit per query head ({num_heads}), "
                         f"not {getattr(sinks, 'dtype', type(sinks))} of shape {tuple(getattr(sinks, 'shape', ()))}")
    return sinks.reshape(num_heads)


def check_shapes(query: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor) -> None:
    """Host-side shape checks shared by both implementations (no device sync)."""
    if query.dim() != 4 or query.shape[0] != 1 or key_pool.dim() != 3 or value_pool.dim() != 3:
        raise ValueError(f"expected query [1, H, T, Dk] and pools [slots, KVH, D], not {tuple(query.shape)}, "
                         f"{tuple(key_pool.shape)}, {tuple(value_pool.shape)}")
    num_heads, head_dim = query.shape[1], query.shape[3]
    _, num_kv_heads, key_dim = key_pool.shape
    if key_dim != head_dim or value_pool.shape[:2] != key_pool.shape[:2] or num_heads % num_kv_heads:
        raise ValueError(f"query {tuple(query.shape)}, key pool {tuple(key_pool.shape)} and value pool "
                         f"{tuple(value_pool.shape)} do not fit: keys need the query's head size, values the "
                         "keys' slots and KV heads, and the query heads a multiple of the KV heads")


def _backends(device: torch.device):
    """On CUDA, keep SDPA off cuDNN: it builds an execution plan per new shape (~4 ms of CPU per
    layer on the H200 machine), and the padded context length changes every few steps."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    return sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])
