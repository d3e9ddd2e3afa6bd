"""A call's repeated images through the vision tower once.

RL rollouts and evaluation repeat a prompt, image included, in several rows (GRPO's groups, several
questions about one image); the merge of a call's images (model/vision.py) runs the model's forward
over every row, so its vision tower encodes each copy again. Towers that take their images packed
as patches with a [t, h, w] grid per image (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, GLM-4V: a `visual`
module whose forward takes `grid_thw`) encode each image apart from the others (attention within an
image, positions from its own grid), so during the merge their forward is given each distinct image
once and its outputs are laid out again for every copy. Images are compared in full (a sample of
their patches only groups the candidates); whatever the forward returns must be per patch or per
merged token along its first dimension, or the tower runs on every image as before.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Iterator

import torch

SAMPLED_PATCHES = 4  # patches per image read to the host to group candidates (compared in full after)


class _NotPerImage(Exception):
    """An output of the tower that is not laid out per patch or per merged token."""


@contextlib.contextmanager
def distinct_images(model: torch.nn.Module) -> Iterator[None]:
    """While the block runs, the model's packed-patch vision towers encode each distinct image of a
    call once."""
    towers = [m for m in model.modules() if _packed_tower(m)]
    for tower in towers:
        tower.forward = _deduplicating(tower, type(tower).forward.__get__(tower))
    try:
        yield
    finally:
        for tower in towers:
            tower.__dict__.pop("forward", None)


def _packed_tower(module: torch.nn.Module) -> bool:
    if "forward" in vars(module) or not isinstance(getattr(module, "spatial_merge_size", None), int):
        return False
    try:
        parameters = list(inspect.signature(type(module).forward).parameters)
    except (TypeError, ValueError):
        return False
    return parameters[1:3] == ["hidden_states", "grid_thw"]


def _deduplicating(tower: torch.nn.Module, forward):
    def run(hidden_states, grid_thw=None, *args, **kwargs):
        if (args or grid_thw is None or not isinstance(hidden_states, torch.Tensor)
                or any(isinstance(v, torch.Tensor) for v in kwargs.values())):  # (per-patch inputs of its own)
            return forward(hidden_states, grid_thw, *args, **kwargs)
        sizes = grid_thw.prod(-1).tolist()
        if sum(sizes) != hidden_states.shape[0]:
            return forward(hidden_states, grid_thw, *args, **kwargs)
        bounds = [0]
        for n in sizes:
            bounds.append(bounds[-1] + n)
        first = _first_copies(hidden_states, grid_thw, bounds)
        distinct = sorted(set(first))
        if len(distinct) == len(first):
            return forward(hidden_states, grid_thw, *args, **kwargs)
        patches = torch.cat([hidden_states[bounds[i]:bounds[i + 1]] for i in distinct])
        out = forward(patches, grid_thw[distinct], *args, **kwargs)
        slot = {image: k for k, image in enumerate(distinct)}
        try:
            return _laid_out(out, [sizes[i] for i in distinct], tower.spatial_merge_size ** 2,
                             [slot[i] for i in first])
        except _NotPerImage:
            return forward(hidden_states, grid_thw, *args, **kwargs)

    return run


def _first_copies(hidden_states: torch.Tensor, grid_thw: torch.Tensor, bounds: list[int]) -> list[int]:
    """Per image (its patches from bounds[i] to bounds[i + 1]), the index of the first image equal
    to it: the same grid and every patch the same."""
    starts = torch.tensor(bounds[:-1], device=hidden_states.device)
    sizes = torch.tensor(bounds[1:], device=hidden_states.device) - starts
    sampled = torch.stack([starts + j * sizes // SAMPLED_PATCHES for j in range(SAMPLED_PATCHES)], 1).reshape(-1)
    samples = hidden_states[sampled].reshape(len(starts), -1).contiguous().view(torch.uint8).cpu()  # (any dtype)
    grids = grid_thw.tolist()
    first: list[int] = []
    candidates: dict[bytes, list[int]] = {}
    for i in range(len(grids)):
        key = repr(grids[i]).encode() + samples[i].numpy().tobytes()
        patches = hidden_states[bounds[i]:bounds[i + 1]]
        same = next((j for j in candidates.get(key, ())
                     if torch.equal(hidden_states[bounds[j]:bounds[j + 1]], patches)), None)
        if same is None:
            candidates.setdefault(key, []).append(i)
        first.append(i if same is None else same)
    return first


def _laid_out(value, sizes: list[int], merge: int, order: list[int]):
    """The tower's output for the distinct images (`sizes` patches each) laid out for every image of
    the call: image k is distinct image order[k]. Tensors per patch or per merged token (a merge
    of `merge` patches) along their first dimension; lists, tuples and model outputs of them."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        for per in (1, merge):
            counts = [n // per for n in sizes]
            if value.dim() and value.shape[0] == sum(counts) and all(n % per == 0 for n in sizes):
                parts = torch.split(value, counts)
                return torch.cat([parts[j] for j in order])
        raise _NotPerImage
    if isinstance(value, dict):  # (transformers' ModelOutput is one)
        laid = {k: _laid_out(v, sizes, merge, order) for k, v in value.items()}
        return type(value)(**laid)
    if isinstance(value, (list, tuple)):
        return type(value)(_laid_out(v, sizes, merge, order) for v in value)
    raise _NotPerImage
