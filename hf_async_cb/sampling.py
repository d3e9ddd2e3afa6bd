"""Vectorised per-request sampling on the device: greedy rows and sampled rows share one batch.

Sampled rows follow stock transformers' warpers, in its order: temperature, top-k, top-p, then a
multinomial draw from the softmax.
"""

from __future__ import annotations

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

    @staticmethod
    def host_parts(params: Sequence[SamplingParams]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Host tensors (ints, floats) to upload; empty when no row samples."""
        if not any(p.do_sample for p in params):
            return [], []
        ints = [torch.tensor([p.top_k for p in params], dtype=torch.long)]
        floats = [
            torch.tensor([float(p.do_sample) for p in params]),
            # Greedy rows never use their temperature; 1.0 keeps them finite next to sampled rows.
            torch.tensor([p.temperature if p.do_sample else 1.0 for p in params]),
            torch.tensor([p.top_p for p in params]),
        ]
        return ints, floats

    @classmethod
    def from_device(cls, ints: list[torch.Tensor], floats: list[torch.Tensor]) -> "SamplingTensors | None":
        if not ints:
            return None
        (top_k,), (do_sample, temperature, top_p) = ints, floats
        return cls(do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p)

    @classmethod
    def build(cls, params: Sequence[SamplingParams], device: torch.device) -> "SamplingTensors | None":
        """Direct construction (tests, callers outside the pipeline)."""
        ints, floats = cls.host_parts(params)
        return cls.from_device([t.to(device) for t in ints], [t.to(device) for t in floats])


def sample(logits: torch.Tensor, params: SamplingTensors | None,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """logits [S, V] float32 -> token ids [S] int64."""
    greedy = logits.argmax(dim=-1)
    if params is None or logits.shape[0] == 0:
        return greedy
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
    drawn_rank = torch.multinomial(sorted_scores.softmax(dim=-1), 1, generator=generator)
    drawn = sorted_idx.gather(1, drawn_rank).squeeze(1)
    return torch.where(params.do_sample != 0, drawn, greedy)
