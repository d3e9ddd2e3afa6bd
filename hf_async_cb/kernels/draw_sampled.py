"""Sampled rows on the GPU without a sort or any [S, V] temporary: `sampling.sample` in kernels.

The torch sampler sorts every row and builds the hash noise with a dozen int64 tensor ops over
[S, V]; at 64 rows of a 128K vocabulary that was 2.2 ms of a 1.5 ms 1B decode step. A search by one
program per row (bisection passes over the row, then a sort) still took ~0.43 ms at 64 rows: 64
programs on 132 SMs, ~10 serial passes each, compute-bound (a pass costs ~50 ops per score). So the
search is spread over every SM and reads each row three times, cheaply; six launches, static grids
(steps 1-3 and the per-row search are in kernels/sampling_threshold.py):

1. `_top_kernel`, rows cut into parts (as draw_greedy.py): per part the largest logit and the first
   NaN. Rows without top-k/top-p/min-p skip steps 1-4 (their programs return at once).
2. `_ladder_kernel`, per part: for 16 fixed thresholds below the top scaled score (0 .. 14 below,
   and -inf) the count of scores at or above each and, for top-p, their mass sum(exp(score - top)).
   The logits are compared unscaled against exact floors (`_x_floor`: x >= floor exactly when
   x / t >= threshold), sixteen counters per lane. Counts are integers and the parts' sums are
   merged in a fixed order, so every run gives the same bits (no atomics anywhere).
3. `_gather_kernel`, per part: from the merged ladder, the highest threshold the cut cannot be
   below (top-k: the k-th largest is at or above it; top-p alone: the mass at or above it reaches
   top_p of the total); if at most GATHER scores are at or above it, each part writes its ones (and
   their columns) at its offset (the counts of the parts before it): the row's top scores in column
   order, typically a few thousand.
4. `_resolve_kernel`, one program per row: the exact threshold (`sampling.keep_threshold`: an
   element's key, whatever the ties) by the bisection + sort search, now over the gathered scores
   only; top-p's total is the ladder's (all the row) unless top-k sets it. Every kept score was
   gathered, so the row is drawn there too (Gumbel noise on the gathered columns, ties to the
   lowest id) and marked done. A row with too many scores above its threshold (a wide run of ties,
   a large k) is searched over the whole row as before (slow, exact), or takes the top as its
   edge when the threshold is the top score, and is drawn by step 5.
5. `_draw_parts_kernel` (rows not done): per part the best kept score + Gumbel noise, its token
   and score, and the kept mass (online max / sum of exp).
6. `_draw_merge_kernel`: merges the parts (ties to the lowest token id, as torch.argmax), or takes
   a done row's draw, and writes `sampling.pack`'s [2, S] layout: token ids, then float64
   log-probabilities' bits.

Noise is `sampling.gumbel_noise` bit for bit (the same 48 hashed bits per token); only the float
rounding of exp/log and sums may differ from the torch reference, so a token can differ only at
a near-tie. Greedy rows (do_sample 0) take the plain argmax and its log-softmax, so one step
serves mixed batches. Rows without a seed are not handled here (the caller uses the torch path).
As the torch sampler: a sampled row with NaN or +inf scores, or nothing kept above -inf, gets
sampling.INVALID_TOKEN and a NaN log-probability (a flag, no sync); a greedy row with NaN takes its
first NaN, as torch.argmax does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_async_cb.kernels.draw_greedy import (  # the draw cuts rows into parts, as greedy
    BLOCK,
    merged_exp_sum,
    online_exp_sum,
    split_rows,
)
from hf_async_cb.kernels.sampling_threshold import (  # noqa: F401 (_x_floor: tests)
    _MAX_PARTS,
    _ROW_POINTERS,
    _gather_kernel,
    _ladder_kernel,
    _row_setup,
    _scaled,
    _score_key,
    _search,
    _top_kernel,
    _window,
    _x_floor,
)
from hf_async_cb.kernels.variant import Variant
from hf_async_cb.sampling.sampler import INVALID_TOKEN, SamplingTensors

LADDER = 16  # thresholds per row in the one counting pass (see _ladder)
LADDER_BLOCK, LADDER_WARPS = 512, 8  # [LADDER_BLOCK, LADDER] counters per program
GATHER_BLOCK, GATHER_WARPS = 1024, 4
GATHER = 16384  # scores gathered per row at most: a row with more is searched in place (slow, exact)
CPU_GATHER = 256  # the interpreter's
# The per-row search over the gathered scores (and the fallback over the row): one program per
# row, wide steps and many warps keep enough loads in flight (benchmarks/gpu_sampling.py --sweep).
CUT_BLOCK, CUT_WARPS = 1024, 8
CAP = 512  # the search stops once this few scores are left around the edge, and sorts them
CPU_CAP = 32  # the interpreter's (its sort is slow; more search rounds over a small vocabulary are not)


# Per-row parameters are views into the step's packed upload, and per-row and per-part results views
# into shared buffers, at offsets that change with the row count: specialising on their alignment
# would compile new variants mid-run (they are scalar loads and stores, or masked loads of parts).
_ROW_RESULTS = ["cut_ptr", "done_ptr", "done_token_ptr", "done_logprob_ptr"]
_PART_RESULTS = ["value_ptr", "token_ptr", "nan_ptr", "score_ptr", "max_ptr", "sum_ptr"]
_CUT_POINTERS = _ROW_POINTERS + ["seed_ptr", "index_ptr", "cnt_ptr", "mass_ptr"] + _ROW_RESULTS
_DRAW_POINTERS = ["temperature_ptr", "do_sample_ptr", "seed_ptr", "index_ptr", "cut_ptr", "done_ptr"] + _PART_RESULTS
_MERGE_POINTERS = _PART_RESULTS + ["do_sample_ptr", "tokens_ptr", "logprobs_ptr"] + _ROW_RESULTS[1:]

@triton.jit
def _fmix32(x):
    """MurmurHash3's 32-bit finaliser (uint32), as sampling._fmix32."""
    x = x ^ (x >> 16)
    x = x * 0x85EBCA6B
    x = x ^ (x >> 13)
    x = x * 0xC2B2AE35
    return x ^ (x >> 16)


@triton.jit
def _row_keys(seed, index):
    """sampling.row_keys for one row: two uint32 keys from a SplitMix64 mix of (seed, index)."""
    x = seed.to(tl.uint64, bitcast=True) * 0x9E3779B97F4A7C15 + index.to(tl.uint64, bitcast=True) * 0x94D049BB133111EB
    x = x + 0x9E3779B97F4A7C15
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB
    x = x ^ (x >> 31)
    return (x & 0xFFFFFFFF).to(tl.uint32), (x >> 32).to(tl.uint32)



@triton.jit
def _fraction(high, low):
    """sampling._fraction: (high + (low + 0.5) * 2**-24) * 2**-24 in float32."""
    frac = low.to(tl.float32) * 5.9604644775390625e-08 + 2.98023223876953125e-08  # 2**-24, 2**-25
    return (high.to(tl.float32) + frac) * 5.9604644775390625e-08


@triton.jit
def _gumbel(cols, k1, k2):
    """sampling.gumbel_noise at the columns cols of a row with keys (k1, k2): 48 hashed bits, u and
    v = 1 - u each from the integers, -log(u) as the series of -log1p(-v) where v < 1/8."""
    c = cols.to(tl.uint32)
    high = _fmix32(_fmix32(c ^ k1) ^ k2) >> 8
    low = _fmix32(_fmix32(c ^ (k2 ^ 0x9E3779B9)) ^ k1) >> 8  # sampling._SECOND_HASH
    u = _fraction(high, low)
    v = _fraction(0xFFFFFF - high, 0xFFFFFF - low)
    series = 0.125
    series = series * v + 0.14285714285714285
    series = series * v + 0.16666666666666666
    series = series * v + 0.2
    series = series * v + 0.25
    series = series * v + 0.3333333333333333
    series = series * v + 0.5
    series = (series * v + 1.0) * v
    return -tl.log(tl.where(v < 0.125, series, -tl.log(u)))


@triton.jit(do_not_specialize=["num_parts"], do_not_specialize_on_alignment=_CUT_POINTERS)
def _resolve_kernel(logits_ptr, stride_row, vocab, num_parts, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr,
                    do_sample_ptr, seed_ptr, index_ptr, top_ptr, nan_ptr, cnt_ptr, mass_ptr, score_ptr, col_ptr,
                    cand_ptr, cut_ptr, done_ptr, done_token_ptr, done_logprob_ptr, L: tl.constexpr,
                    GATHER: tl.constexpr, CAP: tl.constexpr, BLOCK: tl.constexpr):
    """Per row: the threshold key (exact, searched among the gathered scores, else in the row), and
    for a row whose kept scores were all gathered, its draw and log-probability (done)."""
    row = tl.program_id(0)
    temperature, top_k, top_p, use_k, use_p, top, clean, searched = _row_setup(
        temperature_ptr, top_k_ptr, top_p_ptr, do_sample_ptr, top_ptr, nan_ptr, row, vocab, num_parts)
    min_p = tl.load(min_p_ptr + row)
    use_min = (tl.load(do_sample_ptr + row) != 0) & (min_p > 0.0)
    cand_ptr += row.to(tl.int64) * CAP
    score_ptr += row.to(tl.int64) * GATHER
    col_ptr += row.to(tl.int64) * GATHER
    cut = tl.full([], -2147483648, tl.int64)
    done = tl.zeros([], tl.int32)
    n = tl.zeros([], tl.int32)
    if searched:
        jlo, n, floor, total = _window(cnt_ptr, mass_ptr, row, top, top_k, top_p, use_k, num_parts, L)
        if n <= GATHER:  # every score the row keeps is gathered, with the ones around its edge
            cut = _search(score_ptr, n, temperature, top_k, top_p, use_k, use_p, tl.where(use_k, -1.0, total), cand_ptr,
                          CAP, BLOCK)
            done = tl.full([], 1, tl.int32)
        elif jlo == 0:  # the k-th largest or the top-p edge is the top score
            cut = _score_key(top).to(tl.int64)
        else:  # too many scores to gather (e.g. a wide run of ties): the search over the whole row
            base = logits_ptr + row.to(tl.int64) * stride_row
            cut = _search(base, vocab, temperature, top_k, top_p, use_k, use_p, tl.full([], -1.0, tl.float32),
                          cand_ptr, CAP, BLOCK)
    if use_min:  # after top-p, as stock: the ratio to the most likely token, which every filter keeps
        cut = tl.maximum(cut, _score_key(top + tl.log(min_p)).to(tl.int64))
    tl.store(cut_ptr + row, cut.to(tl.int32))
    tl.store(done_ptr + row, done)
    if done != 0:
        # The draw among the gathered scores: they are in column order, so each lane meets its columns
        # in increasing order and keeps its first maximum (ties to the lowest token id, as torch.argmax).
        k1, k2 = _row_keys(tl.load(seed_ptr + row), tl.load(index_ptr + row))
        cut32 = cut.to(tl.int32)
        lanes = tl.arange(0, BLOCK)
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        token = tl.zeros([BLOCK], tl.int32) + vocab
        score = tl.full([BLOCK], float("-inf"), tl.float32)
        mass = tl.zeros([BLOCK], tl.float32)
        for off in range(0, n, BLOCK):
            at = off + lanes
            valid = at < n
            s = _scaled(score_ptr, at, valid, temperature)
            cols = tl.load(col_ptr + at, mask=valid, other=0)
            s = tl.where(valid & (_score_key(s) >= cut32), s, float("-inf"))
            value = s + _gumbel(cols, k1, k2)
            better = value > best
            token = tl.where(better, cols, token)
            score = tl.where(better, s, score)
            best = tl.where(better, value, best)
            mass += tl.exp(s - top)
        drawn = tl.max(best, 0)
        first = tl.min(tl.where(best == drawn, token, vocab), 0)
        chosen = tl.max(tl.where(token == first, score, float("-inf")), 0)
        tl.store(done_token_ptr + row, first)
        tl.store(done_logprob_ptr + row, chosen - top - tl.log(tl.sum(mass, 0)))


@triton.jit(do_not_specialize=["num_parts"], do_not_specialize_on_alignment=_DRAW_POINTERS)
def _draw_parts_kernel(logits_ptr, stride_row, vocab, chunk, num_parts, temperature_ptr, do_sample_ptr, seed_ptr,
                       index_ptr, cut_ptr, done_ptr, value_ptr, token_ptr, nan_ptr, score_ptr, max_ptr, sum_ptr,
                       BLOCK: tl.constexpr):
    row = tl.program_id(0)
    part = tl.program_id(1)
    if tl.load(done_ptr + row) == 0:  # (a row drawn among its gathered scores is done)
        start = part * chunk
        stop = tl.minimum(start + chunk, vocab)
        lanes = tl.arange(0, BLOCK)
        base = logits_ptr + row.to(tl.int64) * stride_row
        temperature = tl.load(temperature_ptr + row)
        sampled = tl.load(do_sample_ptr + row) != 0
        cut = tl.load(cut_ptr + row)
        k1, k2 = _row_keys(tl.load(seed_ptr + row), tl.load(index_ptr + row))
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        token = tl.zeros([BLOCK], tl.int32)
        score = tl.full([BLOCK], float("-inf"), tl.float32)
        m = tl.full([BLOCK], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK], tl.float32)
        nan_at = tl.zeros([BLOCK], tl.int32) + vocab  # each lane's first NaN column (checked before the cut)
        for off in range(start, stop, BLOCK):
            cols = off + lanes
            s = _scaled(base, cols, cols < stop, temperature)
            nan_at = tl.minimum(nan_at, tl.where(s != s, cols, vocab))
            s = tl.where(_score_key(s) >= cut, s, float("-inf"))
            value = s + tl.where(sampled, _gumbel(cols, k1, k2), 0.0)
            better = value > best  # strictly: each lane keeps its first maximum
            token = tl.where(better, cols, token)
            score = tl.where(better, s, score)
            best = tl.where(better, value, best)
            m, total = online_exp_sum(m, total, s)
        top = tl.max(best, 0)
        first = tl.min(tl.where(best == top, token, vocab), 0)
        part_max, part_sum, _ = merged_exp_sum(m, total)
        out = row * num_parts + part
        tl.store(value_ptr + out, top)
        tl.store(token_ptr + out, first)
        tl.store(nan_ptr + out, tl.min(nan_at, 0))
        tl.store(score_ptr + out, tl.max(tl.where(token == first, score, float("-inf")), 0))
        tl.store(max_ptr + out, part_max)
        tl.store(sum_ptr + out, part_sum)


@triton.jit(do_not_specialize=["num_parts"], do_not_specialize_on_alignment=_MERGE_POINTERS)
def _draw_merge_kernel(value_ptr, token_ptr, nan_ptr, score_ptr, max_ptr, sum_ptr, do_sample_ptr, done_ptr,
                       done_token_ptr, done_logprob_ptr, tokens_ptr, logprobs_ptr, vocab, num_parts,
                       INVALID: tl.constexpr):
    row = tl.program_id(0)
    if tl.load(done_ptr + row) != 0:
        tl.store(tokens_ptr + row, tl.load(done_token_ptr + row).to(tl.int64))
        tl.store(logprobs_ptr + row, tl.load(done_logprob_ptr + row).to(tl.float64))
    else:
        lanes = tl.arange(0, _MAX_PARTS)
        ours = lanes < num_parts
        parts = row * num_parts + lanes
        value = tl.load(value_ptr + parts, mask=ours, other=float("-inf"))
        token = tl.load(token_ptr + parts, mask=ours, other=vocab)
        top = tl.max(value, 0)
        first = tl.min(tl.where(value == top, token, vocab), 0)
        score = tl.max(tl.where(token == first, tl.load(score_ptr + parts, mask=ours, other=float("-inf")),
                                float("-inf")), 0)
        _, total, shift = merged_exp_sum(tl.load(max_ptr + parts, mask=ours, other=float("-inf")),
                                         tl.load(sum_ptr + parts, mask=ours, other=0.0))
        first = tl.where(first == vocab, 0, first)  # a row of -inf only: index 0, as torch.argmax
        logprob = score - shift - tl.log(total)
        first_nan = tl.min(tl.load(nan_ptr + parts, mask=ours, other=vocab), 0)
        has_nan = first_nan < vocab
        # Sampled: no distribution to draw from (the top kept score is never a NaN: NaN > x is false).
        invalid = (tl.load(do_sample_ptr + row) != 0) & (has_nan | (top == float("-inf")) | (score == float("inf")))
        first = tl.where(has_nan, first_nan, first)  # greedy: the first NaN, as torch.argmax
        first = tl.where(invalid, INVALID, first)
        logprob = tl.where(has_nan | invalid, float("nan"), logprob)
        tl.store(tokens_ptr + row, first.to(tl.int64))
        tl.store(logprobs_ptr + row, logprob.to(tl.float64))


def sampled_packed(logits: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
    """logits [S, V] (any float dtype) -> [2, S] int64 as sampling.pack(*sampling.sample(...)).

    Every sampled row must have a seed (params.unseeded False); greedy rows may be mixed in."""
    return _sampled_packed(logits, params)


def _sampled_packed(logits: torch.Tensor, params: SamplingTensors, gather: int | None = None,
                    cap: int | None = None) -> torch.Tensor:
    """sampled_packed with the gathered scores' and the sort's sizes (tests make them small)."""
    if params.unseeded:
        raise ValueError("sampled_packed draws seeded rows only; use sampling.sample for rows without a seed.")
    rows, vocab = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    device = logits.device
    out = torch.empty(2, rows, dtype=torch.int64, device=device)
    if rows == 0:
        return out
    parts, chunk = split_rows(rows, vocab, device)
    stride, p = logits.stride(0), params
    cut, done, done_token, done_logprob = _cut(logits, params, parts, chunk, gather, cap)
    partial = torch.empty(4, rows * parts, dtype=torch.float32, device=device)
    token = torch.empty(2, rows * parts, dtype=torch.int32, device=device)  # drawn, first NaN
    _draw_parts_kernel[(rows, parts)](logits, stride, vocab, chunk, parts, p.temperature, p.do_sample, p.seed,
                                      p.token_index, cut, done, partial[0], token[0], token[1], partial[1],
                                      partial[2], partial[3], BLOCK=BLOCK)
    _draw_merge_kernel[(rows,)](partial[0], token[0], token[1], partial[1], partial[2], partial[3], p.do_sample,
                                done, done_token, done_logprob, out[0], out[1].view(torch.float64), vocab, parts,
                                INVALID=INVALID_TOKEN)
    return out


def _sizes(device: torch.device, gather: int | None = None, cap: int | None = None) -> tuple[int, int]:
    """(GATHER, CAP) on `device`: the GPU's, or the interpreter's small ones; tests give their own."""
    return gather or (GATHER if device.type == "cuda" else CPU_GATHER), cap or (CAP if device.type == "cuda" else CPU_CAP)


def _cut(logits: torch.Tensor, params: SamplingTensors, parts: int, chunk: int, gather: int | None = None,
         cap: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The threshold search (four launches): per row the threshold key, whether the row is drawn
    already (done), and then its token and log-probability."""
    rows, vocab = logits.shape
    device = logits.device
    gather, cap = _sizes(device, gather, cap)
    stride, p = logits.stride(0), params
    top = torch.empty(rows * parts, dtype=torch.float32, device=device)
    ints = torch.empty(3, rows, dtype=torch.int32, device=device)  # cut, done, done token
    nan = torch.empty(rows * parts, dtype=torch.int32, device=device)
    count = torch.empty(rows * parts * LADDER, dtype=torch.int32, device=device)
    mass = torch.empty(rows * parts * LADDER, dtype=torch.float32, device=device)
    scores = torch.empty(rows, gather, dtype=logits.dtype, device=device)  # (copies of logits: no rounding)
    cols = torch.empty(rows, gather, dtype=torch.int32, device=device)
    candidates = torch.empty(rows, cap, dtype=torch.float32, device=device)
    done_logprob = torch.empty(rows, dtype=torch.float32, device=device)
    cut, done, done_token = ints[0], ints[1], ints[2]
    _top_kernel[(rows, parts)](logits, stride, vocab, chunk, parts, p.top_k, p.top_p, p.min_p, p.do_sample, top, nan,
                               BLOCK=BLOCK)
    _ladder_kernel[(rows, parts)](logits, stride, vocab, chunk, parts, p.temperature, p.top_k, p.top_p, p.do_sample,
                                  top, nan, count, mass, L=LADDER, BLOCK=LADDER_BLOCK, num_warps=LADDER_WARPS)
    _gather_kernel[(rows, parts)](logits, stride, vocab, chunk, parts, p.temperature, p.top_k, p.top_p, p.do_sample,
                                  top, nan, count, mass, scores, cols, L=LADDER, GATHER=gather, BLOCK=GATHER_BLOCK,
                                  num_warps=GATHER_WARPS)
    _resolve_kernel[(rows,)](logits, stride, vocab, parts, p.temperature, p.top_k, p.top_p, p.min_p, p.do_sample,
                             p.seed, p.token_index, top, nan, count, mass, scores, cols, candidates, cut, done,
                             done_token, done_logprob, L=LADDER, GATHER=gather, CAP=cap, BLOCK=CUT_BLOCK,
                             num_warps=CUT_WARPS)
    return cut, done, done_token, done_logprob


def variants(logits_dtype: torch.dtype, vocab: int, stride_row: int, device: torch.device) -> list[Variant]:
    """The kernels' compiled variants for logits of this dtype, width and row stride on `device`:
    one each, whatever the rows (their parts are a runtime count). Arguments as _sampled_packed
    passes them (pointers by dtype; chunk is a multiple of BLOCK)."""
    f32, i32, i64, f64 = torch.float32, torch.int32, torch.int64, torch.float64  # SamplingTensors' dtypes too
    gather, cap = _sizes(device)
    rows = (logits_dtype, stride_row, vocab)
    return [
        Variant(_top_kernel, (*rows, BLOCK, 2, i64, f32, f32, f32, f32, i32), dict(BLOCK=BLOCK)),
        Variant(_ladder_kernel, (*rows, BLOCK, 2, f32, i64, f32, f32, f32, i32, i32, f32),
                dict(L=LADDER, BLOCK=LADDER_BLOCK), dict(num_warps=LADDER_WARPS)),
        Variant(_gather_kernel, (*rows, BLOCK, 2, f32, i64, f32, f32, f32, i32, i32, f32, logits_dtype, i32),
                dict(L=LADDER, GATHER=gather, BLOCK=GATHER_BLOCK), dict(num_warps=GATHER_WARPS)),
        Variant(_resolve_kernel, (*rows, 2, f32, i64, f32, f32, f32, i64, i64, f32, i32, i32, f32, logits_dtype, i32,
                                  f32, i32, i32, i32, f32),
                dict(L=LADDER, GATHER=gather, CAP=cap, BLOCK=CUT_BLOCK), dict(num_warps=CUT_WARPS)),
        Variant(_draw_parts_kernel, (*rows, BLOCK, 2, f32, f32, i64, i64, i32, i32, f32, i32, i32, f32, f32, f32),
                dict(BLOCK=BLOCK)),
        Variant(_draw_merge_kernel, (f32, i32, i32, f32, f32, f32, f32, i32, i32, f32, i64, f64, vocab, 2),
                dict(INVALID=INVALID_TOKEN)),
    ]
