"""Vectorised per-request sampling on the device: greedy rows and sampled rows share one batch.

Sampled rows follow stock transformers' warpers, in its order: temperature, top-k, top-p, min-p, then a
draw from the softmax: for a request with a seed (the engine gives every sampled request one, its
own or one derived from BatchingConfig.seed, see `derive_seed`), a Gumbel-max draw whose noise is a
hash of (seed, index of the token in the request's output, token id). That noise depends on
nothing else, so a request samples the same tokens whatever else shares its batches, in sync and
async, preempted or not. Rows without a seed (callers outside the engine) draw from a generator.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import torch

from .requests import SamplingParams


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
                   ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Host tensors (ints, floats) to upload; empty when no row samples."""
        if not any(p.do_sample for p in params):
            return [], []
        ints = [
            torch.tensor([p.top_k for p in params], dtype=torch.long),
            torch.tensor([-1 if p.seed is None else p.seed for p in params], dtype=torch.long),
            torch.tensor(list(token_index) if token_index is not None else [0] * len(params), dtype=torch.long),
        ]
        floats = [
            torch.tensor([float(p.do_sample) for p in params]),
            # Greedy rows never use their temperature; 1.0 keeps them finite next to sampled rows.
            torch.tensor([p.temperature if p.do_sample else 1.0 for p in params]),
            torch.tensor([p.top_p for p in params]),
            torch.tensor([p.min_p for p in params]),
        ]
        return ints, floats

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
        """Direct construction (tests, callers outside the pipeline)."""
        ints, floats = cls.host_parts(params, token_index)
        unseeded = any(p.do_sample and p.seed is None for p in params)
        return cls.from_device([t.to(device) for t in ints], [t.to(device) for t in floats], unseeded)

    def rows(self, rows: list[int]) -> "SamplingTensors":
        """The parameters of some rows only."""
        return dataclasses.replace(self, **{f.name: getattr(self, f.name)[rows] for f in dataclasses.fields(self)
                                            if f.name != "unseeded"})


def sample(logits: torch.Tensor, params: SamplingTensors | None,
           generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [S, V] float32 -> (token ids [S] int64, their log-probabilities [S] float32).

    A log-probability is taken under the distribution the token was drawn from: the logits for
    greedy rows, the temperature/top-k/top-p-filtered distribution for sampled rows.
    """
    greedy = logits.argmax(dim=-1)
    greedy_logprob = logits.log_softmax(dim=-1).gather(1, greedy[:, None]).squeeze(1)
    if params is None or logits.shape[0] == 0:
        return greedy, greedy_logprob
    sorted_scores, sorted_idx = _warp_sorted(logits, params)
    # Seeded rows: argmax of score + Gumbel noise is a draw from softmax(score) (-inf stays out).
    gumbel = -torch.log(-torch.log(hash_uniform(params.seed[:, None], params.token_index[:, None], sorted_idx)))
    rank = (sorted_scores + gumbel.to(sorted_scores.dtype)).argmax(dim=-1, keepdim=True)
    if params.unseeded:
        drawn_rank = torch.multinomial(sorted_scores.softmax(dim=-1), 1, generator=generator)
        rank = torch.where(params.seed[:, None] >= 0, rank, drawn_rank)
    drawn = sorted_idx.gather(1, rank).squeeze(1)
    drawn_logprob = sorted_scores.log_softmax(dim=-1).gather(1, rank).squeeze(1)
    sampled = params.do_sample != 0
    return torch.where(sampled, drawn, greedy), torch.where(sampled, drawn_logprob, greedy_logprob)


def _warp_sorted(logits: torch.Tensor, params: SamplingTensors) -> tuple[torch.Tensor, torch.Tensor]:
    """Temperature, top-k, top-p, min-p (stock's order), on the scores sorted in descending order."""
    scores = logits / params.temperature[:, None]
    vocab = scores.shape[-1]
    sorted_scores, sorted_idx = scores.sort(dim=-1, descending=True)
    # top-k: drop scores below the k-th largest (ties kept, as stock); k = 0 keeps all.
    k = torch.where(params.top_k > 0, params.top_k.clamp(max=vocab), torch.full_like(params.top_k, vocab))
    kth = sorted_scores.gather(1, (k - 1)[:, None])
    sorted_scores = sorted_scores.masked_fill(sorted_scores < kth, float("-inf"))
    # top-p: keep the most likely tokens until their mass reaches p (always at least the first).
    probs_sorted = sorted_scores.softmax(dim=-1)
    mass_before = probs_sorted.cumsum(dim=-1) - probs_sorted
    remove_sorted = mass_before >= params.top_p[:, None]
    remove_sorted[:, 0] = False
    sorted_scores = sorted_scores.masked_fill(remove_sorted, float("-inf"))
    # min-p: drop tokens less likely than min_p times the most likely one (always keep the first).
    probs_sorted = sorted_scores.softmax(dim=-1)
    remove_sorted = probs_sorted < params.min_p[:, None] * probs_sorted[:, :1]
    remove_sorted[:, 0] = False
    return sorted_scores.masked_fill(remove_sorted, float("-inf")), sorted_idx


def processed_scores(logits: torch.Tensor, params: SamplingTensors | None) -> torch.Tensor:
    """What stock generate reports as `scores`: the logits after processors and, for sampled rows,
    after its warpers (filtered tokens at -inf), in vocabulary order."""
    if params is None:
        return logits.clone()
    sorted_scores, sorted_idx = _warp_sorted(logits, params)
    warped = torch.empty_like(logits).scatter_(1, sorted_idx, sorted_scores)
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


def hash_uniform(seed: torch.Tensor, index: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """Uniform (0, 1) float64 from a SplitMix64-style mix of three int64 tensors (broadcast).

    A pure function of its inputs, on any device, with no generator state to keep.
    """
    x = seed * _GOLDEN + index * _MIX2 + token * _MIX1 + _GOLDEN
    x = (x ^ _shift_right(x, 30)) * _MIX1
    x = (x ^ _shift_right(x, 27)) * _MIX2
    x = x ^ _shift_right(x, 31)
    return (_shift_right(x, 11).double() + 0.5) * 2.0**-53


def derive_seed(seed: int, index: int) -> int:
    """The seed of request `index` (its position in a generate call, or its submission order
    online) under the engine seed `seed`: a SplitMix64 mix of both, in [0, 2**62)."""
    mask = (1 << 64) - 1
    x = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xBF58476D1CE4E5B9) & mask
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
    return (x ^ (x >> 31)) >> 2
