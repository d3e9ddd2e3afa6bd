"""How the paged attention kernel (paged_attention.py) is launched: the tile of query rows a
program takes, the key block and launch shape for that tile, and how many programs share a decode
context. The kernel is the what; these are the measured choices (benchmarks/tune_kernels.py,
benchmarks/ab_attention.py, docs/benchmarks.md), kept apart so that a sweep or an A/B patches
one place.
"""

from __future__ import annotations

import torch
import triton

from hf_async_cb.devices import num_sms
from hf_async_cb.model.step_metadata import StepMetadata

SHARED_MEMORY_BUDGET = 200 * 1024  # of the H200's ~227 KB a block may take, with room for Triton's scratch


def shared_memory_estimate(block_m: int, block_d: int, block_dv: int, block_n: int, num_stages: int,
                           itemsize: int) -> int:
    """Bytes of shared memory the attention kernel's tiles take, counted generously: every stage
    of the K and V tiles buffered, plus the Q tile and the P tile (the dot operands that may be
    staged through shared memory)."""
    kv = block_n * (block_d + block_dv) * itemsize * max(1, num_stages)
    return kv + block_m * block_d * itemsize + block_m * block_n * itemsize


def launch_defaults(head_dim: int, dtype: torch.dtype, head_dim_v: int | None = None, block_m: int = 16,
                     decode: bool = False) -> dict:
    """Key block and launch shape for a tile of `block_m` rows (BLOCK_M: query tokens x query
    heads) over head sizes padded to powers of two (d = the larger of the padded Dk and Dv).

    16-bit, block_m <= 32 (every group of up to 32 heads), d <= 128: from sweeps of decode steps
    on the H200 (benchmarks/tune_kernels.py, cold L2, docs/benchmarks.md): K/V tiles of 64 x 64
    with 2 warps, two stages deep in prefill; in decode three deep, with the early loads
    (EARLY_LOADS: 7-12% faster at 64-256 requests). For d = 128, tiles of 128 x 128 with 4 warps
    in prefill; in decode 64 x 128 with 2 warps and no early loads (the two tiles held at once
    cost 5-10% there): 7-12% faster at 32-256 requests and 1-8K keys, 3% slower at 32 x 256.

    Not measured yet (no GPU where they were written), so chosen to fit with a margin, by
    shared_memory_estimate against SHARED_MEMORY_BUDGET (200 KB of the H200's ~227 KB per block)
    and by register pressure (the fp32 accumulator is block_m x d):
    - 16-bit, d = 256 (Gemma 2's 256, MLA's 192), block_m <= 32: 64 keys, 4 warps, 2 stages
      (~148 KB: 2 x 64 KB of K/V, 16 KB Q, 4 KB P);
    - 16-bit, block_m 64..128 (prefill's tall tiles, and groups above 32 heads: Falcon's 71, MQA's
      many): 64 keys, 2 stages, 4 warps for d <= 64 (48-64 KB) and for d = 128 with 64 rows (the
      prefill sweep's best: 251 TFLOP/s on an 8K prompt, 158 on 16 x 512), 8 warps for 128 rows
      (88-112 KB); for d = 256 32 keys, 8 warps, one stage (~104 KB with 128 rows; the wrapper
      keeps such tiles to 64 rows anyway, see _max_rows).
    fp32 (the tests' exact path) keeps 64-key blocks for d <= 128 and 32 for larger ones, and
    Triton's default of 3 stages and 4 warps, except where the estimate asks for fewer stages
    (2 for d = 128 or 256, 1 with 128 rows; 16 keys for d = 256 with 128 rows, a tile the wrapper
    never makes) or the rows for more warps (8 above 32 rows). Head sizes over 256 (untested) take
    that same search in 16-bit too."""
    d = max(triton.next_power_of_2(head_dim), triton.next_power_of_2(head_dim_v or head_dim))
    if dtype.itemsize == 2 and d <= 256:
        if block_m <= 32:
            if d <= 64:
                return dict(block_n=64, num_warps=2, num_stages=3, early_loads=True) if decode else \
                    dict(block_n=64, num_warps=2, num_stages=2)
            if d <= 128:
                return dict(block_n=64, num_warps=2, num_stages=2, early_loads=False) if decode else \
                    dict(block_n=128, num_warps=4, num_stages=2)
            return dict(block_n=64, num_warps=4, num_stages=2)
        if d <= 64:
            return dict(block_n=64, num_warps=4, num_stages=2)
        if d <= 128:
            return dict(block_n=64, num_warps=4 if block_m <= 64 else 8, num_stages=2)
        return dict(block_n=32, num_warps=8, num_stages=1)
    bd, bdv = max(16, triton.next_power_of_2(head_dim)), max(16, triton.next_power_of_2(head_dim_v or head_dim))
    fits = [(n, s) for n in ((64, 32, 16) if d <= 128 else (32, 16)) for s in (3, 2, 1)
            if shared_memory_estimate(block_m, bd, bdv, n, s, dtype.itemsize) <= SHARED_MEMORY_BUDGET]
    block_n, stages = fits[0] if fits else (16, 1)
    launch = dict(block_n=block_n)  # Triton's default stages (3) and warps (4) where they fit, as before
    if stages < 3:
        launch["num_stages"] = stages
    if block_m > 32:
        launch["num_warps"] = 8
    return launch


def _max_rows(head_dim: int, head_dim_v: int) -> int:
    """The most query-head rows one program's tile takes: 128, or 64 when a padded head size
    exceeds 128 (a 128 x 256 fp32 accumulator alone would take every register of 8 warps)."""
    return 128 if max(head_dim, head_dim_v) <= 128 else 64


MAX_SPLITS = 16  # the most programs a decode context is split over (the merge kernel's vector width)
TALL_TILE_QUERY_LEN = 64  # a step whose longest query has this many tokens takes tall prefill tiles
TALL_TILE_ROWS = 64


def tile_shape(group: int, head_dim: int, head_dim_v: int, max_query_len: int = 1) -> dict:
    """How a KV head's group of `group` query heads maps onto programs: `chunks` programs per KV
    head, each with `heads` of the group (the last may have fewer valid ones) for `block_q` query
    tokens, in a tile of `block_m` rows (a power of two, at least 16). Groups of up to 128 heads
    (64 for head sizes over 128) take one program; larger ones are split evenly.

    Tiles are 16 rows, except in steps with a query of TALL_TILE_QUERY_LEN tokens or more (prefill
    chunks), where they are TALL_TILE_ROWS rows: each K/V block is then read by 4x fewer programs,
    and the dots are large enough for Hopper's warp-group MMA. Measured on the H200 (cold, 8B
    heads; benchmarks/tune_kernels.py --prefill, docs/benchmarks.md): 2x faster on 512- to 8K-token
    prompts than 16 rows."""
    rows = _max_rows(triton.next_power_of_2(head_dim), triton.next_power_of_2(head_dim_v))
    chunks = -(-group // rows)
    heads = -(-group // chunks)
    target = TALL_TILE_ROWS if max_query_len >= TALL_TILE_QUERY_LEN else 16
    block_q = max(1, min(target, rows) // heads)
    block_m = max(16, triton.next_power_of_2(block_q * heads))
    return dict(chunks=chunks, heads=heads, block_q=block_q, block_m=block_m)


def choose_splits(meta: StepMetadata, num_kv_heads: int, device: torch.device) -> int:
    """Split decode contexts when the step has too few (request, KV head) programs to give every
    SM two, and the contexts are long enough to share (at least 256 keys per split). Measured on
    the H200 with cold L2 (benchmarks/tune_kernels.py): 32 requests x 8 KV heads gain ~7% from 2
    splits at 1-8K keys, and tie at 640; 64 x 8 programs do best unsplit (the merge costs more).
    (`num_kv_heads` counts programs per request: a group split over several programs counts each.)"""
    if not meta.is_decode:
        return 1
    programs = meta.num_requests * num_kv_heads
    wanted = -(-2 * (num_sms(device) or 1) // programs)
    splits = min(wanted, max(1, meta.max_context // 256), MAX_SPLITS)
    return 1 << (splits.bit_length() - 1) if splits > 1 else 1
