"""Triton attention over the paged KV cache: one kernel for decode and chunked prefill.

Each program takes one block of a request's query tokens and one KV head, with every query head
of that KV head's group (GQA) stacked into the rows of one tile, so a K/V tile read from the pages
serves the whole group. It walks the request's context through its block table, page by page,
with an online softmax (flash attention); causality and sliding windows come from the positions,
not from a mask tensor. Decode steps with few programs for the GPU's size split the context
across programs and merge the partial results in a second small kernel.

Programs are laid out as (query blocks of all requests, KV heads, splits): request i owns the
blocks from query_start[i] // BLOCK_Q + i on, found by binary search, so the grid depends only on
the step's token and request counts (fixed inside a CUDA graph).

Without CUDA the kernels run only in Triton's interpreter (TRITON_INTERPRET=1 set before triton is
first imported, as the tests do): slow, but the same code, so CI checks the kernels' logic.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from hf_async_cb.devices import num_sms
from hf_async_cb.model.step_metadata import StepMetadata

NEG_INF_INIT = tl.constexpr(-1.0e30)  # finite start for the running max: exp(init - init) = 1, never NaN


@triton.jit(do_not_specialize=["num_seqs", "stride_os", "stride_ms", "stride_bt"],
            do_not_specialize_on_alignment=["block_table_ptr", "query_start_ptr", "context_lens_ptr"])
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, m_ptr, l_ptr,
    block_table_ptr, query_start_ptr, context_lens_ptr,
    scale_log2, window, num_seqs,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_os, stride_ot, stride_oh, stride_ms, stride_mt, stride_bt,
    PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    HAS_WINDOW: tl.constexpr, IEEE: tl.constexpr,
):
    qb = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    # The request whose query blocks include qb: the last i with query_start[i] // BLOCK_Q + i <= qb.
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_block = tl.load(query_start_ptr + mid) // BLOCK_Q + mid
        go_right = first_block <= qb
        lo = tl.where(go_right, mid + 1, lo)
        hi = tl.where(go_right, hi, mid)
    seq = lo - 1
    q_begin = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_begin
    local = qb - (q_begin // BLOCK_Q + seq)
    if local * BLOCK_Q < q_len:
        ctx = tl.load(context_lens_ptr + seq)

        offs_m = tl.arange(0, BLOCK_M)
        tok = local * BLOCK_Q + offs_m // GROUP
        head = kv_head * GROUP + offs_m % GROUP
        row_ok = (offs_m < BLOCK_Q * GROUP) & (tok < q_len)
        pos = ctx - q_len + tok
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < HEAD_DIM
        q = tl.load(q_ptr + (q_begin + tok)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)

        # Keys this block can see: up to its last query's position, from its first query's window start.
        first_pos = ctx - q_len + local * BLOCK_Q
        kv_hi = ctx - q_len + tl.minimum(local * BLOCK_Q + BLOCK_Q, q_len)
        kv_lo = 0
        if HAS_WINDOW:
            kv_lo = tl.maximum(first_pos - window + 1, 0)
        num_blocks = (kv_hi - kv_lo + BLOCK_N - 1) // BLOCK_N
        per_split = (num_blocks + NUM_SPLITS - 1) // NUM_SPLITS
        blk_lo = split * per_split
        blk_hi = tl.minimum(blk_lo + per_split, num_blocks)

        m_i = tl.full([BLOCK_M], NEG_INF_INIT, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        for blk in range(blk_lo, blk_hi):
            offs_n = kv_lo + blk * BLOCK_N + tl.arange(0, BLOCK_N)
            n_ok = offs_n < kv_hi
            page = tl.load(block_table_ptr + seq * stride_bt + offs_n // PAGE, mask=n_ok, other=0)
            slot = page * PAGE + offs_n % PAGE
            kv_mask = n_ok[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + slot[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = s * scale_log2
            allowed = (offs_n[None, :] <= pos[:, None]) & n_ok[None, :]
            if HAS_WINDOW:
                allowed = allowed & ((pos[:, None] - offs_n[None, :]) < window)
            s = tl.where(allowed, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + slot[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new

        rows = q_begin + tok
        out_mask = row_ok[:, None] & d_ok[None, :]
        if NUM_SPLITS == 1:
            out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            tl.store(o_ptr + rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                     out.to(o_ptr.dtype.element_ty), mask=out_mask)
        else:  # unnormalised partials, merged by _merge_splits_kernel
            tl.store(o_ptr + split * stride_os + rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                     acc, mask=out_mask)
            ml = split * stride_ms + rows * stride_mt + head
            tl.store(m_ptr + ml, m_i, mask=row_ok)
            tl.store(l_ptr + ml, l_i, mask=row_ok)


@triton.jit
def _merge_splits_kernel(
    part_ptr, m_ptr, l_ptr, o_ptr,
    stride_ps, stride_pt, stride_ph, stride_ms, stride_mt, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    splits = tl.arange(0, NUM_SPLITS)
    m = tl.load(m_ptr + splits * stride_ms + t * stride_mt + h)
    l = tl.load(l_ptr + splits * stride_ms + t * stride_mt + h)
    w = tl.exp2(m - tl.max(m, 0))
    part = tl.load(part_ptr + splits[:, None] * stride_ps + t * stride_pt + h * stride_ph + offs_d[None, :],
                   mask=d_ok[None, :], other=0.0)
    out = tl.sum(part * w[:, None], 0) / tl.sum(l * w, 0)
    tl.store(o_ptr + t * stride_ot + h * stride_oh + offs_d, out.to(o_ptr.dtype.element_ty), mask=d_ok)


def runs_on(device: torch.device) -> bool:
    """Whether the kernels can run for tensors on `device` (the CPU only under the interpreter)."""
    return device.type == "cuda" or bool(triton.knobs.runtime.interpret)


def _launch_defaults(head_dim: int, dtype: torch.dtype) -> dict:
    """Key block and launch shape, from a sweep of decode steps on the H200 (benchmarks/tune_kernels.py,
    docs/benchmarks.md): 16-bit K/V tiles of 64 x 64 with 2 warps, of 128 x 128 with 4, both two
    stages deep. fp32 (the tests' exact path) keeps 64-key blocks, whose tiles fit shared memory."""
    if dtype.itemsize == 2 and head_dim <= 64:
        return dict(block_n=64, num_warps=2, num_stages=2)
    if dtype.itemsize == 2 and head_dim <= 128:
        return dict(block_n=128, num_warps=4, num_stages=2)
    return dict(block_n=64 if head_dim <= 128 else 32)


def choose_splits(meta: StepMetadata, num_kv_heads: int, device: torch.device) -> int:
    """Split decode contexts when the step has too few (request, KV head) programs to give every
    SM one, and the contexts are long enough to share (at least 256 keys per split). At 32
    requests x 8 KV heads on the H200's 132 SMs, splitting already loses (the merge costs more)."""
    if not meta.is_decode:
        return 1
    programs = meta.num_requests * num_kv_heads
    wanted = -(-(num_sms(device) or 1) // programs)
    splits = min(wanted, max(1, meta.max_context // 256), 16)
    return 1 << (splits.bit_length() - 1) if splits > 1 else 1


def paged_attention_triton(
    query: torch.Tensor,
    key_pool: torch.Tensor,
    value_pool: torch.Tensor,
    meta: StepMetadata,
    scaling: float | None,
    sliding_window: int | None = None,
    num_splits: int | None = None,
    tuning: dict | None = None,
) -> torch.Tensor:
    """query [1, H, T, D] (packed), pools [slots, KVH, D] -> output [1, T, H, D]; same contract as
    paged_attention_reference. `num_splits` overrides the split heuristic (tests); `tuning` the
    launch parameters (block_n, num_warps, num_stages: benchmarks/tune_kernels.py)."""
    _, num_heads, total, head_dim = query.shape
    num_kv_heads = key_pool.shape[1]
    group = num_heads // num_kv_heads
    q = query[0].transpose(0, 1)  # [T, H, D]
    if q.stride(-1) != 1:
        q = q.contiguous()
    if key_pool.stride(-1) != 1 or value_pool.stride(-1) != 1:
        raise ValueError("the KV pools must be contiguous in the head dimension")
    scale = scaling if scaling is not None else 1.0 / math.sqrt(head_dim)
    block_q = max(1, 16 // group)
    block_m = max(16, triton.next_power_of_2(block_q * group))
    block_d = max(16, triton.next_power_of_2(head_dim))
    tuning = {**_launch_defaults(head_dim, query.dtype), **(tuning or {})}
    block_n = tuning["block_n"]
    launch = {k: tuning[k] for k in ("num_warps", "num_stages") if k in tuning}
    splits = num_splits or choose_splits(meta, num_kv_heads, query.device)
    out = torch.empty(total, num_heads, head_dim, dtype=query.dtype, device=query.device)
    if splits > 1:
        part = torch.empty(splits, total, num_heads, head_dim, dtype=torch.float32, device=query.device)
        m = torch.empty(splits, total, num_heads, dtype=torch.float32, device=query.device)
        l = torch.empty_like(m)
        target, part_strides, ml_strides = part, part.stride(), m.stride()[:2]
    else:
        m = l = out  # unused
        target, part_strides, ml_strides = out, (0, *out.stride()[:2]), (0, 0)
    num_seqs = meta.num_requests
    grid = (total // block_q + num_seqs, num_kv_heads, splits)
    _paged_attention_kernel[grid](
        q, key_pool, value_pool, target, m, l,
        meta.block_table, meta.query_start, meta.context_lens,
        scale * 1.4426950408889634, sliding_window or 0, num_seqs,
        q.stride(0), q.stride(1), key_pool.stride(0), key_pool.stride(1), value_pool.stride(0), value_pool.stride(1),
        *part_strides[:3], *ml_strides, meta.block_table.stride(0),
        PAGE=meta.page_size, HEAD_DIM=head_dim, BLOCK_D=block_d, GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m,
        BLOCK_N=block_n, NUM_SPLITS=splits, HAS_WINDOW=sliding_window is not None,
        IEEE=query.dtype == torch.float32, **launch,
    )
    if splits > 1:
        _merge_splits_kernel[(total, num_heads)](
            part, m, l, out, *part.stride()[:3], *m.stride()[:2], *out.stride()[:2],
            HEAD_DIM=head_dim, BLOCK_D=block_d, NUM_SPLITS=splits,
        )
    return out[None]
