"""Vectorised per-request sampling on the device: greedy rows and sampled rows share one batch.

Sampled rows follow stock transformers' warpers, in its order: temperature, top-k, top-p, min-p, then a
draw from the softmax: for a request with a seed (the engine gives every sampled request one, its
own or one derived from BatchingConfig.seed, see `derive_seed`), a Gumbel-max draw whose noise is a
hash of (seed, index of the token in the request's output, token id). That noise depends on
nothing else, so a request samples the same tokens whatever else shares its batches, in sync and
async, preempted or not. Rows without a seed (callers outside the engine) draw from a generator.

A sampled row whose scores hold NaN or +inf, or whose kept scores are all -inf, has no
distribution to draw from: stock generate raises there (torch.multinomial's "probability tensor
contains either `inf`, `nan` or element < 0"). Checking on the host would cost a sync per step,
so the draw writes INVALID_TOKEN for that row instead, and the host raises `InvalidScoresError`
when it reads the token. Greedy rows take the argmax as stock does (a NaN wins, as in torch.argmax).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from hf_async_cb.engine.requests import SamplingParams

INVALID_TOKEN = -1  # what a sampled row draws from NaN / +inf scores, or from nothing but -inf


class InvalidScoresError(RuntimeError):
    """A sampled request's scores were no distribution (NaN, +inf, or every token at -inf).
    A RuntimeError, as stock generate's, so code catching that one catches this one too."""


def invalid_scores_error(request_id: str, index: int) -> InvalidScoresError:
    """The error the host raises on reading INVALID_TOKEN for request `request_id`, at output token `index`."""
    return InvalidScoresError(
        f"request {request_id}: the scores to sample its output token {index} from contain NaN or +inf, or "
        "every token is at -inf (after the logits processors and warpers), so there is no distribution to "
        "draw from (stock generate: probability tensor contains either `inf`, `nan` or element < 0). Check "
        "the logits processors, bad words / suppressed tokens that ban every token, or the model's logits."
    )


@dataclass
class SamplingTensors:
    do_sample: torch.Tensor  # [S] float32, nonzero = sample (compared inside the step's compute)
    temperature: torch.Tensor  # [S] float32
    top_k: torch.Tensor  # [S] int64, 0 = off
    top_p: torch.Tensor  # [S] float32, 1.0 = off
    min_p: torch.Tensor  # [S] float32, 0.0 = off
    seed: torch.Tensor  # [S] int64, -1 = no seed of its own (use the engine's generator)
    token_index: torch.Tensor  # [S] int64, index of the token being sampled in the request's output
    unseeded: bool = True  # host: some sampled row has no seed (else no multinomial draw is made)

    @staticmethod
    def host_parts(params: Sequence[SamplingParams], token_index: Sequence[int] | None = None
                   ) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Host arrays (ints, floats) to upload; the caller decides whether the step takes them (a step
        where no row samples does not, unless its graph does). Each request keeps its row ready
        (SamplingParams.sampler_ints / sampler_floats), so a step only stacks them."""
        ints = np.empty((3, len(params)), dtype=np.int64)
        ints[:2] = np.frombuffer(b"".join([p.sampler_ints for p in params]), dtype="<i8").reshape(-1, 2).T
        ints[2] = token_index if token_index is not None else 0
        floats = np.frombuffer(b"".join([p.sampler_floats for p in params]), dtype="<f4").reshape(-1, 4).T
        return list(ints), list(floats)

    @classmethod
    def from_device(cls, ints: list[torch.Tensor], floats: list[torch.Tensor],
                    unseeded: bool = True) -> "SamplingTensors | None":
        if not ints:
            return None
        (top_k, seed, token_index), (do_sample, temperature, top_p, min_p) = ints, floats
        return cls(do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed,
                   token_index=token_index, unseeded=unseeded)

    @classmethod
    def build(cls, params: Sequence[SamplingParams], device: torch.device,
              token_index: Sequence[int] | None = None) -> "SamplingTensors | None":
        """Direct construction (tests, callers outside the pipeline); None when no row samples."""
        if not any(p.do_sample for p in params):
            return None
        ints, floats = cls.host_parts(params, token_index)
        unseeded = any(p.unseeded for p in params)
        return cls.from_device([torch.from_numpy(t.copy()).to(device) for t in ints],
                               [torch.from_numpy(t.copy()).to(device) for t in floats], unseeded)

    def rows(self, rows: list[int]) -> "SamplingTensors":
        """The parameters of some rows only."""
        return dataclasses.replace(self, **{f.name: getattr(self, f.name)[rows] for f in dataclasses.fields(self)
                                            if f.name != "unseeded"})


def sample(logits: torch.Tensor, params: SamplingTensors | None,
           generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [S, V] float32 -> (token ids [S] int64, their log-probabilities [S] float32).

    A log-probability is taken under the distribution the token was drawn from: the logits for
    greedy rows, the temperature/top-k/top-p/min-p-filtered distribution for sampled rows. This is
    the reference that `sampled.sampled_packed` (the GPU kernels) computes too: the same kept set,
    the same noise, ties to the lowest token id. A sampled row with no distribution (see the module
    docstring) gets INVALID_TOKEN and a NaN log-probability.
    """
    greedy = logits.argmax(dim=-1)
    greedy_logprob = logits.log_softmax(dim=-1).gather(1, greedy[:, None]).squeeze(1)
    if params is None or logits.shape[0] == 0:
        return greedy, greedy_logprob
    scores = logits / params.temperature[:, None]
    kept = scores >= keep_threshold(scores, params)[:, None]
    # Seeded rows: argmax of score + Gumbel noise is a draw from softmax(score) over the kept tokens.
    noise = gumbel_noise(params.seed, params.token_index, logits.shape[1])
    if params.unseeded:
        drawn = torch.randint(0, 1 << 48, logits.shape, generator=generator, device=logits.device)
        noise = torch.where(params.seed[:, None] >= 0, noise, _gumbel(drawn))
    drawn = torch.where(kept, scores + noise, float("-inf")).argmax(dim=-1)
    top = scores.max(dim=-1).values
    mass = torch.where(kept, (scores - top[:, None]).exp(), 0.0).sum(dim=-1)
    drawn_logprob = scores.gather(1, drawn[:, None]).squeeze(1) - top - mass.log()
    # max propagates NaN, and every filter keeps the top score: a finite top means a distribution.
    invalid = ~top.isfinite()
    drawn = torch.where(invalid, INVALID_TOKEN, drawn)
    drawn_logprob = torch.where(invalid, float("nan"), drawn_logprob)
    sampled = params.do_sample != 0
    return torch.where(sampled, drawn, greedy), torch.where(sampled, drawn_logprob, greedy_logprob)


def keep_threshold(scores: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
    """[S] float32: a sampled row keeps the (temperature-scaled) scores >= its threshold; -inf keeps all.

    Stock's warpers in its order, each on what the one before kept: top-k keeps the scores >= the
    k-th largest (ties kept); top-p keeps a score when the mass of the kept scores strictly above
    it is below top_p of their total (ties at the edge are all kept or all dropped, so the set does
    not depend on a sort order); min-p keeps the scores >= max + log(min_p) (probability ratio to
    the most likely token). Each filter keeps the most likely token. Greedy rows keep everything.
    """
    rows, vocab = scores.shape
    ordered = scores.sort(dim=-1, descending=True).values
    top = ordered[:, 0]
    k = torch.where((params.top_k > 0) & (params.top_k < vocab), params.top_k, vocab)
    kth = ordered.gather(1, (k - 1)[:, None]).squeeze(1)
    weight = torch.where(ordered >= kth[:, None], (ordered - top[:, None]).exp(), 0.0)
    mass_above = weight.cumsum(dim=-1) - weight  # for the first of a run of ties: the mass strictly above
    within = (mass_above < params.top_p[:, None] * weight.sum(dim=-1, keepdim=True)).sum(dim=-1).clamp(min=1)
    nucleus = torch.where(params.top_p < 1.0, ordered.gather(1, (within - 1)[:, None]).squeeze(1), float("-inf"))
    ratio = top + params.min_p.log()
    cut = torch.maximum(torch.maximum(kth, nucleus), ratio)
    filtered = (params.do_sample != 0) & ((k < vocab) | (params.top_p < 1.0) | (params.min_p > 0.0))
    return torch.where(filtered, cut, float("-inf"))


def processed_scores(logits: torch.Tensor, params: SamplingTensors | None) -> torch.Tensor:
    """What stock generate reports as `scores`: the logits after processors and, for sampled rows,
    after its warpers (filtered tokens at -inf), in vocabulary order."""
    if params is None:
        return logits.clone()
    scores = logits / params.temperature[:, None]
    warped = torch.where(scores >= keep_threshold(scores, params)[:, None], scores, float("-inf"))
    return torch.where((params.do_sample != 0)[:, None], warped, logits)


def pack(tokens: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
    """[2, S] int64: tokens, then the float64 bits of their log-probabilities (one D2H copy for both)."""
    return torch.stack([tokens, logprobs.double().view(torch.int64)])


def _signed(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN, _MIX1, _MIX2 = _signed(0x9E3779B97F4A7C15), _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)


def _shift_right(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def row_keys(seed: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two 32-bit keys per row (int64 tensors) from a SplitMix64 mix of (seed, token index)."""
    x = seed * _GOLDEN + index * _MIX2 + _GOLDEN
    x = (x ^ _shift_right(x, 30)) * _MIX1
    x = (x ^ _shift_right(x, 27)) * _MIX2
    x = x ^ _shift_right(x, 31)
    return x & 0xFFFFFFFF, _shift_right(x, 32)


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finaliser on int64 tensors holding uint32 values."""
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & 0xFFFFFFFF
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & 0xFFFFFFFF
    return x ^ (x >> 16)


# XORed into the second hash's first key, so that the two hashes differ even where k1 == k2.
_SECOND_HASH = 0x9E3779B9


def hash_bits(seed: torch.Tensor, index: torch.Tensor, vocab: int) -> torch.Tensor:
    """[S, V] int64 holding 48 random bits per (row, token id): a pure function of the row's seed
    and token index, so a request draws the same tokens whatever shares its batch. The high 24 bits
    are those of versions 0.2-0.3; the low 24 come from a second hash of the same keys."""
    k1, k2 = row_keys(seed, index)
    token = torch.arange(vocab, device=seed.device)[None]
    high = _fmix32(_fmix32(token ^ k1[:, None]) ^ k2[:, None]) >> 8
    low = _fmix32(_fmix32(token ^ (k2[:, None] ^ _SECOND_HASH)) ^ k1[:, None]) >> 8
    return (high << 24) | low


def _fraction(high: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """(high + (low + 0.5) * 2**-24) * 2**-24 in float32, for 24-bit integers high and low."""
    return (high.float() + (low.float() * 2.0**-24 + 2.0**-25)) * 2.0**-24


def _gumbel(bits: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) noise in float32 from 48 uniform bits (the kernels compute the same).

    The largest noise values come from uniforms nearest 1, where float32 cannot tell them apart:
    24 bits there capped the noise at 16.6, so tokens more than ~17 nats below the top were never
    drawn and those 12-17 below too rarely. So both the uniform u and v = 1 - u are formed from the
    integers (each exact to float32's precision), and -log(u) is taken as the series of -log1p(-v)
    where v is small: the noise is accurate to float32 wherever it lands, up to 33.9."""
    high, low = bits >> 24, bits & 0xFFFFFF
    u = _fraction(high, low)
    v = _fraction(0xFFFFFF - high, 0xFFFFFF - low)  # 1 - u
    return -torch.where(v < 0.125, _log1p_series(v), -u.log()).log()


def _log1p_series(v: torch.Tensor) -> torch.Tensor:
    """-log1p(-v) = v + v**2/2 + ... + v**8/8 for 0 < v < 1/8 (the next term is below 2**-24 of it)."""
    total = torch.full_like(v, 1 / 8)
    for n in range(7, 0, -1):
        total = total * v + 1 / n
    return total * v


def gumbel_noise(seed: torch.Tensor, index: torch.Tensor, vocab: int) -> torch.Tensor:
    """[S, V] float32 Gumbel noise of each row's (seed, token index)."""
    return _gumbel(hash_bits(seed, index, vocab))


def derive_seed(seed: int, index: int) -> int:
    """The seed of request `index` (its position in a generate call, or its submission order
    online) under the engine seed `seed`: a SplitMix64 mix of both, in [0, 2**62)."""
    mask = (1 << 64) - 1
    x = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xBF58476D1CE4E5B9) & mask
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
    return (x ^ (x >> 31)) >> 2
