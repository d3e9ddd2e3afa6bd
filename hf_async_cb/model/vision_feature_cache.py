"""A vision tower's outputs per image, kept across calls, so that an image seen before is not encoded
again.

A chat's later turns send the conversation's image again with a longer prompt; RL epochs and
evaluation reruns send the same images again; a served request often repeats an earlier one's
image. The prefix cache serves their prompt pages, but only once the merge (model/vision.py) has
computed the image embeddings that name those pages, so every such call ran the tower again. The
merge's towers (model/vision_dedupe.py) take each image's outputs from here when they have them
and encode only the others.

An entry is one image's share of every output tensor of one tower call, named by the tower, the
call's other arguments and the image's content key (with whatever the tower is given per image).
The cache belongs to an Engine (a rebuilt engine starts empty) and checks the model's fingerprint
(model/kv_fingerprint.py: weight versions and storages, adapter states) at every merge: any change
empties it, as it empties the prefix cache; `Engine.clear_prefix_cache()` empties both. Entries are
copies on the model's device, bounded in bytes, least recently used evicted first.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import torch

from hf_async_cb.model.kv_fingerprint import kv_fingerprint


@dataclass(frozen=True)
class TowerEntry:
    """One image's outputs: `parts` per output tensor (None where the output is None), laid out
    again by `rebuild` (the output's structure: lists, tuples, model outputs)."""

    rebuild: Callable[[list], object]
    parts: tuple[torch.Tensor | None, ...]
    nbytes: int


class TowerOutputCache:
    """Per image, what a vision tower gave for it; see the module docstring."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max(0, int(max_bytes))
        self._entries: OrderedDict[tuple, TowerEntry] = OrderedDict()
        self._fingerprint = None
        self.bytes = 0
        self.hits = self.misses = self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def check(self, model: torch.nn.Module, content: bool = True, fingerprint=False) -> None:
        """Before a merge: empty the cache if the model may compute other outputs than when it was
        filled (or when that cannot be told: inference tensors keep no version counter). `content`:
        read the weights' values too (model/kv_fingerprint.py), which a serving loop's merges skip.
        `fingerprint`: kv_fingerprint(model, content=True) as the caller read it just now (the engine's
        check_caches), instead of a reading of its own."""
        if not self.max_bytes:  # (off: nothing to check)
            return
        if fingerprint is False:
            fingerprint = kv_fingerprint(model, content=content)
        else:
            content = True
        known = self._fingerprint
        if not content and known is not None:  # compare what both read: the counters and settings
            known = known[:len(fingerprint)] if fingerprint is not None else None
        if fingerprint is None or fingerprint != known:
            self.clear()
        if content or fingerprint is None or self._fingerprint is None or fingerprint != known:
            self._fingerprint = fingerprint

    def get(self, key: tuple) -> TowerEntry | None:
        entry = self._entries.get(key)
        if entry is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return entry

    def put(self, key: tuple, rebuild: Callable[[list], object], parts: list[torch.Tensor | None]) -> None:
        """Keep a copy of one image's outputs, if it fits the bound (older entries evicted)."""
        nbytes = sum(p.numel() * p.element_size() for p in parts if p is not None)
        if nbytes > self.max_bytes or key in self._entries:
            return
        while self.bytes + nbytes > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self.bytes -= old.nbytes
            self.evictions += 1
        copies = tuple(p.detach().clone() if p is not None else None for p in parts)
        self._entries[key] = TowerEntry(rebuild, copies, nbytes)
        self.bytes += nbytes

    def clear(self) -> None:
        self._entries.clear()
        self.bytes = 0

    def stats(self) -> dict:
        return dict(images=len(self._entries), bytes=self.bytes, hits=self.hits, misses=self.misses,
                    evictions=self.evictions)
