"""The paged KV cache: a transformers Cache the attention layers write into (pages are handed out by
engine.page_allocator).

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
            from hf_async_cb.kernels.store_kv import store_kv

            store_kv(k_pool, v_pool, key_states, value_states, slots)
        else:
            k_pool.index_copy_(0, slots, key_states[0].transpose(0, 1).to(k_pool.dtype))
            v_pool.index_copy_(0, slots, value_states[0].transpose(0, 1).to(v_pool.dtype))
        return k_pool, v_pool

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)
