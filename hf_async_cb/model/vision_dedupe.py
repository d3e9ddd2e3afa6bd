"""A call's repeated images through the vision tower once.

RL rollouts and evaluation repeat a prompt, image included, in several rows (GRPO's groups, several
questions about one image); the merge of a call's images (model/vision.py) runs the model's forward
over every row, so its vision tower encodes each copy again. Vision towers encode each image apart
from the others, so during the merge their forward is given each distinct image once and its
outputs are laid out again for every copy. Two kinds are recognised by their forward's arguments:

- packed patches with a [t, h, w] grid per image (`forward(hidden_states, grid_thw)`: Qwen2-VL,
  Qwen2.5-VL, Qwen3-VL, GLM-4V): attention within an image, positions from its own grid; outputs
  per patch or per merged token;
- a batch of images (`forward(pixel_values, ...)`: CLIP, SigLIP, Idefics3's, InternVL's towers):
  every tensor argument and output per image along its first dimension.

Images are compared by content key (as the prefix cache names image embeddings), together with
whatever else the tower is given per image; an output laid out otherwise (Pixtral packs its images into one
sequence) has the tower run on every image, as before.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Iterator

import torch

from hf_async_cb.engine.prompt_embeds import content_keys

class _NotPerImage(Exception):
    """An output of the tower that is not laid out per patch or per merged token."""


@contextlib.contextmanager
def distinct_images(model: torch.nn.Module) -> Iterator[None]:
    """While the block runs, the model's vision towers encode each distinct image of a call once."""
    wrapped: list[tuple[str, torch.nn.Module]] = []
    for name, module in model.named_modules():
        if any(name.startswith(outer + ".") for outer, _ in wrapped) or "forward" in vars(module):
            continue  # (a tower's own parts run on what the tower gives them)
        kind = _tower_kind(module)
        if kind is not None:
            module.forward = kind(module, type(module).forward.__get__(module))
            wrapped.append((name, module))
    try:
        yield
    finally:
        for _, module in wrapped:
            module.__dict__.pop("forward", None)


_NOT_PER_IMAGE: set[type] = set()  # tower classes whose output was laid out otherwise: not tried again


def _tower_kind(module: torch.nn.Module):
    if type(module) in _NOT_PER_IMAGE:
        return None
    parameters = _leading_parameters(type(module))
    if parameters == ("hidden_states", "grid_thw") and isinstance(getattr(module, "spatial_merge_size", None), int):
        return _packed
    if parameters[:1] == ("pixel_values",):
        return _batched
    return None


@functools.lru_cache(maxsize=None)
def _leading_parameters(cls: type) -> tuple[str, ...]:
    """The first two parameters of a module class's forward after self (read once per class)."""
    try:
        return tuple(inspect.signature(cls.forward).parameters)[1:3]
    except (TypeError, ValueError):
        return ()


def _packed(tower: torch.nn.Module, forward):
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
        images = [hidden_states[bounds[i]:bounds[i + 1]] for i in range(len(sizes))]
        first = _first_copies(images, [repr(g).encode() for g in grid_thw.tolist()])
        distinct = sorted(set(first))
        if len(distinct) == len(first):
            return forward(hidden_states, grid_thw, *args, **kwargs)
        out = forward(torch.cat([images[i] for i in distinct]), grid_thw[distinct], *args, **kwargs)
        merge = tower.spatial_merge_size ** 2
        order = _order(first, distinct)

        def expand(value: torch.Tensor) -> torch.Tensor:
            for per in (1, merge):  # per patch, or per merged token
                counts = [sizes[i] // per for i in distinct]
                if value.dim() and value.shape[0] == sum(counts) and all(sizes[i] % per == 0 for i in distinct):
                    parts = torch.split(value, counts)
                    return torch.cat([parts[j] for j in order])
            raise _NotPerImage

        try:
            return _laid_out(out, expand)
        except _NotPerImage:
            _NOT_PER_IMAGE.add(type(tower))
            return forward(hidden_states, grid_thw, *args, **kwargs)

    return run


def _batched(tower: torch.nn.Module, forward):
    def run(pixel_values, *args, **kwargs):
        if not isinstance(pixel_values, torch.Tensor) or pixel_values.dim() < 2:
            return forward(pixel_values, *args, **kwargs)
        n = pixel_values.shape[0]
        tensors = [v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)]
        if any(v.dim() == 0 or v.shape[0] != n for v in tensors):  # (not per image: left as they are)
            return forward(pixel_values, *args, **kwargs)
        given = [content_keys([t[i].reshape(1, -1) for i in range(n)]) for t in tensors]  # (what comes with each)
        first = _first_copies([pixel_values[i].reshape(1, -1) for i in range(n)],
                              [b"".join(keys) for keys in zip(*given)] if given else [b""] * n)
        distinct = sorted(set(first))
        if len(distinct) == n:
            return forward(pixel_values, *args, **kwargs)
        index = torch.tensor(distinct, device=pixel_values.device)

        def pick(v):
            return v.index_select(0, index) if isinstance(v, torch.Tensor) else v

        out = forward(pick(pixel_values), *map(pick, args), **{k: pick(v) for k, v in kwargs.items()})
        order = torch.tensor(_order(first, distinct), device=pixel_values.device)

        def expand(value: torch.Tensor) -> torch.Tensor:
            if value.dim() and value.shape[0] == len(distinct):
                return value.index_select(0, order.to(value.device))
            raise _NotPerImage

        try:
            return _laid_out(out, expand)
        except _NotPerImage:
            _NOT_PER_IMAGE.add(type(tower))
            return forward(pixel_values, *args, **kwargs)

    return run


def _order(first: list[int], distinct: list[int]) -> list[int]:
    """Per image, the place of its first copy among the distinct ones."""
    slot = {image: k for k, image in enumerate(distinct)}
    return [slot[i] for i in first]


def _first_copies(images: list[torch.Tensor], keys: list[bytes]) -> list[int]:
    """Per image ([rows, columns]), the index of the first image with the same key (its grid) and
    the same content key: engine/prompt_embeds.py's content_keys, which names the prefix cache's
    image embeddings too (one transfer for all)."""
    first: list[int] = []
    seen: dict[bytes, int] = {}
    for i, content in enumerate(content_keys(images)):
        first.append(seen.setdefault(keys[i] + content, i))
    return first


def _laid_out(value, expand):
    """The tower's output for the distinct images laid out for every image of the call: `expand` on
    each tensor (raising _NotPerImage where it is not per image), through lists, tuples and model
    outputs."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return expand(value)
    if isinstance(value, dict):  # (transformers' ModelOutput is one)
        return type(value)(**{k: _laid_out(v, expand) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return type(value)(_laid_out(v, expand) for v in value)
    raise _NotPerImage
