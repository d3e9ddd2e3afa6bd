"""The paged KV cache: a transformers Cache the attention layers write into (pages are handed out by
engine.page_allocator).

Layout, per layer: keys and values are flat [num_pages * page_size, heads, dim] tensors, their
heads and dims measured per layer (model.kv_layout: keys and values may differ, as in MLA); token t
of a request lives at slot pages[t // page_size] * page_size + t % page_size. The model's attention
layers call `update()` through transformers' standard path; it scatters the step's new K/V into
their slots and hands back the whole layer pool, viewed as a stock cache's [1, heads, slots, dim]
(no copy). A layer that transforms its cached states before attending (DeepSeek's MLA expands
its latents: LayerKV.gathered) gets instead each request's context gathered into one
[1, heads, requests x context bucket, dim] tensor, so that it transforms what the step reads, not
the pool; the attention then reads it through StepMetadata.gathered_view(). Our attention function
turns either form back into [slots, heads, dim] and reads what each request needs through the step's
metadata.
"""

from __future__ import annotations

import inspect
import weakref

import torch
from transformers.cache_utils import Cache

from hf_async_cb.model.kv_layout import KVLayout


_POOLS: "weakref.WeakSet[PagedKVCache]" = weakref.WeakSet()  # every pool not yet freed, in use or not


def pools_alive() -> int:
    """Pools of this process not yet freed: in use, or dropped but waiting in a reference cycle."""
    return len(_POOLS)


class PagedKVCache(Cache):
    """A transformers Cache over a pool of fixed-size pages shared by all requests.

    The engine sets `step` (the current StepMetadata) before each forward; `update()` writes the
    new tokens at `step.slot_mapping` and returns the layer's whole pool.
    """

    is_compileable = False
    # Pool memory order: slot-major ([slots, heads, dim]: a slot's heads side by side), or head-major
    # (each head's slots in one run, seen through a [slots, heads, dim] view, so every consumer is the
    # same). Which one streams faster in decode attention is measured by benchmarks/ab_attention.py.
    HEAD_MAJOR = False

    def __init__(self, layout: KVLayout, num_pages: int, page_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__(layers=[])
        self.layout = layout
        self.num_pages = num_pages
        self.page_size = page_size
        self.keys = [self._pool(num_pages * page_size, kv.key_heads, kv.key_dim, dtype, device) for kv in layout.layers]
        self.values = [self._pool(num_pages * page_size, kv.value_heads, kv.value_dim, dtype, device)
                       for kv in layout.layers]
        self.step = None
        if device.type != "meta":
            _POOLS.add(self)

    def free(self) -> None:
        """Let the pool's memory go now, whoever still holds this cache (a closed engine's parts, a
        reference cycle): what runs next, such as giving the model its weights back, may need it."""
        self.keys, self.values = [], []
        _POOLS.discard(self)

    def _pool(self, slots: int, heads: int, dim: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        # torch.empty: slots are always written before they are read.
        if self.HEAD_MAJOR:
            return torch.empty(heads, slots, dim, dtype=dtype, device=device).transpose(0, 1)
        return torch.empty(slots, heads, dim, dtype=dtype, device=device)

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
        """Scatter the step's new K/V ([1, heads, T, dim]) into their slots, or in a decode step on the
        Triton kernels leave them to the attention kernel (StepMetadata.pending_kv); return the layer's
        pools as [1, heads, slots, dim] views (pool_of() turns them back)."""
        if self.step is None:
            raise RuntimeError("PagedKVCache.update called outside an engine step")
        slots = self.step.slot_mapping
        if self.step.prefix_kv is not None:  # positions whose K/V are given (model/prefix_kv.py)
            key_states, value_states = self.step.prefix_kv.replace(key_states, value_states, layer_idx)
        k_pool, v_pool = self.keys[layer_idx], self.values[layer_idx]
        dense = key_states.stride(-1) == 1 and value_states.stride(-1) == 1
        gathered = self.layout.layers[layer_idx].gathered
        if dense and self.step.attention_stores_kv and not gathered:
            # The attention kernel stores them (the model attends over these very pools: a layer that
            # transforms them first is a gathered one); store_pending() catches any it did not take.
            self.step.pending_kv[k_pool.data_ptr()] = (key_states, value_states, k_pool, v_pool)
        elif self.step.backend == "triton" and dense:
            from hf_async_cb.kernels.store_kv import store_kv

            store_kv(k_pool, v_pool, key_states, value_states, slots)
        else:
            k_pool.index_copy_(0, slots, key_states[0].transpose(0, 1).to(k_pool.dtype))
            v_pool.index_copy_(0, slots, value_states[0].transpose(0, 1).to(v_pool.dtype))
        # A layer that transforms its states before attending (MLA latents) gets only the step's contexts.
        self.step.kv_gathered = gathered
        if gathered:
            index = self.step.gathered_view()["index"]
            return k_pool[index].transpose(0, 1)[None], v_pool[index].transpose(0, 1)[None]
        return k_pool.transpose(0, 1)[None], v_pool.transpose(0, 1)[None]

    def copy_slots(self, source: torch.Tensor, destination: torch.Tensor) -> None:
        """Every layer's K/V at slots `source` [N] written again at `destination` [N]."""
        for pool in self.keys + self.values:
            pool.index_copy_(0, destination, pool.index_select(0, source))

    def store_pending(self) -> None:
        """Store the new K/V that no attention call took from the step (a safety net: each layer's
        attention takes its own)."""
        if self.step is not None and self.step.pending_kv:
            from hf_async_cb.kernels.store_kv import store_kv

            for key_states, value_states, k_pool, v_pool in self.step.pending_kv.values():
                store_kv(k_pool, v_pool, key_states, value_states, self.step.slot_mapping)
            self.step.pending_kv.clear()

    @staticmethod
    def pool_of(states: torch.Tensor) -> torch.Tensor:
        """[1, heads, slots, dim] states over a whole pool (update's views, or what the model made
        of them) -> [slots, heads, dim], the layout the attention kernels index by slot."""
        return states[0].transpose(0, 1)

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)


def cache_keyword(model: torch.nn.Module) -> str:
    """The forward keyword of the KV cache: `past_key_values` (<= 5.23) or `cache` (newer)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"
