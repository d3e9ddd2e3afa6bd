"""Sampled rows on the GPU without a sort or any [S, V] temporary: `sampling.sample` in kernels.

The torch sampler sorts every row and builds the hash noise with a dozen int64 tensor ops over
[S, V]; at 64 rows of a 128K vocabulary that was 2.2 ms of a 1.5 ms 1B decode step. A search by one
program per row (bisection passes over the row, then a sort) still took ~0.43 ms at 64 rows: 64
programs on 132 SMs, ~10 serial passes each, compute-bound (a pass costs ~50 ops per score). So the
search is spread over every SM and reads each row three times, cheaply; six launches, static grids:

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

Noise is `sampling.gumbel_noise` bit for bit (the same 24 hashed bits per token); only the float
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


# Per-row parameters are views into the step's packed upload, at offsets that change from step to
# step: specialising on their alignment would compile new variants mid-run (they are scalar loads).
_CUT_POINTERS = ["temperature_ptr", "top_k_ptr", "top_p_ptr", "min_p_ptr", "do_sample_ptr"]
_DRAW_POINTERS = ["temperature_ptr", "do_sample_ptr", "seed_ptr", "index_ptr"]

@triton.jit
def _score_key(s):
    """Order-preserving int32 key of float32 scores; -0.0 and +0.0 share the key 0."""
    bits = s.to(tl.int32, bitcast=True)
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return tl.where(s == 0.0, 0, key)


@triton.jit
def _scaled(base, cols, mask, temperature):
    """The row's scores at cols, scaled by temperature (IEEE division, as torch's)."""
    x = tl.load(base + cols, mask=mask, other=float("-inf")).to(tl.float32)
    return tl.math.div_rn(x, tl.zeros_like(x) + temperature)


@triton.jit
def _key_score(key):
    """The float32 score of a key (the inverse of _score_key)."""
    key = key.to(tl.int32)
    return tl.where(key < 0, key ^ 0x7FFFFFFF, key).to(tl.float32, bitcast=True)


@triton.jit
def _midpoint(lo, hi):
    """A key strictly inside (lo, hi): that of the scores' midpoint (halving the score range empties
    a dense bracket far faster than halving the key range, whose first halvings only split signs
    and exponents), or the keys' midpoint where a bound is no finite score."""
    s_lo = _key_score(lo)
    s_hi = _key_score(hi)
    finite = (tl.abs(s_lo) < float("inf")) & (tl.abs(s_hi) < float("inf"))
    guess = _score_key(tl.where(finite, s_lo, 0.0) * 0.5 + tl.where(finite, s_hi, 0.0) * 0.5).to(tl.int64)
    guess = tl.minimum(tl.maximum(guess, lo + 1), hi - 1)
    return tl.where(finite, guess, lo + (hi - lo) // 2)


@triton.jit
def _tally(base, vocab, temperature, floor32, mid32, top, WEIGHTED: tl.constexpr, BLOCK: tl.constexpr):
    """One pass over the row, among keys >= floor: count(key >= mid), count(key > mid) and, when
    WEIGHTED, the mass sum(exp(score - top)) of each of those two sets."""
    lanes = tl.arange(0, BLOCK)
    at_least = tl.zeros([BLOCK], tl.int32)
    above = tl.zeros([BLOCK], tl.int32)
    from_mass = tl.zeros([BLOCK], tl.float32)
    above_mass = tl.zeros([BLOCK], tl.float32)
    for off in range(0, vocab, BLOCK):
        cols = off + lanes
        valid = cols < vocab
        s = _scaled(base, cols, valid, temperature)
        key = _score_key(s)
        kept = valid & (key >= floor32)
        at_least += (kept & (key >= mid32)).to(tl.int32)
        above += (kept & (key > mid32)).to(tl.int32)
        if WEIGHTED:
            weight = tl.where(kept & (key >= mid32), tl.exp(s - top), 0.0)
            from_mass += weight
            above_mass += tl.where(key > mid32, weight, 0.0)
    return (tl.sum(at_least, 0).to(tl.int64), tl.sum(above, 0).to(tl.int64), tl.sum(from_mass, 0),
            tl.sum(above_mass, 0))


@triton.jit
def _bracket_sorted(base, vocab, temperature, floor, lo, hi, cand_ptr, CAP: tl.constexpr, BLOCK: tl.constexpr):
    """The scores whose key k has floor <= k and lo < k < hi (at most CAP of them: the caller's
    search stops there), in descending order, padded with -inf; and their number."""
    lanes = tl.arange(0, BLOCK)
    floor32 = floor.to(tl.int32)
    lo32 = lo.to(tl.int32)
    hi32 = hi.to(tl.int32)
    n = tl.zeros([], tl.int32)
    for off in range(0, vocab, BLOCK):
        cols = off + lanes
        valid = cols < vocab
        s = _scaled(base, cols, valid, temperature)
        key = _score_key(s)
        take = (valid & (key >= floor32) & (key > lo32) & (key < hi32)).to(tl.int32)
        at = n + tl.cumsum(take, 0) - take
        tl.store(cand_ptr + at, s, mask=(take != 0) & (at < CAP))
        n += tl.sum(take, 0)
    tl.debug_barrier()  # the stores above, by every thread, before the loads below
    slots = tl.arange(0, CAP)
    ranked = tl.load(cand_ptr + slots, mask=slots < n, other=float("-inf"))
    return tl.sort(ranked, descending=True), n


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
def _search(base, vocab, temperature, top_k, top_p, use_k, use_p, total_in, cand_ptr, CAP: tl.constexpr,
            BLOCK: tl.constexpr):
    """The top-k / top-p threshold key of `vocab` scores at base (scaled by temperature), searched by one
    program: for the k-th largest score and the top-p edge, each round is one pass counting (for top-p
    also summing exp) above the midpoint of the score range left; once at most CAP scores lie strictly
    between the bounds, one more pass gathers them into cand_ptr and a sort in registers settles the
    edge: exact (an element's key), whatever the tie pattern. total_in >= 0: top-p's total mass, for
    scores that are the top of a longer row (else the mass of these scores, at or above top-k's)."""
    lanes = tl.arange(0, BLOCK)
    slots = tl.arange(0, CAP)
    top_vec = tl.full([BLOCK], float("-inf"), tl.float32)
    bottom_vec = tl.full([BLOCK], float("inf"), tl.float32)
    for off in range(0, vocab, BLOCK):
        cols = off + lanes
        valid = cols < vocab
        s = _scaled(base, cols, valid, temperature)
        top_vec = tl.maximum(top_vec, s)
        bottom_vec = tl.minimum(bottom_vec, tl.where(valid, s, float("inf")))
    top = tl.max(top_vec, 0)
    top_key = _score_key(top).to(tl.int64)
    kth = _score_key(tl.min(bottom_vec, 0)).to(tl.int64)  # top-k's threshold; without it, keep all
    if use_k:
        # Bracket the k-th largest key: count(key >= lo) >= k > count(key >= hi), until at most
        # CAP keys lie strictly between; then it is the (k - count(key >= hi))-th of those.
        everything = tl.full([], -2147483648, tl.int32)  # no floor: top-k looks at all the scores
        lo = kth
        hi = top_key + 1
        above_lo = tl.full([], 0, tl.int64) + vocab  # count(key > lo), at most
        from_hi = tl.full([], 0, tl.int64)  # count(key >= hi)
        while (hi - lo > 1) & (above_lo - from_hi > CAP):
            mid = _midpoint(lo, hi)
            count, above, _, _ = _tally(base, vocab, temperature, everything, mid.to(tl.int32), top, False, BLOCK)
            if count >= top_k:
                lo = mid
                above_lo = above
            else:
                hi = mid
                from_hi = count
        ranked, n = _bracket_sorted(base, vocab, temperature, everything, lo, hi, cand_ptr, CAP, BLOCK)
        rank = top_k - from_hi  # >= 1
        inside = tl.max(tl.where(slots == rank - 1, ranked, float("-inf")), 0)
        kth = tl.where(rank <= n, _score_key(inside).to(tl.int64), lo)  # else: the keys equal to lo
    cut = kth
    if use_p:
        # Bracket the smallest key whose mass strictly above (in top-k's set) is < top_p of the
        # set's: mass(key > lo) >= target > mass(key > hi), until at most CAP keys lie between.
        floor32 = kth.to(tl.int32)
        above_lo, _, total, _ = _tally(base, vocab, temperature, floor32, floor32, top, True, BLOCK)
        target = top_p * tl.where(total_in >= 0.0, total_in, total)
        lo = kth - 1  # count(key > lo) in the set: above_lo
        hi = top_key + 1
        from_hi = tl.full([], 0, tl.int64)  # count(key >= hi)
        mass_hi = tl.zeros([], tl.float32)  # mass(key >= hi)
        while (hi - lo > 1) & (above_lo - from_hi > CAP):
            mid = _midpoint(lo, hi)
            at_least, above, from_mass, above_mass = _tally(base, vocab, temperature, floor32, mid.to(tl.int32),
                                                            top, True, BLOCK)
            if above_mass < target:
                hi = mid
                from_hi = at_least
                mass_hi = from_mass
            else:
                lo = mid
                above_lo = above
        ranked, n = _bracket_sorted(base, vocab, temperature, kth, lo, hi, cand_ptr, CAP, BLOCK)
        weight = tl.exp(ranked - top)  # the -inf padding weighs 0
        mass_above = mass_hi + tl.cumsum(weight, 0) - weight  # exact for the first of a run of ties
        kept = tl.sum(((mass_above < target) & (slots < n)).to(tl.int32), 0)
        edge = tl.max(tl.where(slots == kept - 1, ranked, float("-inf")), 0)
        cut = tl.maximum(cut, tl.where(kept > 0, _score_key(edge).to(tl.int64), hi))
    return cut


@triton.jit
def _ladder(top, L: tl.constexpr):
    """The ladder's L (16) thresholds, descending: the top score, then 0.5 .. 2 below it in steps of
    0.5, 3 .. 10 below in steps of 1, 11.5 and 14 below, and -inf (every score)."""
    j = tl.arange(0, L)
    gap = tl.where(j <= 4, j * 0.5, (j - 2).to(tl.float32))
    gap = tl.where(j == 13, 11.5, tl.where(j == 14, 14.0, gap))
    return tl.where(j == L - 1, float("-inf"), top - gap)


@triton.jit
def _row_setup(temperature_ptr, top_k_ptr, top_p_ptr, do_sample_ptr, top_ptr, nan_ptr, row, vocab,
               NUM_PARTS: tl.constexpr):
    """The row's parameters and flags, its top scaled score (merged from the parts of _top_kernel, in
    a fixed order) and whether its threshold is searched with the ladder (finite top, no NaN)."""
    temperature = tl.load(temperature_ptr + row)
    top_k = tl.load(top_k_ptr + row)
    top_p = tl.load(top_p_ptr + row)
    sampled = tl.load(do_sample_ptr + row) != 0
    use_k = sampled & (top_k > 0) & (top_k < vocab)
    use_p = sampled & (top_p < 1.0)
    parts = row * NUM_PARTS + tl.arange(0, NUM_PARTS)
    top_x = tl.max(tl.load(top_ptr + parts), 0)
    clean = tl.min(tl.load(nan_ptr + parts), 0) == vocab
    top = tl.math.div_rn(top_x, temperature)  # division by t > 0 keeps the order: the top scaled score
    searched = (use_k | use_p) & clean & (tl.abs(top) < float("inf"))
    return temperature, top_k, top_p, use_k, use_p, top, clean, searched


@triton.jit
def _window(cnt_ptr, mass_ptr, row, top, top_k, top_p, use_k, NUM_PARTS: tl.constexpr, L: tl.constexpr):
    """From the ladder's counts and masses (parts merged in a fixed order): the ladder step jlo whose
    threshold the row's cut is at or above (top-k's k-th largest score; without top-k, top-p's edge:
    the mass at or above it is >= top_p of the total, so nothing lower is kept), the number of
    scores at or above it, that threshold, and the row's total mass."""
    j = tl.arange(0, L)
    at = (row * NUM_PARTS + tl.arange(0, NUM_PARTS))[:, None] * L + j[None, :]
    count = tl.sum(tl.load(cnt_ptr + at), 0)
    mass = tl.sum(tl.load(mass_ptr + at), 0)
    total = tl.max(tl.where(j == L - 1, mass, float("-inf")), 0)
    jk = tl.min(tl.where(count >= top_k, j, L - 1), 0)
    jp = tl.min(tl.where(mass >= top_p * total, j, L - 1), 0)
    jlo = tl.where(use_k, jk, jp)
    n = tl.sum(tl.where(j == jlo, count, 0), 0)
    floor = tl.max(tl.where(j == jlo, _ladder(top, L), float("-inf")), 0)
    return jlo, n, floor, total


@triton.jit(do_not_specialize_on_alignment=["top_k_ptr", "top_p_ptr", "min_p_ptr", "do_sample_ptr"])
def _top_kernel(logits_ptr, stride_row, vocab, chunk, top_k_ptr, top_p_ptr, min_p_ptr, do_sample_ptr, top_ptr,
                nan_ptr, NUM_PARTS: tl.constexpr, BLOCK: tl.constexpr):
    """Per part of a filtered row: the largest logit and the first NaN's column (vocab if none)."""
    row = tl.program_id(0)
    part = tl.program_id(1)
    sampled = tl.load(do_sample_ptr + row) != 0
    top_k = tl.load(top_k_ptr + row)
    filtered = sampled & (((top_k > 0) & (top_k < vocab)) | (tl.load(top_p_ptr + row) < 1.0) |
                          (tl.load(min_p_ptr + row) > 0.0))
    top = tl.full([BLOCK], float("-inf"), tl.float32)
    nan_at = tl.zeros([BLOCK], tl.int32) + vocab
    if filtered:
        start = part * chunk
        stop = tl.minimum(start + chunk, vocab)
        lanes = tl.arange(0, BLOCK)
        base = logits_ptr + row.to(tl.int64) * stride_row
        for off in range(start, stop, BLOCK):
            cols = off + lanes
            x = tl.load(base + cols, mask=cols < stop, other=float("-inf")).to(tl.float32)
            nan_at = tl.minimum(nan_at, tl.where(x != x, cols, vocab))
            top = tl.maximum(top, x)
    tl.store(top_ptr + row * NUM_PARTS + part, tl.max(top, 0))
    tl.store(nan_ptr + row * NUM_PARTS + part, tl.min(nan_at, 0))


@triton.jit
def _x_floor(score, temperature):
    """The smallest float32 x with div_rn(x, temperature) >= score (-inf for -inf), so that
    x >= _x_floor(score) exactly when x's scaled score is >= score: the passes over the logits
    compare them unscaled. Division by t > 0 is monotone and score * t is within two ulps."""
    finite = tl.where(score == float("-inf"), 0.0, score)
    near = _score_key(finite * temperature)
    below = tl.zeros_like(near)
    for i in tl.static_range(9):
        below += (tl.math.div_rn(_key_score(near - 4 + i), temperature) < finite).to(tl.int32)
    return tl.where(score == float("-inf"), float("-inf"), _key_score(near - 4 + below))


@triton.jit
def _pick(vector, j, i):
    return tl.max(tl.where(j == i, vector, float("-inf")), 0)


@triton.jit
def _at_least(x, valid, floor, count, mass, weight, WEIGHTED: tl.constexpr):
    """count += (x >= floor) and, when WEIGHTED, mass += weight there."""
    at_least = valid & (x >= floor)
    count += at_least.to(tl.int32)
    if WEIGHTED:
        mass += tl.where(at_least, weight, 0.0)
    return count, mass


@triton.jit
def _ladder_pass(base, start, stop, temperature, top, f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15,
                 WEIGHTED: tl.constexpr, BLOCK: tl.constexpr):
    """One pass over a part: for each floor fi, count(x >= fi) and (WEIGHTED) the mass there."""
    lanes = tl.arange(0, BLOCK)
    reciprocal = 1.0 / temperature  # the weights only (rounding-level): the counts compare unscaled
    c0 = tl.zeros([BLOCK], tl.int32)
    c1 = tl.zeros([BLOCK], tl.int32)
    c2 = tl.zeros([BLOCK], tl.int32)
    c3 = tl.zeros([BLOCK], tl.int32)
    c4 = tl.zeros([BLOCK], tl.int32)
    c5 = tl.zeros([BLOCK], tl.int32)
    c6 = tl.zeros([BLOCK], tl.int32)
    c7 = tl.zeros([BLOCK], tl.int32)
    c8 = tl.zeros([BLOCK], tl.int32)
    c9 = tl.zeros([BLOCK], tl.int32)
    c10 = tl.zeros([BLOCK], tl.int32)
    c11 = tl.zeros([BLOCK], tl.int32)
    c12 = tl.zeros([BLOCK], tl.int32)
    c13 = tl.zeros([BLOCK], tl.int32)
    c14 = tl.zeros([BLOCK], tl.int32)
    c15 = tl.zeros([BLOCK], tl.int32)
    m0 = tl.zeros([BLOCK], tl.float32)
    m1 = tl.zeros([BLOCK], tl.float32)
    m2 = tl.zeros([BLOCK], tl.float32)
    m3 = tl.zeros([BLOCK], tl.float32)
    m4 = tl.zeros([BLOCK], tl.float32)
    m5 = tl.zeros([BLOCK], tl.float32)
    m6 = tl.zeros([BLOCK], tl.float32)
    m7 = tl.zeros([BLOCK], tl.float32)
    m8 = tl.zeros([BLOCK], tl.float32)
    m9 = tl.zeros([BLOCK], tl.float32)
    m10 = tl.zeros([BLOCK], tl.float32)
    m11 = tl.zeros([BLOCK], tl.float32)
    m12 = tl.zeros([BLOCK], tl.float32)
    m13 = tl.zeros([BLOCK], tl.float32)
    m14 = tl.zeros([BLOCK], tl.float32)
    m15 = tl.zeros([BLOCK], tl.float32)
    for off in range(start, stop, BLOCK):
        cols = off + lanes
        valid = cols < stop
        x = tl.load(base + cols, mask=valid, other=float("-inf")).to(tl.float32)
        weight = tl.exp(x * reciprocal - top) if WEIGHTED else x
        c0, m0 = _at_least(x, valid, f0, c0, m0, weight, WEIGHTED)
        c1, m1 = _at_least(x, valid, f1, c1, m1, weight, WEIGHTED)
        c2, m2 = _at_least(x, valid, f2, c2, m2, weight, WEIGHTED)
        c3, m3 = _at_least(x, valid, f3, c3, m3, weight, WEIGHTED)
        c4, m4 = _at_least(x, valid, f4, c4, m4, weight, WEIGHTED)
        c5, m5 = _at_least(x, valid, f5, c5, m5, weight, WEIGHTED)
        c6, m6 = _at_least(x, valid, f6, c6, m6, weight, WEIGHTED)
        c7, m7 = _at_least(x, valid, f7, c7, m7, weight, WEIGHTED)
        c8, m8 = _at_least(x, valid, f8, c8, m8, weight, WEIGHTED)
        c9, m9 = _at_least(x, valid, f9, c9, m9, weight, WEIGHTED)
        c10, m10 = _at_least(x, valid, f10, c10, m10, weight, WEIGHTED)
        c11, m11 = _at_least(x, valid, f11, c11, m11, weight, WEIGHTED)
        c12, m12 = _at_least(x, valid, f12, c12, m12, weight, WEIGHTED)
        c13, m13 = _at_least(x, valid, f13, c13, m13, weight, WEIGHTED)
        c14, m14 = _at_least(x, valid, f14, c14, m14, weight, WEIGHTED)
        c15, m15 = _at_least(x, valid, f15, c15, m15, weight, WEIGHTED)
    j = tl.arange(0, 16)
    count = tl.zeros([16], tl.int32)
    mass = tl.zeros([16], tl.float32)
    count = tl.where(j == 0, tl.sum(c0, 0), count)
    count = tl.where(j == 1, tl.sum(c1, 0), count)
    count = tl.where(j == 2, tl.sum(c2, 0), count)
    count = tl.where(j == 3, tl.sum(c3, 0), count)
    count = tl.where(j == 4, tl.sum(c4, 0), count)
    count = tl.where(j == 5, tl.sum(c5, 0), count)
    count = tl.where(j == 6, tl.sum(c6, 0), count)
    count = tl.where(j == 7, tl.sum(c7, 0), count)
    count = tl.where(j == 8, tl.sum(c8, 0), count)
    count = tl.where(j == 9, tl.sum(c9, 0), count)
    count = tl.where(j == 10, tl.sum(c10, 0), count)
    count = tl.where(j == 11, tl.sum(c11, 0), count)
    count = tl.where(j == 12, tl.sum(c12, 0), count)
    count = tl.where(j == 13, tl.sum(c13, 0), count)
    count = tl.where(j == 14, tl.sum(c14, 0), count)
    count = tl.where(j == 15, tl.sum(c15, 0), count)
    mass = tl.where(j == 0, tl.sum(m0, 0), mass)
    mass = tl.where(j == 1, tl.sum(m1, 0), mass)
    mass = tl.where(j == 2, tl.sum(m2, 0), mass)
    mass = tl.where(j == 3, tl.sum(m3, 0), mass)
    mass = tl.where(j == 4, tl.sum(m4, 0), mass)
    mass = tl.where(j == 5, tl.sum(m5, 0), mass)
    mass = tl.where(j == 6, tl.sum(m6, 0), mass)
    mass = tl.where(j == 7, tl.sum(m7, 0), mass)
    mass = tl.where(j == 8, tl.sum(m8, 0), mass)
    mass = tl.where(j == 9, tl.sum(m9, 0), mass)
    mass = tl.where(j == 10, tl.sum(m10, 0), mass)
    mass = tl.where(j == 11, tl.sum(m11, 0), mass)
    mass = tl.where(j == 12, tl.sum(m12, 0), mass)
    mass = tl.where(j == 13, tl.sum(m13, 0), mass)
    mass = tl.where(j == 14, tl.sum(m14, 0), mass)
    mass = tl.where(j == 15, tl.sum(m15, 0), mass)
    return count, mass


@triton.jit(do_not_specialize_on_alignment=["temperature_ptr", "top_k_ptr", "top_p_ptr", "do_sample_ptr"])
def _ladder_kernel(logits_ptr, stride_row, vocab, chunk, temperature_ptr, top_k_ptr, top_p_ptr, do_sample_ptr,
                   top_ptr, nan_ptr, cnt_ptr, mass_ptr, NUM_PARTS: tl.constexpr, L: tl.constexpr,
                   BLOCK: tl.constexpr):
    """Per part of a searched row, for each ladder threshold: the number of scores at or above it and
    (top-p) their mass, sum(exp(score - top)). Sixteen counters per lane, unrolled (L is 16)."""
    tl.static_assert(L == 16)
    row = tl.program_id(0)
    part = tl.program_id(1)
    temperature, top_k, top_p, use_k, use_p, top, clean, searched = _row_setup(
        temperature_ptr, top_k_ptr, top_p_ptr, do_sample_ptr, top_ptr, nan_ptr, row, vocab, NUM_PARTS)
    count = tl.zeros([L], tl.int32)
    mass = tl.zeros([L], tl.float32)
    if searched:
        floors = _x_floor(_ladder(top, L), temperature)
        j = tl.arange(0, L)
        f0 = _pick(floors, j, 0)
        f1 = _pick(floors, j, 1)
        f2 = _pick(floors, j, 2)
        f3 = _pick(floors, j, 3)
        f4 = _pick(floors, j, 4)
        f5 = _pick(floors, j, 5)
        f6 = _pick(floors, j, 6)
        f7 = _pick(floors, j, 7)
        f8 = _pick(floors, j, 8)
        f9 = _pick(floors, j, 9)
        f10 = _pick(floors, j, 10)
        f11 = _pick(floors, j, 11)
        f12 = _pick(floors, j, 12)
        f13 = _pick(floors, j, 13)
        f14 = _pick(floors, j, 14)
        f15 = _pick(floors, j, 15)
        start = part * chunk
        stop = tl.minimum(start + chunk, vocab)
        base = logits_ptr + row.to(tl.int64) * stride_row
        if use_p:
            count, mass = _ladder_pass(base, start, stop, temperature, top, f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15,
                                       True, BLOCK)
        else:
            count, mass = _ladder_pass(base, start, stop, temperature, top, f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15,
                                       False, BLOCK)
    at = (row * NUM_PARTS + part) * L + tl.arange(0, L)
    tl.store(cnt_ptr + at, count)
    tl.store(mass_ptr + at, mass)


@triton.jit(do_not_specialize_on_alignment=["temperature_ptr", "top_k_ptr", "top_p_ptr", "do_sample_ptr"])
def _gather_kernel(logits_ptr, stride_row, vocab, chunk, temperature_ptr, top_k_ptr, top_p_ptr, do_sample_ptr,
                   top_ptr, nan_ptr, cnt_ptr, mass_ptr, score_ptr, col_ptr, NUM_PARTS: tl.constexpr,
                   L: tl.constexpr, GATHER: tl.constexpr, BLOCK: tl.constexpr):
    """Per part of a searched row whose window fits GATHER: its scores at or above the window's floor,
    and their columns, at the part's offset (the counts of the parts before it), in column order."""
    row = tl.program_id(0)
    part = tl.program_id(1)
    temperature, top_k, top_p, use_k, use_p, top, clean, searched = _row_setup(
        temperature_ptr, top_k_ptr, top_p_ptr, do_sample_ptr, top_ptr, nan_ptr, row, vocab, NUM_PARTS)
    if searched:
        jlo, n, floor, _ = _window(cnt_ptr, mass_ptr, row, top, top_k, top_p, use_k, NUM_PARTS, L)
        if n <= GATHER:
            parts = tl.arange(0, NUM_PARTS)
            before = tl.load(cnt_ptr + (row * NUM_PARTS + parts) * L + jlo)
            taken = tl.sum(tl.where(parts < part, before, 0), 0)
            start = part * chunk
            stop = tl.minimum(start + chunk, vocab)
            lanes = tl.arange(0, BLOCK)
            base = logits_ptr + row.to(tl.int64) * stride_row
            out = row.to(tl.int64) * GATHER
            floor = _x_floor(floor, temperature)
            for off in range(start, stop, BLOCK):
                cols = off + lanes
                valid = cols < stop
                s = tl.load(base + cols, mask=valid, other=float("-inf")).to(tl.float32)  # unscaled
                take = (valid & (s >= floor)).to(tl.int32)
                at = taken + tl.cumsum(take, 0) - take
                keep = (take != 0) & (at < GATHER)
                tl.store(score_ptr + out + at, s, mask=keep)
                tl.store(col_ptr + out + at, cols, mask=keep)
                taken += tl.sum(take, 0)


@triton.jit
def _gumbel(cols, k1, k2):
    """sampling.gumbel_noise at the columns cols of a row with keys (k1, k2)."""
    bits = _fmix32(_fmix32(cols.to(tl.uint32) ^ k1) ^ k2) >> 8
    uniform = (bits.to(tl.float32) + 0.5) * 5.9604644775390625e-08  # 2**-24
    return -tl.log(-tl.log(uniform))


@triton.jit(do_not_specialize_on_alignment=_CUT_POINTERS + ["seed_ptr", "index_ptr"])
def _resolve_kernel(logits_ptr, stride_row, vocab, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, do_sample_ptr,
                    seed_ptr, index_ptr, top_ptr, nan_ptr, cnt_ptr, mass_ptr, score_ptr, col_ptr, cand_ptr, cut_ptr,
                    done_ptr, done_token_ptr, done_logprob_ptr, NUM_PARTS: tl.constexpr, L: tl.constexpr,
                    GATHER: tl.constexpr, CAP: tl.constexpr, BLOCK: tl.constexpr):
    """Per row: the threshold key (exact, searched among the gathered scores, else in the row), and
    for a row whose kept scores were all gathered, its draw and log-probability (done)."""
    row = tl.program_id(0)
    temperature, top_k, top_p, use_k, use_p, top, clean, searched = _row_setup(
        temperature_ptr, top_k_ptr, top_p_ptr, do_sample_ptr, top_ptr, nan_ptr, row, vocab, NUM_PARTS)
    min_p = tl.load(min_p_ptr + row)
    use_min = (tl.load(do_sample_ptr + row) != 0) & (min_p > 0.0)
    cand_ptr += row.to(tl.int64) * CAP
    score_ptr += row.to(tl.int64) * GATHER
    col_ptr += row.to(tl.int64) * GATHER
    cut = tl.full([], -2147483648, tl.int64)
    done = tl.zeros([], tl.int32)
    n = tl.zeros([], tl.int32)
    if searched:
        jlo, n, floor, total = _window(cnt_ptr, mass_ptr, row, top, top_k, top_p, use_k, NUM_PARTS, L)
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


@triton.jit(do_not_specialize_on_alignment=_DRAW_POINTERS)
def _draw_parts_kernel(logits_ptr, stride_row, vocab, chunk, temperature_ptr, do_sample_ptr, seed_ptr, index_ptr,
                       cut_ptr, done_ptr, value_ptr, token_ptr, nan_ptr, score_ptr, max_ptr, sum_ptr,
                       NUM_PARTS: tl.constexpr, BLOCK: tl.constexpr):
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
        out = row * NUM_PARTS + part
        tl.store(value_ptr + out, top)
        tl.store(token_ptr + out, first)
        tl.store(nan_ptr + out, tl.min(nan_at, 0))
        tl.store(score_ptr + out, tl.max(tl.where(token == first, score, float("-inf")), 0))
        tl.store(max_ptr + out, part_max)
        tl.store(sum_ptr + out, part_sum)


@triton.jit(do_not_specialize_on_alignment=["do_sample_ptr", "tokens_ptr", "logprobs_ptr"])
def _draw_merge_kernel(value_ptr, token_ptr, nan_ptr, score_ptr, max_ptr, sum_ptr, do_sample_ptr, done_ptr,
                       done_token_ptr, done_logprob_ptr, tokens_ptr, logprobs_ptr, vocab, INVALID: tl.constexpr,
                       NUM_PARTS: tl.constexpr):
    row = tl.program_id(0)
    if tl.load(done_ptr + row) != 0:
        tl.store(tokens_ptr + row, tl.load(done_token_ptr + row).to(tl.int64))
        tl.store(logprobs_ptr + row, tl.load(done_logprob_ptr + row).to(tl.float64))
    else:
        parts = row * NUM_PARTS + tl.arange(0, NUM_PARTS)
        value = tl.load(value_ptr + parts)
        token = tl.load(token_ptr + parts)
        top = tl.max(value, 0)
        first = tl.min(tl.where(value == top, token, vocab), 0)
        score = tl.max(tl.where(token == first, tl.load(score_ptr + parts), float("-inf")), 0)
        _, total, shift = merged_exp_sum(tl.load(max_ptr + parts), tl.load(sum_ptr + parts))
        first = tl.where(first == vocab, 0, first)  # a row of -inf only: index 0, as torch.argmax
        logprob = score - shift - tl.log(total)
        first_nan = tl.min(tl.load(nan_ptr + parts), 0)
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
    _draw_parts_kernel[(rows, parts)](logits, stride, vocab, chunk, p.temperature, p.do_sample, p.seed,
                                      p.token_index, cut, done, partial[0], token[0], token[1], partial[1],
                                      partial[2], partial[3], NUM_PARTS=parts, BLOCK=BLOCK)
    _draw_merge_kernel[(rows,)](partial[0], token[0], token[1], partial[1], partial[2], partial[3], p.do_sample,
                                done, done_token, done_logprob, out[0], out[1].view(torch.float64), vocab,
                                INVALID=INVALID_TOKEN, NUM_PARTS=parts)
    return out


def _cut(logits: torch.Tensor, params: SamplingTensors, parts: int, chunk: int, gather: int | None = None,
         cap: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The threshold search (four launches): per row the threshold key, whether the row is drawn
    already (done), and then its token and log-probability."""
    rows, vocab = logits.shape
    device = logits.device
    gather = gather or (GATHER if logits.is_cuda else CPU_GATHER)
    cap = cap or (CAP if logits.is_cuda else CPU_CAP)
    stride, p = logits.stride(0), params
    top = torch.empty(rows * parts, dtype=torch.float32, device=device)
    ints = torch.empty(3, rows, dtype=torch.int32, device=device)  # cut, done, done token
    nan = torch.empty(rows * parts, dtype=torch.int32, device=device)
    count = torch.empty(rows * parts * LADDER, dtype=torch.int32, device=device)
    mass = torch.empty(rows * parts * LADDER, dtype=torch.float32, device=device)
    scores = torch.empty(rows, gather, dtype=torch.float32, device=device)
    cols = torch.empty(rows, gather, dtype=torch.int32, device=device)
    candidates = torch.empty(rows, cap, dtype=torch.float32, device=device)
    done_logprob = torch.empty(rows, dtype=torch.float32, device=device)
    cut, done, done_token = ints[0], ints[1], ints[2]
    _top_kernel[(rows, parts)](logits, stride, vocab, chunk, p.top_k, p.top_p, p.min_p, p.do_sample, top, nan,
                               NUM_PARTS=parts, BLOCK=BLOCK)
    _ladder_kernel[(rows, parts)](logits, stride, vocab, chunk, p.temperature, p.top_k, p.top_p, p.do_sample, top,
                                  nan, count, mass, NUM_PARTS=parts, L=LADDER, BLOCK=LADDER_BLOCK,
                                  num_warps=LADDER_WARPS)
    _gather_kernel[(rows, parts)](logits, stride, vocab, chunk, p.temperature, p.top_k, p.top_p, p.do_sample, top,
                                  nan, count, mass, scores, cols, NUM_PARTS=parts, L=LADDER, GATHER=gather,
                                  BLOCK=GATHER_BLOCK, num_warps=GATHER_WARPS)
    _resolve_kernel[(rows,)](logits, stride, vocab, p.temperature, p.top_k, p.top_p, p.min_p, p.do_sample, p.seed,
                             p.token_index, top, nan, count, mass, scores, cols, candidates, cut, done, done_token,
                             done_logprob, NUM_PARTS=parts, L=LADDER, GATHER=gather, CAP=cap, BLOCK=CUT_BLOCK,
                             num_warps=CUT_WARPS)
    return cut, done, done_token, done_logprob
