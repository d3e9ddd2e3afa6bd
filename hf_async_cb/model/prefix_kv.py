"""Keys and values given per layer for a request's first positions, instead of computed: PEFT
prefix tuning's virtual tokens (generate/prompt_learning.py).

A request with a prefix starts with `count` placeholder tokens (PromptEmbeds.kv, engine/prompt_embeds.py).
The chunk that covers them runs eagerly, like any chunk that feeds prompt embeddings: the model
computes keys and values for the placeholders as for any token, and PagedKVCache.update replaces
them, layer by layer, with the prefix's own before they are stored (StepPrefixKV), whichever path
stores them (index_copy_, the store kernel, or the attention kernel's pending store). The keys are
used as given (no rotary: the model applied it to the placeholders' keys, which are dropped), and
every later token of the request attends to them as to any earlier key. The placeholders' own
hidden states reach nothing else: their queries' outputs feed only their own later layers, whose
keys and values are replaced in turn, and no logits are taken there.

The pages that hold them are keyed in the prefix cache by the prefix's content (`key`), so the rows
of a call and later calls with the same adapter share them, and nothing else does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(eq=False)
class PrefixKV:
    """Per layer, keys [key_heads, count, key_dim] and values [value_heads, count, value_dim]."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    key: bytes  # names their content (the prefix cache's salt for the pages holding them)
    name: str = "a K/V prefix"  # what the errors call it

    @property
    def count(self) -> int:
        return self.keys[0].shape[1]

    def checked(self, layout, dtype: torch.dtype, device: torch.device) -> "PrefixKV":
        """These K/V on the pool's device and in its dtype; a ValueError unless every layer of
        `layout` (model/kv_layout.py) stores exactly their shapes and attends over what it stores."""
        if len(self.keys) != layout.num_layers or len(self.values) != layout.num_layers:
            raise ValueError(f"{self.name} gives keys and values for {len(self.keys)} layers; the model caches "
                             f"{layout.num_layers}.")
        for i, (k, v, layer) in enumerate(zip(self.keys, self.values, layout.layers)):
            if layer.gathered:
                raise ValueError(f"{self.name}: layer {i} transforms its cached states before attending (as MLA "
                                 "does), so keys and values given for its cache have no meaning the engine can keep.")
            want_k = (layer.key_heads, self.count, layer.key_dim)
            want_v = (layer.value_heads, self.count, layer.value_dim)
            if tuple(k.shape) != want_k or tuple(v.shape) != want_v:
                raise ValueError(f"{self.name}: layer {i} gets keys {tuple(k.shape)} and values {tuple(v.shape)} "
                                 f"([heads, tokens, dim]); the model caches {want_k} and {want_v}.")
        tensors = self.keys + self.values
        if all(t.device == device and t.dtype == dtype and t.is_contiguous() and not t.requires_grad for t in tensors):
            return self
        move = [t.detach().to(device, dtype).contiguous() for t in tensors]
        n = len(self.keys)
        return PrefixKV(move[:n], move[n:], self.key, self.name)


@dataclass(eq=False)
class StepPrefixKV:
    """One eager step's prefix slots: `index` [N] the rows of the packed stream that are prefix
    positions (on the device), and `pieces`, per chunk in stream order, (prefix, first, stop): the
    prefix positions [first, stop) that chunk feeds."""

    index: torch.Tensor
    pieces: list[tuple[PrefixKV, int, int]]

    def replace(self, key_states: torch.Tensor, value_states: torch.Tensor,
                layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's new K/V of `layer` ([1, heads, T, dim]) with the prefix's at its rows."""
        return self._put(key_states, [p.keys[layer][:, a:b] for p, a, b in self.pieces]), \
            self._put(value_states, [p.values[layer][:, a:b] for p, a, b in self.pieces])

    def _put(self, states: torch.Tensor, pieces: list[torch.Tensor]) -> torch.Tensor:
        given = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)
        states = states.clone()  # (keeps the strides: the model's view of its projection's output)
        states[0][:, self.index] = given.to(states.dtype)
        return states
