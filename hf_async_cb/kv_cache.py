"""The paged KV cache: a page allocator and a transformers Cache the attention layers write into.

Layout, per layer: keys and values are flat [num_pages * page_size, num_kv_heads, head_dim]
tensors; token t of a request lives at slot pages[t // page_size] * page_size + t % page_size.
The model's attention layers call `update()` through transformers' standard path; it scatters
the step's new K/V into their slots and hands the whole layer pool to our attention function,
which reads what each request needs through the step's metadata.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache


class PageAllocator:
    """Free list with reference counts (a page shared by several sequences is freed last)."""

    def __init__(self, num_pages: int) -> None:
        if num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {num_pages}.")
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low pages first
        self._refs = [0] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            raise MemoryError(f"asked for {n} KV pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def _check(self, page: int) -> None:
        if not 0 <= page < self.num_pages:
            raise ValueError(f"page {page} is not in the pool [0, {self.num_pages})")

    def share(self, pages: list[int]) -> None:
        for p in pages:
            self._check(p)
            if self._refs[p] <= 0:
                raise RuntimeError(f"page {p} is not allocated and cannot be shared")
            self._refs[p] += 1

    def free(self, pages: list[int]) -> None:
        for p in pages:
            self._check(p)
            if self._refs[p] <= 0:
                raise RuntimeError(f"page {p} freed twice")
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.append(p)

    def ref_count(self, page: int) -> int:
        return self._refs[page]


@dataclass(frozen=True)
class KVLayout:
    """Shapes of the model's K/V, read from its config."""

    num_layers: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def from_config(cls, config) -> "KVLayout":
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        return cls(config.num_hidden_layers, num_kv_heads, head_dim)

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * torch.finfo(dtype).bits // 8


class PagedKVCache(Cache):
    """A transformers Cache over a pool of fixed-size pages shared by all requests.

    The engine sets `step` (the current StepMetadata) before each forward; `update()` writes the
    new tokens at `step.slot_mapping` and returns the layer's whole pool.
    """

    is_compileable = False

    def __init__(self, layout: KVLayout, num_pages: int, page_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__(layers=[])
        self.layout = layout
        self.num_pages = num_pages
        self.page_size = page_size
        shape = (num_pages * page_size, layout.num_kv_heads, layout.head_dim)
        # torch.empty: slots are always written before they are read.
        self.keys = [torch.empty(shape, dtype=dtype, device=device) for _ in range(layout.num_layers)]
        self.values = [torch.empty(shape, dtype=dtype, device=device) for _ in range(layout.num_layers)]
        self.step = None

    # transformers' mask and generation helpers look at these; the paged cache is one full-attention pool.
    @property
    def is_sliding(self) -> list[bool]:
        return [False] * self.layout.num_layers

    @property
    def is_linear(self) -> list[bool]:
        return [False] * self.layout.num_layers

    @property
    def is_dummy(self) -> list[bool]:
        return [False] * self.layout.num_layers

    def __len__(self) -> int:
        return self.layout.num_layers

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions are always passed explicitly

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Scatter the step's new K/V ([1, kv_heads, T, head_dim]) into their slots."""
        if self.step is None:
            raise RuntimeError("PagedKVCache.update called outside an engine step")
        slots = self.step.slot_mapping
        k_pool, v_pool = self.keys[layer_idx], self.values[layer_idx]
        if self.step.backend == "triton" and key_states.stride(-1) == 1 and value_states.stride(-1) == 1:
            from .attention.store_kv import store_kv

            store_kv(k_pool, v_pool, key_states, value_states, slots)
        else:
            k_pool.index_copy_(0, slots, key_states[0].transpose(0, 1).to(k_pool.dtype))
            v_pool.index_copy_(0, slots, value_states[0].transpose(0, 1).to(v_pool.dtype))
        return k_pool, v_pool

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)
