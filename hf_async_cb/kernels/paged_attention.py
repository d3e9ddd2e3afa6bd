"""Triton attention over the paged KV cache: one kernel for decode and chunked prefill.

Each program takes one block of a request's query tokens and one KV head, with every query head
of that KV head's group (GQA) stacked into the rows of one tile, so a K/V tile read from the pages
serves the whole group. It walks the request's context through its block table, page by page,
with an online softmax (flash attention); causality and sliding windows come from the positions,
not from a mask tensor. Tiles are 16 rows, or 64 in steps with a query of 64 tokens or more
(tile_shape), and the key blocks a prefill tile sees whole run through a loop without the mask.
Decode steps with few programs for the GPU's size split the context across programs and merge
the partial results in a second small kernel.

Programs are laid out as (query blocks of all requests, KV heads x group chunks, splits): request
i owns the blocks from query_start[i] // BLOCK_Q + i on, found by binary search, so the grid
depends only on the step's token and request counts (fixed inside a CUDA graph). A decode step
(one query token per request) compiles a variant with one block per request and no search, and
can take the step's new K/V as inputs (`new_kv`): one program per (request, KV head) stores them
in the pools, and every program uses them from registers for the newest key, so that no program
reads a slot another writes; the step then needs no separate store kernel per layer. A group of more
than 128 query heads per KV head (64 when a head size exceeds 128) is split evenly over several
programs (tile_shape); smaller groups, Falcon's 71 heads on one KV head included, take one.

Variants, each a compile-time flag so that a model compiles its own once: values may have their
own head size (Dv != Dk, both any size, padded to powers of two inside); Gemma 2's logit softcap
(softcap * tanh(s / softcap) on the scaled scores, before the mask; the cap itself is a runtime
float); gpt-oss's attention sinks (split 0 starts its online softmax from the sink, a virtual key
with a zero value, which the split merge then weighs like any other partial).

Without CUDA the kernels run only in Triton's interpreter (TRITON_INTERPRET=1 set before triton is
first imported, as the tests do): slow, but the same code, so CI checks the kernels' logic.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import triton
import triton.language as tl

from hf_async_cb.kernels.attention_launch import (
    MAX_SPLITS,
    TALL_TILE_QUERY_LEN,
    choose_splits,
    launch_defaults,
    tile_shape,
)
from hf_async_cb.devices import num_sms
from hf_async_cb.kernels.paged_attention_reference import check_shapes, check_sinks, check_softcap
from hf_async_cb.kernels.variant import Variant
from hf_async_cb.model.step_metadata import StepMetadata

NEG_INF_INIT = tl.constexpr(-1.0e30)  # finite start for the running max: exp(init - init) = 1, never NaN
LOG2E = tl.constexpr(1.4426950408889634)
_MAX_SPLITS = tl.constexpr(MAX_SPLITS)


@triton.jit
def _tanh(x):
    """tanh without tl.tanh (which not every backend, nor the interpreter, has): an odd Taylor
    polynomial for |x| < 1/8 (error < 2e-10), else (1 - e) / (1 + e) with e = exp(-2|x|) in (0, 1]:
    no overflow for any x, and no cancellation where 1 - e would lose the small values' digits."""
    a = tl.abs(x)
    e = tl.exp2(a * -2.8853900817779268)  # exp(-2|x|)
    far = (1.0 - e) / (1.0 + e)
    a2 = a * a
    near = a * (1.0 + a2 * (-0.3333333333333333 + a2 * (0.13333333333333333 + a2 * -0.05396825396825397)))
    t = tl.where(a < 0.125, near, far)
    return tl.where(x < 0, -t, t)


@triton.jit
def _scores(q, k, offs_n, qk_scale, cap_log2, slope, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
            IEEE: tl.constexpr):
    """A tile's scores against a block of keys, scaled into the log2 domain (softcap and ALiBi in)."""
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    if HAS_SOFTCAP:  # softcap * tanh(s * scaling / softcap), then into the log2 domain
        s = _tanh(s * qk_scale) * cap_log2
    else:
        s = s * qk_scale
    if HAS_ALIBI:  # slope x key position (a row's constant shift cancels)
        s = s + slope[:, None] * offs_n[None, :].to(tl.float32)
    return s


@triton.jit
def _softmax_step(s, m_i, l_i):
    """The online softmax's update for one block of scores: new running max, the block's weights,
    the rescale of what came before, and the new running sum."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    return m_new, p, alpha, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _accumulate(acc, alpha, p, v, IEEE: tl.constexpr):
    if IEEE:
        return acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)


# Strides of the tensors the model hands in (the query, a decode step's new K/V) follow its layout and
# may scale with the step's token count, and the window and split count are per-call values: none is
# specialised, so a model compiles the same variants for every step. ALIGNED_INPUTS (all those strides
# multiples of 16, as they are for head sizes that are) gives their loads the alignment back.
@triton.jit(do_not_specialize=["window", "num_seqs", "num_splits", "stride_qt", "stride_qh", "stride_os", "stride_ms",
                               "stride_bt", "stride_nkt", "stride_nkh", "stride_nvt", "stride_nvh"],
            do_not_specialize_on_alignment=["block_table_ptr", "query_start_ptr", "context_lens_ptr", "slot_ptr",
                                            "sinks_ptr", "slopes_ptr", "kv_start_ptr"])
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, m_ptr, l_ptr, sinks_ptr, slopes_ptr,
    block_table_ptr, query_start_ptr, context_lens_ptr, new_k_ptr, new_v_ptr, slot_ptr, kv_start_ptr,
    qk_scale, cap_log2, window, num_seqs, num_splits,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_os, stride_ot, stride_oh, stride_ms, stride_mt, stride_bt,
    stride_nkt, stride_nkh, stride_nvt, stride_nvh,
    PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr, GROUP: tl.constexpr, HEADS: tl.constexpr,
    CHUNKS: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
    HAS_ALIBI: tl.constexpr, IEEE: tl.constexpr, DECODE: tl.constexpr, NEW_KV: tl.constexpr,
    EARLY_LOADS: tl.constexpr, HEADS_FIRST: tl.constexpr, ALIGNED_INPUTS: tl.constexpr,
    KV_START: tl.constexpr,
):
    if HEADS_FIRST:  # grid (KV heads x chunks, query blocks, splits): a request's heads run side by side
        qb = tl.program_id(1)
        head_chunk = tl.program_id(0)
    else:
        qb = tl.program_id(0)
        head_chunk = tl.program_id(1)
    kv_head = head_chunk // CHUNKS
    chunk = head_chunk % CHUNKS
    split = tl.program_id(2)

    if DECODE:  # one query token per request: program qb is request qb's
        seq = qb
        q_begin = tl.load(query_start_ptr + seq)
        q_len = 1
        local = 0
    else:
        # The request whose query blocks include qb: the last i with query_start[i] // BLOCK_Q + i <= qb
        # (a binary search of dependent loads, which a decode step is spared).
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

        # Rows: BLOCK_Q tokens x HEADS query heads (this program's chunk of the KV head's group).
        offs_m = tl.arange(0, BLOCK_M)
        tok = local * BLOCK_Q + offs_m // HEADS
        in_group = chunk * HEADS + offs_m % HEADS
        head = kv_head * GROUP + in_group
        row_ok = (offs_m < BLOCK_Q * HEADS) & (tok < q_len) & (in_group < GROUP)
        pos = ctx - q_len + tok
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < HEAD_DIM
        offs_dv = tl.arange(0, BLOCK_DV)
        dv_ok = offs_dv < HEAD_DIM_V
        q_rows = (q_begin + tok) * stride_qt + head * stride_qh
        if ALIGNED_INPUTS:
            q_rows = tl.multiple_of(q_rows, 16)
        q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)

        # Keys this block can see: up to its last query's position, from its first query's window start.
        first_pos = ctx - q_len + local * BLOCK_Q
        kv_hi = ctx - q_len + tl.minimum(local * BLOCK_Q + BLOCK_Q, q_len)
        kv_lo = 0
        if HAS_WINDOW:
            kv_lo = tl.maximum(first_pos - window + 1, 0)
        if KV_START:  # (decode) the keys before kv_start[seq] are a shared prefix's: shared_prefix_attention.py
            kv_lo = tl.load(kv_start_ptr + seq).to(tl.int32)
        num_blocks = (kv_hi - kv_lo + BLOCK_N - 1) // BLOCK_N
        per_split = num_blocks
        if SPLIT:
            per_split = (num_blocks + num_splits - 1) // num_splits
        blk_lo = split * per_split
        blk_hi = tl.minimum(blk_lo + per_split, num_blocks)

        m_i = tl.full([BLOCK_M], NEG_INF_INIT, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        if HAS_SINKS:
            # Split 0 starts from the sink: a virtual key of logit sinks[head] and a zero value.
            # (A -inf sink gives m = NEG_INF_INIT and l = 0, the start without one.)
            sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32) * LOG2E
            m_sink = tl.maximum(sink, NEG_INF_INIT)
            m_i = tl.where(split == 0, m_sink, m_i)
            l_i = tl.where(split == 0, tl.exp2(sink - m_sink), l_i)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
        if HAS_ALIBI:  # slope x key position, in the log2 domain (a row's constant shift cancels)
            slope = tl.load(slopes_ptr + head, mask=row_ok, other=0.0).to(tl.float32) * LOG2E
        # In 64 bits: a strided pool's head stride may be slots x D, and the pool 2**31 elements or more.
        k_head = k_ptr + kv_head.to(tl.int64) * stride_kh
        v_head = v_ptr + kv_head.to(tl.int64) * stride_vh
        if NEW_KV:  # (decode) this token's K/V come as inputs: stored here, used from registers below
            new_k_at = q_begin * stride_nkt + kv_head * stride_nkh + offs_d
            new_v_at = q_begin * stride_nvt + kv_head * stride_nvh + offs_dv
            if ALIGNED_INPUTS:
                new_k_at = tl.multiple_of(new_k_at, 16)
                new_v_at = tl.multiple_of(new_v_at, 16)
            new_k = tl.load(new_k_ptr + new_k_at, mask=d_ok, other=0.0)
            new_v = tl.load(new_v_ptr + new_v_at, mask=dv_ok, other=0.0)
            if (chunk == 0) & (split == 0):  # one program per (request, KV head) writes the pool
                new_slot = tl.load(slot_ptr + q_begin).to(tl.int64)
                tl.store(k_head + new_slot * stride_kt + offs_d, new_k, mask=d_ok)
                tl.store(v_head + new_slot * stride_vt + offs_dv, new_v, mask=dv_ok)
        table_row = block_table_ptr + seq * stride_bt
        if not HAS_ALIBI:
            slope = m_i  # unused
        # Blocks of keys that every row of a prefill tile sees whole (all at or before its first
        # query's position, no window) go through a loop without the causal mask.
        full_hi = blk_lo
        if not DECODE:
            if not HAS_WINDOW:
                full_hi = tl.minimum(tl.maximum((first_pos + 1) // BLOCK_N, blk_lo), blk_hi)
                for blk in range(blk_lo, full_hi):
                    offs_n = blk * BLOCK_N + tl.arange(0, BLOCK_N)
                    page = tl.load(table_row + offs_n // PAGE)
                    slot = page * PAGE + offs_n % PAGE
                    k = tl.load(k_head + slot[:, None] * stride_kt + offs_d[None, :], mask=d_ok[None, :], other=0.0)
                    s = _scores(q, k, offs_n, qk_scale, cap_log2, slope, HAS_SOFTCAP, HAS_ALIBI, IEEE)
                    m_i, p, alpha, l_i = _softmax_step(s, m_i, l_i)
                    v = tl.load(v_head + slot[:, None] * stride_vt + offs_dv[None, :], mask=dv_ok[None, :], other=0.0)
                    acc = _accumulate(acc, alpha, p, v, IEEE)
        if EARLY_LOADS:  # the first block's pages; each iteration then loads the next block's
            offs_next = kv_lo + full_hi * BLOCK_N + tl.arange(0, BLOCK_N)
            next_page = tl.load(table_row + offs_next // PAGE, mask=offs_next < kv_hi, other=0)
        for blk in range(full_hi, blk_hi):
            offs_n = kv_lo + blk * BLOCK_N + tl.arange(0, BLOCK_N)
            n_ok = offs_n < kv_hi
            if EARLY_LOADS:
                # A decode step's few blocks per program make it latency-bound: issue this block's K
                # and V loads together, and the next block's page loads, before any of them is used.
                slot = next_page * PAGE + offs_n % PAGE
                k = tl.load(k_head + slot[:, None] * stride_kt + offs_d[None, :],
                            mask=n_ok[:, None] & d_ok[None, :], other=0.0)
                v = tl.load(v_head + slot[:, None] * stride_vt + offs_dv[None, :],
                            mask=n_ok[:, None] & dv_ok[None, :], other=0.0)
                offs_next = offs_n + BLOCK_N
                next_page = tl.load(table_row + offs_next // PAGE, mask=offs_next < kv_hi, other=0)
            else:
                page = tl.load(table_row + offs_n // PAGE, mask=n_ok, other=0)
                slot = page * PAGE + offs_n % PAGE
                k = tl.load(k_head + slot[:, None] * stride_kt + offs_d[None, :],
                            mask=n_ok[:, None] & d_ok[None, :], other=0.0)
            if NEW_KV:  # the newest key is not in the pool yet (no program reads what another writes)
                is_new = offs_n == ctx - 1
                k = tl.where(is_new[:, None], new_k[None, :].to(k.dtype), k)
            s = _scores(q, k, offs_n, qk_scale, cap_log2, slope, HAS_SOFTCAP, HAS_ALIBI, IEEE)
            allowed = (offs_n[None, :] <= pos[:, None]) & n_ok[None, :]
            if HAS_WINDOW:
                allowed = allowed & ((pos[:, None] - offs_n[None, :]) < window)
            s = tl.where(allowed, s, float("-inf"))
            m_i, p, alpha, l_i = _softmax_step(s, m_i, l_i)
            if not EARLY_LOADS:
                v = tl.load(v_head + slot[:, None] * stride_vt + offs_dv[None, :],
                            mask=n_ok[:, None] & dv_ok[None, :], other=0.0)
            if NEW_KV:
                v = tl.where(is_new[:, None], new_v[None, :].to(v.dtype), v)
            acc = _accumulate(acc, alpha, p, v, IEEE)

        rows = q_begin + tok
        out_mask = row_ok[:, None] & dv_ok[None, :]
        if not SPLIT:
            out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            tl.store(o_ptr + rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_dv[None, :],
                     out.to(o_ptr.dtype.element_ty), mask=out_mask)
        else:  # unnormalised partials, merged by _merge_splits_kernel
            tl.store(o_ptr + split * stride_os + rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_dv[None, :],
                     acc, mask=out_mask)
            ml = split * stride_ms + rows * stride_mt + head
            tl.store(m_ptr + ml, m_i, mask=row_ok)
            tl.store(l_ptr + ml, l_i, mask=row_ok)


@triton.jit(do_not_specialize=["num_splits"])
def _merge_splits_kernel(
    part_ptr, m_ptr, l_ptr, o_ptr, num_splits,
    stride_ps, stride_pt, stride_ph, stride_ms, stride_mt, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """The splits' partial results merged (a runtime count, up to MAX_SPLITS: one variant for all)."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    splits = tl.arange(0, _MAX_SPLITS)
    ours = splits < num_splits
    m = tl.load(m_ptr + splits * stride_ms + t * stride_mt + h, mask=ours, other=float("-inf"))
    l = tl.load(l_ptr + splits * stride_ms + t * stride_mt + h, mask=ours, other=0.0)
    w = tl.exp2(m - tl.max(m, 0))
    part = tl.load(part_ptr + splits[:, None] * stride_ps + t * stride_pt + h * stride_ph + offs_d[None, :],
                   mask=ours[:, None] & d_ok[None, :], other=0.0)
    out = tl.sum(part * w[:, None], 0) / tl.sum(l * w, 0)
    tl.store(o_ptr + t * stride_ot + h * stride_oh + offs_d, out.to(o_ptr.dtype.element_ty), mask=d_ok)


def runs_on(device: torch.device) -> bool:
    """Whether the kernels can run for tensors on `device` (the CPU only under the interpreter)."""
    return device.type == "cuda" or bool(triton.knobs.runtime.interpret)


def _aligned_rows(pool: torch.Tensor) -> torch.Tensor:
    """The pool itself when each head's row starts on a 16-byte boundary, else a compact copy. The
    kernel's tile loads need that alignment on the GPU (an H200 faults on misaligned addresses).
    The engine's own pools and gathered contexts always have it; a view into a wider buffer with an
    odd row width (a test's, or a model's own layout) may not."""
    size = pool.element_size()
    if pool.data_ptr() % 16 == 0 and all(stride * size % 16 == 0 for stride in pool.stride()[:2]):
        return pool
    return pool.contiguous()


def paged_attention_triton(
    query: torch.Tensor,
    key_pool: torch.Tensor,
    value_pool: torch.Tensor,
    meta: StepMetadata,
    scaling: float | None,
    sliding_window: int | None = None,
    num_splits: int | None = None,
    tuning: dict | None = None,
    *,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """query [1, H, T, Dk] (packed), pools [slots, KVH, Dk] and [slots, KVH, Dv] -> output
    [1, T, H, Dv]; same contract as paged_attention_reference (softcap None or 0.0: none; sinks
    [H] of any float dtype on query's device, read as fp32). The pools' last dimension must be
    dense; their other strides are free (and may differ between keys and values). `num_splits`
    overrides the split heuristic (tests); `tuning` the launch parameters (block_n, num_warps,
    num_stages, early_loads, heads_first, block_q: benchmarks/tune_kernels.py). `new_kv` (decode steps only): the step's keys and
    values, [1, KVH, T, D] as the model hands them to the cache, not yet in the pools: the kernel
    stores them at meta.slot_mapping and attends with them, one kernel where the step ran two."""
    _, num_heads, total, head_dim = query.shape
    num_kv_heads = key_pool.shape[1]
    head_dim_v = value_pool.shape[-1]
    softcap = check_softcap(softcap)
    sinks = check_sinks(sinks, num_heads)
    check_shapes(query, key_pool, value_pool)
    if sinks is not None:
        if sinks.device != query.device:
            raise ValueError(f"sinks are on {sinks.device}, the query on {query.device}")
        if sinks.stride(0) != 1:
            sinks = sinks.contiguous()
    alibi_slopes = check_sinks(alibi_slopes, num_heads, "alibi_slopes")
    if alibi_slopes is not None:
        if alibi_slopes.device != query.device:
            raise ValueError(f"alibi_slopes are on {alibi_slopes.device}, the query on {query.device}")
        alibi_slopes = alibi_slopes.contiguous()
    group = num_heads // num_kv_heads
    q = query[0].transpose(0, 1)  # [T, H, Dk]
    if q.stride(-1) != 1:
        q = q.contiguous()
    if key_pool.stride(-1) != 1 or value_pool.stride(-1) != 1:
        raise ValueError("the KV pools must be contiguous in the head dimension")
    aligned_keys, aligned_values = _aligned_rows(key_pool), _aligned_rows(value_pool)
    if new_kv is not None and (aligned_keys is not key_pool or aligned_values is not value_pool):
        from hf_async_cb.kernels.store_kv import store_kv  # the kernel would store into the copies

        store_kv(key_pool, value_pool, *new_kv, meta.slot_mapping)
        aligned_keys, aligned_values = _aligned_rows(key_pool), _aligned_rows(value_pool)
        new_kv = None
    key_pool, value_pool = aligned_keys, aligned_values
    scale = scaling if scaling is not None else 1.0 / math.sqrt(head_dim)
    if softcap is None:
        qk_scale, cap_log2 = scale * LOG2E.value, 1.0
    else:
        qk_scale, cap_log2 = scale / softcap, softcap * LOG2E.value
    tile = tile_shape(group, head_dim, head_dim_v, meta.max_query_len)
    if tuning and tuning.get("block_q") and tile["chunks"] == 1:  # a taller tile of query tokens (sweeps)
        tile["block_q"] = tuning["block_q"]
        tile["block_m"] = max(16, triton.next_power_of_2(tuning["block_q"] * tile["heads"]))
    block_q, block_m, chunks = tile["block_q"], tile["block_m"], tile["chunks"]
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_dv = max(16, triton.next_power_of_2(head_dim_v))
    num_seqs = meta.num_requests
    decode = meta.is_decode and total == num_seqs
    tuning = {**launch_defaults(head_dim, query.dtype, head_dim_v, block_m, decode), **(tuning or {})}
    block_n = tuning["block_n"]
    launch = {k: tuning[k] for k in ("num_warps", "num_stages") if k in tuning}
    splits = num_splits or choose_splits(meta, num_kv_heads * chunks, query.device)
    if not 1 <= splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}], got {splits}")
    # Rows that share a prefix (meta.group_start): its keys read once per group, into split slots
    # after the rows' own, or with one prefix split joined with them there (shared_prefix_attention.py).
    cascade = (decode and meta.group_start is not None and sliding_window is None and alibi_slopes is None
               and chunks == 1)
    psplits = 0
    if cascade:
        from hf_async_cb.kernels.shared_prefix_attention import holds_group, launch_shared_prefix, prefix_splits

        cascade = holds_group(group, max(head_dim, head_dim_v))
    if cascade:
        psplits = prefix_splits(num_seqs, num_kv_heads, meta.max_context, num_sms(query.device) or 1)
    splits = min(splits, MAX_SPLITS - psplits)
    slots = splits + psplits
    # One prefix split joins the rows' partials itself (MERGE): it needs no slot of its own.
    merged_by_prefix = psplits == 1
    out = torch.empty(total, num_heads, head_dim_v, dtype=query.dtype, device=query.device)
    if slots > 1:
        # Each split's rows padded to a multiple of 16 tokens: the merge's split strides are then
        # multiples of 16 at any token count (one compiled variant, aligned loads).
        padded = -(-total // 16) * 16
        written = splits if merged_by_prefix else slots
        part = torch.empty(written, padded, num_heads, head_dim_v, dtype=torch.float32, device=query.device)
        m = torch.empty(written, padded, num_heads, dtype=torch.float32, device=query.device)
        l = torch.empty_like(m)
        target, part_strides, ml_strides = part, part.stride(), m.stride()[:2]
    else:
        m = l = out  # unused
        target, part_strides, ml_strides = out, (0, *out.stride()[:2]), (0, 0)
    if new_kv is not None:
        new_k, new_v = new_kv
        if not decode or new_k.shape[-1] != head_dim or new_v.shape[-1] != head_dim_v \
                or new_k.stride(-1) != 1 or new_v.stride(-1) != 1:
            raise ValueError("paged_attention_triton takes new_kv in decode steps only, as [1, KVH, T, D] with a "
                             "dense last dimension")
        new_strides = (new_k.stride(2), new_k.stride(1), new_v.stride(2), new_v.stride(1))
    else:
        new_k = new_v = q  # unused
        new_strides = (0, 0, 0, 0)
    aligned_inputs = all(stride % 16 == 0 for stride in (q.stride(0), q.stride(1), *new_strides))
    blocks = num_seqs if decode else total // block_q + num_seqs
    # heads_first (tuning; sweeps): the programs of one request's KV heads launch next to each other,
    # so that the pools' rows (every head of a slot side by side) are read by programs running together.
    heads_first = bool(tuning.get("heads_first")) and blocks < 65536  # the grid's second axis limit
    grid = (num_kv_heads * chunks, blocks, splits) if heads_first else (blocks, num_kv_heads * chunks, splits)
    _paged_attention_kernel[grid](
        q, key_pool, value_pool, target, m, l, sinks if sinks is not None else q,
        alibi_slopes if alibi_slopes is not None else q,
        meta.block_table, meta.query_start, meta.context_lens, new_k, new_v, meta.slot_mapping,
        meta.shared_len if cascade else meta.context_lens,
        qk_scale, cap_log2, sliding_window or 0, num_seqs, splits,
        q.stride(0), q.stride(1), key_pool.stride(0), key_pool.stride(1), value_pool.stride(0), value_pool.stride(1),
        *part_strides[:3], *ml_strides, meta.block_table.stride(0), *new_strides,
        PAGE=meta.page_size, HEAD_DIM=head_dim, BLOCK_D=block_d, HEAD_DIM_V=head_dim_v, BLOCK_DV=block_dv,
        GROUP=group, HEADS=tile["heads"], CHUNKS=chunks, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n,
        SPLIT=slots > 1, HAS_WINDOW=sliding_window is not None, HAS_SOFTCAP=softcap is not None,
        HAS_SINKS=sinks is not None, HAS_ALIBI=alibi_slopes is not None, IEEE=query.dtype == torch.float32,
        DECODE=decode, NEW_KV=new_kv is not None, EARLY_LOADS=tuning.get("early_loads", False), HEADS_FIRST=heads_first,
        ALIGNED_INPUTS=aligned_inputs, KV_START=cascade, **launch,
    )
    if cascade:
        launch_shared_prefix(q, key_pool, value_pool, part, m, l, out, meta, qk_scale, cap_log2, splits, psplits,
                             group, softcap is not None, query.dtype == torch.float32)
    if slots > 1 and not merged_by_prefix:
        _merge_splits_kernel[(total, num_heads)](
            part, m, l, out, slots, *part.stride()[:3], *m.stride()[:2], *out.stride()[:2],
            HEAD_DIM=head_dim_v, BLOCK_D=block_dv,
        )
    return out[None]


def variants(num_heads: int, key_pool: torch.Tensor, value_pool: torch.Tensor, page_size: int, dtype: torch.dtype, *,
             window: bool = False, softcap: bool = False, sinks: torch.dtype | None = None,
             alibi: torch.dtype | None = None, splits: bool = True, tall: bool = True,
             new_kv: bool = True, shared: bool = True) -> list[Variant]:
    """The kernels' compiled variants for one kind of layer (its heads, pools, flags) as the engine
    launches them: decode steps (their new K/V as inputs when `new_kv`; unsplit, and split over the
    context when `splits`, with the merge), prefill and mixed steps (16-row tiles and, when `tall`,
    the tall ones), whatever the batch, tokens and contexts. `sinks` / `alibi`: their dtypes, when
    the layer has them. `shared`: decode steps whose rows share prefixes too (the rows' own keys
    after kv_start, and the prefix kernel), where the layer can take them (no window, no ALiBi, one
    program per KV head). Query and new K/V strides are multiples of the head sizes."""
    num_kv_heads, head_dim = key_pool.shape[1:]
    head_dim_v = value_pool.shape[-1]
    group = num_heads // num_kv_heads
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_dv = max(16, triton.next_power_of_2(head_dim_v))
    pools = (key_pool.stride(0), key_pool.stride(1), value_pool.stride(0), value_pool.stride(1))
    i64, f32 = torch.int64, torch.float32
    steps = [(True, False)] + [(True, True)] * splits + [(False, False)]
    found = []
    for decode, split in steps:
        for query_len in ((1,) if decode else (2, TALL_TILE_QUERY_LEN) if tall else (2,)):
            tile = tile_shape(group, head_dim, head_dim_v, query_len)
            tuning = launch_defaults(head_dim, dtype, head_dim_v, tile["block_m"], decode)
            out, stat = (f32, f32) if split else (dtype, dtype)
            args = (dtype, key_pool.dtype, value_pool.dtype, out, stat, stat, sinks or dtype, alibi or dtype,
                    i64, i64, i64, dtype, dtype, i64, i64, 0.5, 0.5, 0, 2, 2, 0, 0, *pools,
                    0, num_heads * head_dim_v, head_dim_v, 0, num_heads if split else 0, 0, 0, 0, 0, 0)
            found.append(Variant(_paged_attention_kernel, args, dict(
                PAGE=page_size, HEAD_DIM=head_dim, BLOCK_D=block_d, HEAD_DIM_V=head_dim_v, BLOCK_DV=block_dv,
                GROUP=group, HEADS=tile["heads"], CHUNKS=tile["chunks"], BLOCK_Q=tile["block_q"],
                BLOCK_M=tile["block_m"], BLOCK_N=tuning["block_n"], SPLIT=split, HAS_WINDOW=window,
                HAS_SOFTCAP=softcap, HAS_SINKS=sinks is not None, HAS_ALIBI=alibi is not None, IEEE=dtype == f32,
                DECODE=decode, NEW_KV=decode and new_kv, EARLY_LOADS=tuning.get("early_loads", False),
                HEADS_FIRST=False, ALIGNED_INPUTS=head_dim % 16 == 0 and head_dim_v % 16 == 0, KV_START=False),
                {k: tuning[k] for k in ("num_warps", "num_stages") if k in tuning}))
    tile = tile_shape(group, head_dim, head_dim_v, 1)
    from hf_async_cb.kernels.shared_prefix_attention import holds_group, prefix_variant  # (imports this module)

    if (shared and splits and not window and alibi is None and tile["chunks"] == 1
            and holds_group(group, max(head_dim, head_dim_v))):
        found.append(dataclasses.replace(found[1], constexprs={**found[1].constexprs, "KV_START": True}))
        found += [prefix_variant(group, key_pool, value_pool, page_size, dtype, softcap, merge) for merge in (True, False)]
    if splits:
        found.append(Variant(_merge_splits_kernel, (f32, f32, f32, dtype, 2, 0, num_heads * head_dim_v, head_dim_v, 0,
                                                    num_heads, num_heads * head_dim_v, head_dim_v),
                             dict(HEAD_DIM=head_dim_v, BLOCK_D=block_dv)))
    return found
