"""Decode attention over a prefix that several rows of the step share, read once for all of them
(cascade attention).

Why: with prefix caching, the rows of a GRPO group (one prompt repeated G times) or of a few-shot
batch point at the same physical pages for their shared prompt. The paged kernel reads a row's
whole context per (row, KV head) program, so a step reads a 1K-token prefix once per row: on the
H200 (benchmarks/shared_prefix_attention.py) 256 rows in groups of 8 over 1,088 tokens take 306 us
per 8B layer with the prefix pages shared and 338 us with every row on pages of its own. The GPU's
L2 does not catch the repeats. Here one program per (group, KV head, split of the prefix) loads
each prefix tile once and scores it against the queries of every row of the group (rows x query
heads in one tile); the paged kernel then takes only each row's own keys after the prefix
(`kv_start`), and the partial results of both are joined per row (exact: the same online softmax
over disjoint key sets). Where the prefix takes one program per (group, KV head), the usual case
at 64+ rows, that program joins them itself (MERGE: it reads the rows' own partials, which the
paged kernel launched before it has written, and writes the output), so the step launches no
split merge: on the H100 the merge took 15 us of a 1B group step's ~92 us of attention per layer,
a launch of 8,192 small programs whatever their shape (docs/benchmarks.md, 2026-12-05). With
several prefix splits, the split merge joins every partial as before.

The step's groups come from the host (engine/shared_prefix_groups.py: decode rows whose block
tables start with the same full pages): group_rows [R] (the rows in the groups' order), group_start
[R + 1] (group i owns rows group_rows[group_start[i]] .. group_rows[group_start[i + 1] - 1]; groups
past the last are empty) and shared_len [R] (each row's shared prefix in tokens, a multiple of the
page; 0 for a row alone). A row alone writes an empty partial
(running max at its finite floor, sum 0), which the merge weighs 0. A group of more rows than a
tile holds is spread over CHUNKS programs, each rereading the prefix.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_async_cb.kernels.paged_attention import NEG_INF_INIT, _accumulate, _scores, _softmax_step
from hf_async_cb.kernels.variant import Variant

MAX_GROUP_ROWS = 16  # the host never groups more rows than this (engine/batch.py)
MIN_SHARED_TOKENS = 128  # nor shares fewer keys: below this the extra launch costs more than it saves


def tile_rows(group: int, head_dim: int) -> tuple[int, int, int]:
    """(block_m, rows per program, programs per group) for a KV head's `group` query heads: tiles
    of 64 rows (32 for head sizes over 128), each holding whole rows' heads."""
    block_m = 64 if head_dim <= 128 else 32
    rows = max(1, block_m // group)
    return block_m, rows, -(-MAX_GROUP_ROWS // rows)


def holds_group(group: int, head_dim: int) -> bool:
    """Whether a prefix tile holds a row's `group` query heads of one KV head (the kernel takes whole
    rows): up to 64 heads (32 for head sizes over 128). Larger groups (Falcon-7B's 71 query heads on
    one KV head, say) leave grouped decode steps to the paged kernel alone."""
    return group <= tile_rows(group, head_dim)[0]


def prefix_tiles_hold(layout, text_config) -> bool:
    """Whether some layer of a model with this K/V `layout` (model/kv_layout.py) has query-head groups
    a prefix tile holds (holds_group): else no decode step is worth grouping. True where the query
    head count is not in the config (the kernel decides per layer)."""
    heads = getattr(text_config, "num_attention_heads", None)
    if not isinstance(heads, int):
        return True
    return any(holds_group(max(1, heads // max(1, layer.key_heads)), max(layer.key_dim, layer.value_dim))
               for layer in layout.layers)


def prefix_splits(num_requests: int, num_kv_heads: int, max_context: int, sms: int) -> int:
    """Programs per group's prefix: enough that (groups of ~4 rows) x KV heads x splits give every
    SM two programs, each with at least 256 keys. Depends only on the step's bucket (a graph's
    grid is fixed at capture)."""
    groups = max(1, num_requests // 4)
    wanted = -(-2 * max(1, sms) // (groups * num_kv_heads))
    splits = max(1, min(wanted, max_context // 256, 8))
    return 1 << (splits.bit_length() - 1)


@triton.jit(do_not_specialize=["slot0", "num_psplits", "stride_qt", "stride_qh", "stride_bt", "stride_ot",
                               "stride_oh"],
            do_not_specialize_on_alignment=["block_table_ptr", "group_start_ptr", "group_rows_ptr", "shared_len_ptr"])
def _shared_prefix_kernel(
    q_ptr, k_ptr, v_ptr, part_ptr, m_ptr, l_ptr, o_ptr, block_table_ptr, group_start_ptr, group_rows_ptr,
    shared_len_ptr, qk_scale, cap_log2, slot0, num_psplits,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_ps, stride_pt, stride_ph, stride_ms, stride_mt, stride_bt, stride_ot, stride_oh,
    PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_DV: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr, CHUNKS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_SOFTCAP: tl.constexpr, IEEE: tl.constexpr,
    MERGE: tl.constexpr,
):
    """MERGE (one prefix split): the rows' own partials are in slots 0 .. slot0 - 1; the program joins
    them with its own as the split merge would and writes the rows' output to o_ptr."""
    g = tl.program_id(0) // CHUNKS
    chunk = tl.program_id(0) % CHUNKS
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    start = tl.load(group_start_ptr + g)
    end = tl.load(group_start_ptr + g + 1)
    first = start + chunk * ROWS
    if first < end:
        lead = tl.load(group_rows_ptr + start)  # the group's first row: its pages are the prefix
        shared = tl.load(shared_len_ptr + lead)
        offs_m = tl.arange(0, BLOCK_M)
        at = first + offs_m // GROUP  # places in the groups' order of rows
        head = kv_head * GROUP + offs_m % GROUP
        row_ok = (offs_m < ROWS * GROUP) & (at < end) & (at < first + ROWS)
        row = tl.load(group_rows_ptr + at, mask=row_ok, other=0)
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < HEAD_DIM
        offs_dv = tl.arange(0, BLOCK_DV)
        dv_ok = offs_dv < HEAD_DIM_V
        q = tl.load(q_ptr + row[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        num_blocks = (shared + BLOCK_N - 1) // BLOCK_N
        per_split = (num_blocks + num_psplits - 1) // num_psplits
        blk_lo = split * per_split
        blk_hi = tl.minimum(blk_lo + per_split, num_blocks)
        m_i = tl.full([BLOCK_M], NEG_INF_INIT, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
        k_head = k_ptr + kv_head.to(tl.int64) * stride_kh
        v_head = v_ptr + kv_head.to(tl.int64) * stride_vh
        table_row = block_table_ptr + lead * stride_bt
        for blk in range(blk_lo, blk_hi):
            offs_n = blk * BLOCK_N + tl.arange(0, BLOCK_N)
            n_ok = offs_n < shared
            page = tl.load(table_row + offs_n // PAGE, mask=n_ok, other=0)
            slot = page.to(tl.int64) * PAGE + offs_n % PAGE
            k = tl.load(k_head + slot[:, None] * stride_kt + offs_d[None, :], mask=n_ok[:, None] & d_ok[None, :],
                        other=0.0)
            v = tl.load(v_head + slot[:, None] * stride_vt + offs_dv[None, :], mask=n_ok[:, None] & dv_ok[None, :],
                        other=0.0)
            s = _scores(q, k, offs_n, qk_scale, cap_log2, m_i, HAS_SOFTCAP, False, IEEE)
            s = tl.where(n_ok[None, :], s, float("-inf"))
            m_i, p, alpha, l_i = _softmax_step(s, m_i, l_i)
            acc = _accumulate(acc, alpha, p, v, IEEE)
        tile_ok = row_ok[:, None] & dv_ok[None, :]
        at_row = row[:, None] * stride_pt + head[:, None] * stride_ph + offs_dv[None, :]
        ml_row = row * stride_mt + head
        if MERGE:
            top = m_i  # the largest running max over every partial of the row, as the merge weighs them
            for own in range(slot0):
                top = tl.maximum(top, tl.load(m_ptr + own * stride_ms + ml_row, mask=row_ok, other=float("-inf")))
            w = tl.exp2(m_i - top)
            num = acc * w[:, None]
            den = l_i * w
            for own in range(slot0):
                w = tl.exp2(tl.load(m_ptr + own * stride_ms + ml_row, mask=row_ok, other=float("-inf")) - top)
                num += tl.load(part_ptr + own * stride_ps + at_row, mask=tile_ok, other=0.0) * w[:, None]
                den += tl.load(l_ptr + own * stride_ms + ml_row, mask=row_ok, other=0.0) * w
            out = num / den[:, None]
            tl.store(o_ptr + row[:, None] * stride_ot + head[:, None] * stride_oh + offs_dv[None, :],
                     out.to(o_ptr.dtype.element_ty), mask=tile_ok)
        else:
            slot_at = slot0 + split
            tl.store(part_ptr + slot_at * stride_ps + at_row, acc, mask=tile_ok)
            tl.store(m_ptr + slot_at * stride_ms + ml_row, m_i, mask=row_ok)
            tl.store(l_ptr + slot_at * stride_ms + ml_row, l_i, mask=row_ok)


def _constexprs(group: int, head_dim: int, head_dim_v: int, page_size: int, softcap: bool, ieee: bool,
                merge: bool) -> dict:
    block_m, rows, chunks = tile_rows(group, max(head_dim, head_dim_v))
    return dict(PAGE=page_size, HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
                HEAD_DIM_V=head_dim_v, BLOCK_DV=max(16, triton.next_power_of_2(head_dim_v)), GROUP=group, ROWS=rows,
                CHUNKS=chunks, BLOCK_M=block_m, BLOCK_N=BLOCK_N, HAS_SOFTCAP=softcap, IEEE=ieee, MERGE=merge)


BLOCK_N = 64  # keys per tile
LAUNCH = dict(num_warps=4, num_stages=2)


def prefix_variant(group: int, key_pool: torch.Tensor, value_pool: torch.Tensor, page_size: int, dtype: torch.dtype,
                   softcap: bool, merge: bool) -> Variant:
    """The prefix kernel's compiled variant for one kind of layer (paged_attention.variants), joining
    the rows' partials itself or not (`merge`)."""
    num_heads, head_dim_v = group * key_pool.shape[1], value_pool.shape[-1]
    i64, f32 = torch.int64, torch.float32
    args = (dtype, key_pool.dtype, value_pool.dtype, f32, f32, f32, dtype, i64, i64, i64, i64, 0.5, 0.5, 0, 2, 0, 0,
            key_pool.stride(0), key_pool.stride(1), value_pool.stride(0), value_pool.stride(1),
            0, num_heads * head_dim_v, head_dim_v, 0, num_heads, 0, 0, 0)
    return Variant(_shared_prefix_kernel, args,
                   _constexprs(group, key_pool.shape[-1], head_dim_v, page_size, softcap, dtype == f32, merge), LAUNCH)


def launch_shared_prefix(q, key_pool, value_pool, part, m, l, out, meta, qk_scale: float, cap_log2: float,
                         slot0: int, psplits: int, group: int, softcap: bool, ieee: bool) -> None:
    """The prefix partials of every group of `meta` (meta.group_start, group_rows, shared_len) into split
    slots slot0 .. slot0 + psplits - 1 of part/m/l; with one split, joined with the rows' own partials
    in slots 0 .. slot0 - 1 into `out` [T, H, Dv] instead. q: [T, H, Dk] (one token per row)."""
    head_dim, head_dim_v = key_pool.shape[-1], value_pool.shape[-1]
    constexprs = _constexprs(group, head_dim, head_dim_v, meta.page_size, softcap, ieee, psplits == 1)
    grid = (meta.num_requests * constexprs["CHUNKS"], key_pool.shape[1], psplits)
    _shared_prefix_kernel[grid](
        q, key_pool, value_pool, part, m, l, out, meta.block_table, meta.group_start, meta.group_rows,
        meta.shared_len, qk_scale, cap_log2, slot0, psplits,
        q.stride(0), q.stride(1), key_pool.stride(0), key_pool.stride(1), value_pool.stride(0), value_pool.stride(1),
        *part.stride()[:3], *m.stride()[:2], meta.block_table.stride(0), *out.stride()[:2], **constexprs, **LAUNCH,
    )
