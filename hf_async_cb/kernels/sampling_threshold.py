"""The threshold search of the sampled draw (kernels/draw_sampled.py): which scores a row keeps.

`sampling.keep_threshold` defines a row's cut for top-k and top-p as an element's order-preserving
key. Finding it exactly, fast, for rows of a 128K vocabulary takes two stages (draw_sampled.py's
docstring gives the launch sequence and the measurements behind it):

- spread over the GPU, rows cut into parts: `_top_kernel` (each part's largest logit and first
  NaN), `_ladder_kernel` (per part, counts and top-p masses at 16 fixed thresholds below the top)
  and `_gather_kernel` (the scores at or above the highest threshold the cut cannot be below,
  written in column order at each part's offset);
- per row: `_search`, bisection rounds counting (and for top-p summing exp) above the midpoint of
  the key range left, then a ranking of the last few candidates, over the gathered
  scores (or over the whole row when too many tie near the edge). The search and `_row_setup` /
  `_window` are used by draw_sampled's resolve kernel.

Compile time is part of a user's first call (the resolve kernel took ~3.5 s per variant on the
H200's host, 26 s on a CI core), so nothing here is unrolled at compile time beyond sixteen ladder
counters: the last candidates are ranked in a loop, not by a sort network; the search, its passes
and its bracket are functions of their own (noinline: they take and return scalars), compiled once
each instead of once per call site; the gathered scores are kept in the logits' own dtype (copies,
so nothing is rounded), which gives both of the resolve kernel's searches (gathered, whole row) one
pointer type and so one compiled `_search`, not two (bf16: 1.96 -> 1.22 s per variant on a CPU
core, benchmarks/compile_census_cpu.py); and a row's parts are a runtime count (merged through
MAX_PARTS masked lanes), so one variant of each kernel serves every batch size.

Integer counts and fixed-order sums: the same inputs give the same cut, every run.
"""

from __future__ import annotations

import triton
import triton.language as tl

MAX_PARTS = 64  # the most parts a row is cut into (draw_greedy.split_rows): the merges' vector width
_MAX_PARTS = tl.constexpr(MAX_PARTS)
RANK_TILE = tl.constexpr(16)  # scores compared at once when ranking the last candidates (_sort_descending)


# Per-row parameters are views into the step's packed upload, and per-part results views into one
# buffer, at offsets that change with the row count: specialising on their alignment would compile
# new variants mid-run (their loads and stores are scalar, or masked vectors at unaligned offsets).
_ROW_POINTERS = ["temperature_ptr", "top_k_ptr", "top_p_ptr", "min_p_ptr", "do_sample_ptr", "top_ptr", "nan_ptr"]


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


@triton.jit(noinline=True)
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


@triton.jit(noinline=True)
def _bracket(base, vocab, temperature, floor, lo, hi, cand_ptr, CAP: tl.constexpr, BLOCK: tl.constexpr):
    """The number of scores whose key k has floor <= k and lo < k < hi; the first CAP of them (the
    caller's search stops there) left at cand_ptr in descending order (read them with _ranked)."""
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
    _sort_descending(cand_ptr, tl.minimum(n, CAP), CAP)
    return n


@triton.jit
def _ranked(cand_ptr, n, CAP: tl.constexpr):
    """_bracket's scores, descending, padded with -inf to CAP."""
    slots = tl.arange(0, CAP)
    return tl.load(cand_ptr + slots, mask=slots < n, other=float("-inf"))


@triton.jit
def _sort_descending(cand_ptr, n, CAP: tl.constexpr):
    """Sort the n (<= CAP) scores at cand_ptr in place, descending.

    Each score's place is the number of scores before it (larger, or equal at a lower slot), counted
    RANK_TILE at a time in a loop that stays a loop: tl.sort's network is unrolled at compile time
    (log2(CAP) * (log2(CAP) + 1) / 2 stages over CAP lanes) and took ~20 s of the resolve kernel's
    26 s compile for CAP = 512. Ties keep their slot order; their values are equal, so the result is
    the sort's."""
    slots = tl.arange(0, CAP)
    inside = slots < n
    value = tl.load(cand_ptr + slots, mask=inside, other=float("-inf"))
    place = tl.zeros([CAP], tl.int32)
    for start in range(0, n, RANK_TILE):
        others = start + tl.arange(0, RANK_TILE)
        other = tl.load(cand_ptr + others, mask=others < n, other=float("-inf"))
        before = (other[None, :] > value[:, None]) | ((other[None, :] == value[:, None]) & (others[None, :] < slots[:, None]))
        place += tl.sum((before & (others < n)[None, :]).to(tl.int32), 1)
    tl.debug_barrier()  # every thread has read the scores before any is moved
    tl.store(cand_ptr + place, value, mask=inside)
    tl.debug_barrier()


@triton.jit(noinline=True)
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
        n = _bracket(base, vocab, temperature, everything.to(tl.int64), lo, hi, cand_ptr, CAP, BLOCK)
        ranked = _ranked(cand_ptr, n, CAP)
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
        n = _bracket(base, vocab, temperature, kth, lo, hi, cand_ptr, CAP, BLOCK)
        ranked = _ranked(cand_ptr, n, CAP)
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
def _row_setup(temperature_ptr, top_k_ptr, top_p_ptr, do_sample_ptr, top_ptr, nan_ptr, row, vocab, num_parts):
    """The row's parameters and flags, its top scaled score (merged from the parts of _top_kernel, in
    a fixed order) and whether its threshold is searched with the ladder (finite top, no NaN)."""
    temperature = tl.load(temperature_ptr + row)
    top_k = tl.load(top_k_ptr + row)
    top_p = tl.load(top_p_ptr + row)
    sampled = tl.load(do_sample_ptr + row) != 0
    use_k = sampled & (top_k > 0) & (top_k < vocab)
    use_p = sampled & (top_p < 1.0)
    parts = tl.arange(0, _MAX_PARTS)
    ours = parts < num_parts
    top_x = tl.max(tl.load(top_ptr + row * num_parts + parts, mask=ours, other=float("-inf")), 0)
    clean = tl.min(tl.load(nan_ptr + row * num_parts + parts, mask=ours, other=vocab), 0) == vocab
    top = tl.math.div_rn(top_x, temperature)  # division by t > 0 keeps the order: the top scaled score
    searched = (use_k | use_p) & clean & (tl.abs(top) < float("inf"))
    return temperature, top_k, top_p, use_k, use_p, top, clean, searched


@triton.jit
def _window(cnt_ptr, mass_ptr, row, top, top_k, top_p, use_k, num_parts, L: tl.constexpr):
    """From the ladder's counts and masses (parts merged in a fixed order): the ladder step jlo whose
    threshold the row's cut is at or above (top-k's k-th largest score; without top-k, top-p's edge:
    the mass at or above it is >= top_p of the total, so nothing lower is kept), the number of
    scores at or above it, that threshold, and the row's total mass."""
    j = tl.arange(0, L)
    parts = tl.arange(0, _MAX_PARTS)
    at = (row * num_parts + parts)[:, None] * L + j[None, :]
    ours = (parts < num_parts)[:, None]
    count = tl.sum(tl.load(cnt_ptr + at, mask=ours, other=0), 0)
    mass = tl.sum(tl.load(mass_ptr + at, mask=ours, other=0.0), 0)
    total = tl.max(tl.where(j == L - 1, mass, float("-inf")), 0)
    jk = tl.min(tl.where(count >= top_k, j, L - 1), 0)
    jp = tl.min(tl.where(mass >= top_p * total, j, L - 1), 0)
    jlo = tl.where(use_k, jk, jp)
    n = tl.sum(tl.where(j == jlo, count, 0), 0)
    floor = tl.max(tl.where(j == jlo, _ladder(top, L), float("-inf")), 0)
    return jlo, n, floor, total


@triton.jit(do_not_specialize=["num_parts"], do_not_specialize_on_alignment=_ROW_POINTERS)
def _top_kernel(logits_ptr, stride_row, vocab, chunk, num_parts, top_k_ptr, top_p_ptr, min_p_ptr, do_sample_ptr,
                top_ptr, nan_ptr, BLOCK: tl.constexpr):
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
    tl.store(top_ptr + row * num_parts + part, tl.max(top, 0))
    tl.store(nan_ptr + row * num_parts + part, tl.min(nan_at, 0))


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


@triton.jit(do_not_specialize=["num_parts"], do_not_specialize_on_alignment=_ROW_POINTERS)
def _ladder_kernel(logits_ptr, stride_row, vocab, chunk, num_parts, temperature_ptr, top_k_ptr, top_p_ptr,
                   do_sample_ptr, top_ptr, nan_ptr, cnt_ptr, mass_ptr, L: tl.constexpr, BLOCK: tl.constexpr):
    """Per part of a searched row, for each ladder threshold: the number of scores at or above it and
    (top-p) their mass, sum(exp(score - top)). Sixteen counters per lane, unrolled (L is 16)."""
    tl.static_assert(L == 16)
    row = tl.program_id(0)
    part = tl.program_id(1)
    temperature, top_k, top_p, use_k, use_p, top, clean, searched = _row_setup(
        temperature_ptr, top_k_ptr, top_p_ptr, do_sample_ptr, top_ptr, nan_ptr, row, vocab, num_parts)
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
    at = (row * num_parts + part) * L + tl.arange(0, L)
    tl.store(cnt_ptr + at, count)
    tl.store(mass_ptr + at, mass)


@triton.jit(do_not_specialize=["num_parts"], do_not_specialize_on_alignment=_ROW_POINTERS)
def _gather_kernel(logits_ptr, stride_row, vocab, chunk, num_parts, temperature_ptr, top_k_ptr, top_p_ptr,
                   do_sample_ptr, top_ptr, nan_ptr, cnt_ptr, mass_ptr, score_ptr, col_ptr, L: tl.constexpr,
                   GATHER: tl.constexpr, BLOCK: tl.constexpr):
    """Per part of a searched row whose window fits GATHER: its scores at or above the window's floor,
    and their columns, at the part's offset (the counts of the parts before it), in column order."""
    row = tl.program_id(0)
    part = tl.program_id(1)
    temperature, top_k, top_p, use_k, use_p, top, clean, searched = _row_setup(
        temperature_ptr, top_k_ptr, top_p_ptr, do_sample_ptr, top_ptr, nan_ptr, row, vocab, num_parts)
    if searched:
        jlo, n, floor, _ = _window(cnt_ptr, mass_ptr, row, top, top_k, top_p, use_k, num_parts, L)
        if n <= GATHER:
            parts = tl.arange(0, _MAX_PARTS)
            before = tl.load(cnt_ptr + (row * num_parts + parts) * L + jlo, mask=parts < num_parts, other=0)
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
