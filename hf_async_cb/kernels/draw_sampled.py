"""Sampled rows on the GPU without a sort or any [S, V] temporary: `sampling.sample` in kernels.

The torch sampler sorts every row and builds the hash noise with a dozen int64 tensor ops over
[S, V]; at 64 rows of a 128K vocabulary that was 2.2 ms of a 1.5 ms 1B decode step. Here:

1. `_cut_kernel`, one program per row: the row's threshold as an order-preserving int32 key of
   the scaled scores (`sampling.keep_threshold`). Rows without top-k/top-p/min-p skip it all. For
   the k-th largest score and the top-p edge, each round is one pass over the row (from L2)
   counting (for top-p also summing exp) above the midpoint of the score range left; once at
   most CAP scores lie strictly between the bounds, one more pass gathers them into a scratch row
   and a sort in registers settles the edge: exact (an element's key), whatever the tie pattern,
   in ~7-11 passes where bisection on the keys took ~30-50.
2. `_draw_parts_kernel`, rows cut into parts (as draw_greedy.py): per part, the best kept
   score + Gumbel noise, its token and score, and the kept mass (online max / sum of exp).
3. `_draw_merge_kernel`: merges the parts (ties to the lowest token id, as torch.argmax) and
   writes `sampling.pack`'s [2, S] layout: token ids, then float64 log-probabilities' bits.

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

# The threshold search runs one program per row: wide steps and many warps keep enough loads in
# flight (benchmarks/gpu_sampling.py --sweep).
CUT_BLOCK, CUT_WARPS = 4096, 16
CAP = 2048  # the search stops once this few scores are left around the edge, and sorts them
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


@triton.jit(do_not_specialize_on_alignment=_CUT_POINTERS)
def _cut_kernel(logits_ptr, stride_row, vocab, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, do_sample_ptr,
                cut_ptr, cand_ptr, BLOCK: tl.constexpr, CAP: tl.constexpr):
    row = tl.program_id(0)
    base = logits_ptr + row.to(tl.int64) * stride_row
    cand_ptr += row.to(tl.int64) * CAP
    lanes = tl.arange(0, BLOCK)
    slots = tl.arange(0, CAP)
    temperature = tl.load(temperature_ptr + row)
    top_k = tl.load(top_k_ptr + row)
    top_p = tl.load(top_p_ptr + row)
    min_p = tl.load(min_p_ptr + row)
    sampled = tl.load(do_sample_ptr + row) != 0
    use_k = sampled & (top_k > 0) & (top_k < vocab)
    use_p = sampled & (top_p < 1.0)
    use_min = sampled & (min_p > 0.0)
    cut = tl.full([], -2147483648, tl.int64)
    if use_k | use_p | use_min:
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
            everything = tl.full([], -2147483648, tl.int32)  # no floor: top-k looks at the whole row
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
            target = top_p * total
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
        if use_min:  # after top-p, as stock: the ratio to the most likely token, which every filter keeps
            cut = tl.maximum(cut, _score_key(top + tl.log(min_p)).to(tl.int64))
    tl.store(cut_ptr + row, cut.to(tl.int32))


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


@triton.jit(do_not_specialize_on_alignment=_DRAW_POINTERS)
def _draw_parts_kernel(logits_ptr, stride_row, vocab, chunk, temperature_ptr, do_sample_ptr, seed_ptr, index_ptr,
                       cut_ptr, value_ptr, token_ptr, nan_ptr, score_ptr, max_ptr, sum_ptr,
                       NUM_PARTS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    part = tl.program_id(1)
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
        bits = _fmix32(_fmix32(cols.to(tl.uint32) ^ k1) ^ k2) >> 8
        uniform = (bits.to(tl.float32) + 0.5) * 5.9604644775390625e-08  # 2**-24
        value = s + tl.where(sampled, -tl.log(-tl.log(uniform)), 0.0)
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
def _draw_merge_kernel(value_ptr, token_ptr, nan_ptr, score_ptr, max_ptr, sum_ptr, do_sample_ptr, tokens_ptr,
                       logprobs_ptr, vocab, INVALID: tl.constexpr, NUM_PARTS: tl.constexpr):
    row = tl.program_id(0)
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
    if params.unseeded:
        raise ValueError("sampled_packed draws seeded rows only; use sampling.sample for rows without a seed.")
    rows, vocab = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    out = torch.empty(2, rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    cut = torch.empty(rows, dtype=torch.int32, device=logits.device)
    cap = CAP if logits.is_cuda else CPU_CAP
    candidates = torch.empty(rows, cap, dtype=torch.float32, device=logits.device)
    _cut_kernel[(rows,)](logits, logits.stride(0), vocab, params.temperature, params.top_k, params.top_p,
                         params.min_p, params.do_sample, cut, candidates, BLOCK=CUT_BLOCK, CAP=cap,
                         num_warps=CUT_WARPS)
    parts, chunk = split_rows(rows, vocab, logits.device)
    partial = torch.empty(4, rows * parts, dtype=torch.float32, device=logits.device)
    token = torch.empty(2, rows * parts, dtype=torch.int32, device=logits.device)  # drawn, first NaN
    _draw_parts_kernel[(rows, parts)](logits, logits.stride(0), vocab, chunk, params.temperature, params.do_sample,
                                      params.seed, params.token_index, cut, partial[0], token[0], token[1],
                                      partial[1], partial[2], partial[3], NUM_PARTS=parts, BLOCK=BLOCK)
    _draw_merge_kernel[(rows,)](partial[0], token[0], token[1], partial[1], partial[2], partial[3],
                                params.do_sample, out[0], out[1].view(torch.float64), vocab,
                                INVALID=INVALID_TOKEN, NUM_PARTS=parts)
    return out
