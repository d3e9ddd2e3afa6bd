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
sequence) has the tower run on every image, as before. Given an engine's TowerOutputCache
(model/vision_feature_cache.py), images encoded by an earlier call are taken from it and not encoded again;
a call of one image (a served request's merge) keeps that image's whole output, which a later call of
that image alone takes, before any call has shown how the tower lays out several.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Callable, Iterator

import torch

from hf_async_cb.engine.prompt_embeds import content_keys
from hf_async_cb.model.vision_feature_cache import TowerOutputCache


class _NotPerImage(Exception):
    """An output of the tower that is not laid out per patch or per merged token."""


@contextlib.contextmanager
def distinct_images(model: torch.nn.Module, cache: TowerOutputCache | None = None) -> Iterator[None]:
    """While the block runs, the model's vision towers encode each distinct image of a call once,
    and none that `cache` holds from an earlier call."""
    wrapped: list[tuple[str, torch.nn.Module]] = []
    for name, module in model.named_modules():
        if any(name.startswith(outer + ".") for outer, _ in wrapped) or "forward" in vars(module):
            continue  # (a tower's own parts run on what the tower gives them)
        kind = _tower_kind(module)
        if kind is not None:
            module.forward = kind(module, type(module).forward.__get__(module), _Images(module, name, cache))
            wrapped.append((name, module))
    try:
        yield
    finally:
        for _, module in wrapped:
            module.__dict__.pop("forward", None)


_NOT_PER_IMAGE: set[type] = set()  # tower classes whose output was laid out otherwise: not tried again
_PER_IMAGE: set[type] = set()  # tower classes whose outputs of two or more images split per image


def _tower_kind(module: torch.nn.Module):
    if type(module) in _NOT_PER_IMAGE:
        return None
    parameters = _leading_parameters(type(module).forward)
    if parameters == ("hidden_states", "grid_thw") and isinstance(getattr(module, "spatial_merge_size", None), int):
        return _packed
    if parameters[:1] == ("pixel_values",):
        return _batched
    return None


@functools.lru_cache(maxsize=None)
def _leading_parameters(forward) -> tuple[str, ...]:
    """The first two parameters of a module class's forward after self (read once per function)."""
    try:
        return tuple(inspect.signature(forward).parameters)[1:3]
    except (TypeError, ValueError):
        return ()


def _packed(tower: torch.nn.Module, forward, images: "_Images"):
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
        patches = [hidden_states[bounds[i]:bounds[i + 1]] for i in range(len(sizes))]
        keys = [g + c for g, c in zip((repr(g).encode() for g in grid_thw.tolist()), content_keys(patches))]
        merge = tower.spatial_merge_size ** 2

        def encode(indices: list[int]):
            if indices == list(range(len(sizes))):
                return forward(hidden_states, grid_thw, *args, **kwargs)
            return forward(torch.cat([patches[i] for i in indices]), grid_thw[indices], *args, **kwargs)

        def split(value: torch.Tensor, indices: list[int]) -> list[torch.Tensor]:
            for per in (1, merge):  # per patch, or per merged token
                counts = [sizes[i] // per for i in indices]
                if value.dim() and value.shape[0] == sum(counts) and all(sizes[i] % per == 0 for i in indices):
                    return list(torch.split(value, counts))
            raise _NotPerImage

        return images.encode(keys, repr(sorted(kwargs.items())), encode, split,
                             lambda: forward(hidden_states, grid_thw, *args, **kwargs))

    return run


def _batched(tower: torch.nn.Module, forward, images: "_Images"):
    def run(pixel_values, *args, **kwargs):
        if not isinstance(pixel_values, torch.Tensor) or pixel_values.dim() < 2:
            return forward(pixel_values, *args, **kwargs)
        n = pixel_values.shape[0]
        tensors = [v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)]
        if any(v.dim() == 0 or v.shape[0] != n for v in tensors):  # (not per image: left as they are)
            return forward(pixel_values, *args, **kwargs)
        given = [content_keys([t[i].reshape(1, -1) for i in range(n)]) for t in tensors]  # (what comes with each)
        keys = [b"".join(parts) for parts in zip(content_keys([pixel_values[i].reshape(1, -1) for i in range(n)]),
                                                   *given)]
        # The call's other arguments name the entries too, tensors by their place (their content is in the keys).
        others = repr([(k, "tensor" if isinstance(v, torch.Tensor) else v)
                       for k, v in (*enumerate(args), *sorted(kwargs.items()))])

        def encode(indices: list[int]):
            if indices == list(range(n)):
                return forward(pixel_values, *args, **kwargs)
            index = torch.tensor(indices, device=pixel_values.device)

            def pick(v):
                return v.index_select(0, index.to(v.device)) if isinstance(v, torch.Tensor) else v

            return forward(pick(pixel_values), *map(pick, args), **{k: pick(v) for k, v in kwargs.items()})

        def split(value: torch.Tensor, indices: list[int]) -> list[torch.Tensor]:
            if value.dim() and value.shape[0] == len(indices):
                return list(value.split(1))
            raise _NotPerImage

        return images.encode(keys, others, encode, split, lambda: forward(pixel_values, *args, **kwargs))

    return run


class _Images:
    """One tower's way through a call's images: each distinct one encoded once, those an earlier
    call encoded taken from the cache."""

    def __init__(self, tower: torch.nn.Module, name: str, cache: TowerOutputCache | None) -> None:
        self.tower, self.name = tower, name
        self.cache = cache if cache is not None and cache.max_bytes else None

    def encode(self, keys: list[bytes], others: str, encode: Callable[[list[int]], object],
               split: Callable[[torch.Tensor, list[int]], list[torch.Tensor]], every: Callable[[], object]):
        """The tower's output for images named by `keys`: `encode(indices)` runs it on some of them,
        `split(tensor, indices)` gives an output tensor's share of each (or raises _NotPerImage);
        `every()` is the plain forward over all of them."""
        n = len(keys)
        seen: dict[bytes, int] = {}
        first = [seen.setdefault(key, i) for i, key in enumerate(keys)]  # per image, its first copy
        distinct = sorted(set(first))
        shown = type(self.tower) in _PER_IMAGE
        cache = self.cache
        if n == 1 and cache is not None and not shown:
            return self._alone(keys[0], others, every)
        held = {}
        if cache is not None and shown:
            for i in distinct:
                entry = cache.get((self.name, others, keys[i]))
                if entry is not None:
                    held[i] = entry
        todo = [i for i in distinct if i not in held]
        if not shown and len(todo) < 2:
            # One image's output cannot show that it is laid out per image (a tower that packs its
            # images into one sequence, as Pixtral's, gives one row either way): every image, as stock.
            todo, held = list(range(n)), {}
        everything = todo == list(range(n))
        if everything and (cache is None or not shown and n < 2):
            return every()
        out = encode(todo) if todo else None
        try:
            fresh, rebuild = {}, None
            if out is not None:
                leaves, rebuild = _flatten(out)
                shares = [split(leaf, todo) for leaf in leaves]
                fresh = {i: [share[k] for share in shares] for k, i in enumerate(todo)}
                _PER_IMAGE.add(type(self.tower))  # (at least two images, each with its share of every output)
                if cache is not None:
                    for i, parts in fresh.items():
                        cache.put((self.name, others, keys[i]), rebuild, parts)
            if everything:
                return out
            parts = {**{i: list(entry.parts) for i, entry in held.items()}, **fresh}
            rebuild = rebuild or held[distinct[0]].rebuild
            width = {len(p) for p in parts.values()}
            if len(width) != 1:
                raise _NotPerImage
            return rebuild([torch.cat([parts[first[i]][leaf] for i in range(n)]) for leaf in range(width.pop())])
        except _NotPerImage:
            _NOT_PER_IMAGE.add(type(self.tower))
            _PER_IMAGE.discard(type(self.tower))
            return out if everything else every()

    def _alone(self, key: bytes, others: str, every: Callable[[], object]):
        """A call's one image, through a tower not yet seen laying several out per image (a serving
        loop merges one request at a time): its whole output is that image's, kept as a whole and
        given back as a whole, to a call of that image alone (never combined with others' outputs)."""
        name = (self.name, others, key, "alone")
        entry = self.cache.get(name)
        if entry is not None:
            return entry.rebuild([p.clone() if p is not None else None for p in entry.parts])
        out = every()
        try:
            leaves, rebuild = _flatten(out)
        except _NotPerImage:
            return out
        self.cache.put(name, rebuild, leaves)
        return out


def _flatten(value) -> tuple[list[torch.Tensor], Callable[[list], object]]:
    """The tensors of a tower's output (through lists, tuples and model outputs; raising _NotPerImage
    at anything else) and the function that lays other tensors out the same way."""
    leaves: list[torch.Tensor] = []

    def walk(v):
        if v is None:
            return lambda got: None
        if isinstance(v, torch.Tensor):
            leaves.append(v)
            k = len(leaves) - 1
            return lambda got: got[k]
        if isinstance(v, dict):  # (transformers' ModelOutput is one)
            kind, parts = type(v), {key: walk(x) for key, x in v.items()}
            return lambda got: kind(**{key: part(got) for key, part in parts.items()})
        if isinstance(v, (list, tuple)):
            kind, items = type(v), [walk(x) for x in v]
            return lambda got: kind(item(got) for item in items)
        raise _NotPerImage

    return leaves, walk(value)
