"""Which seed each sampled request gets: its own, or one derived from the engine's seed and the
request's index, so that its tokens depend on nothing but its prompt, parameters and that index
(never on the requests sharing its batches, nor on the loop or the replica that ran it)."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from hf_async_cb.engine.requests import Request, SamplingParams, _as_int
from hf_async_cb.sampling.sampler import derive_seed


def copy_params(params: SamplingParams, copy: int) -> SamplingParams:
    """The parameters of copy `copy` of a request: its own seed, so that seeded copies differ."""
    if copy == 0 or params.seed is None:
        return params
    return dataclasses.replace(params, seed=(params.seed * 1_000_003 + copy) % (1 << 62))


def _random_seed() -> int:
    """An engine seed drawn from torch's global (CPU) generator: torch.manual_seed makes runs
    without BatchingConfig.seed reproducible, as it does stock generate's sampling."""
    return int(torch.randint(0, 1 << 62, (1,)).item())


def seed_requests(requests: Sequence[Request], engine_seed: int | None, first_index: int = 0,
                  draw=None) -> None:
    """Give every sampled request without a seed of its own the seed derived from `engine_seed` and
    its index (first_index + position in `requests`), so that its tokens depend on nothing but its
    prompt, parameters and that index, never on the requests sharing its batches. No engine seed:
    one is drawn from torch's generator (only when a request needs it), through `draw` if given
    (tensor-parallel ranks agree on one: engine/distributed.py)."""
    unseeded = [(i, r) for i, r in enumerate(requests, first_index) if r.params.unseeded]
    if not unseeded:
        return
    base = engine_seed if engine_seed is not None else (draw or _random_seed)()
    for index, request in unseeded:
        request.params = dataclasses.replace(request.params, seed=derive_seed(base, index))


def seed_int(value) -> int | None:
    """`value` as a seed or seed index: an integer in [0, 2**63) (numpy and 0-d tensor ints too), else None."""
    value = _as_int(value)
    return value if value is not None and 0 <= value < 2**63 else None


def check_seed_arguments(prompts: int, seed_indices: Sequence[int] | None, engine_seed: int | None) -> None:
    """Engine.generate's seed_indices (one per prompt) and engine_seed (DataParallel's), checked as
    BatchingConfig.seed is."""
    if seed_indices is not None and len(seed_indices) != prompts:
        raise ValueError(f"seed_indices has {len(seed_indices)} entries for {prompts} prompts.")
    if seed_indices is not None and any(seed_int(i) is None for i in seed_indices):
        raise ValueError(f"seed_indices must be non-negative integers, got {list(seed_indices)!r}.")
    if engine_seed is not None and seed_int(engine_seed) is None:
        raise ValueError(f"engine_seed must be an integer in [0, 2**63), as BatchingConfig.seed, got {engine_seed!r}.")
