"""Unit tests of the page allocator and of PagedKVCache.update (the scatter into the pools)."""

from __future__ import annotations

import pytest
import torch

from hf_async_cb.engine.page_allocator import PageAllocator
from hf_async_cb.model.kv_cache import PagedKVCache
from hf_async_cb.model.kv_layout import KVLayout
from hf_async_cb.model.step_metadata import StepMetadata

# -- PageAllocator -------------------------------------------------------------------------


def test_new_allocator_is_all_free():
    """A fresh allocator has every page free and no references."""
    alloc = PageAllocator(5)
    assert alloc.num_pages == 5
    assert alloc.num_free == 5
    assert all(alloc.ref_count(p) == 0 for p in range(5))


@pytest.mark.parametrize("n", [0, -3])
def test_non_positive_size_rejected(n):
    """An allocator needs at least one page."""
    with pytest.raises(ValueError):
        PageAllocator(n)


def test_allocate_hands_out_distinct_pages_low_first():
    """allocate(n) returns n distinct pages (lowest first) with ref count 1."""
    alloc = PageAllocator(6)
    first = alloc.allocate(2)
    second = alloc.allocate(3)
    assert first == [0, 1]
    assert second == [2, 3, 4]
    assert alloc.num_free == 1
    for p in first + second:
        assert alloc.ref_count(p) == 1
    assert alloc.ref_count(5) == 0


def test_allocate_zero_is_a_no_op():
    """allocate(0) returns nothing and takes nothing."""
    alloc = PageAllocator(3)
    assert alloc.allocate(0) == []
    assert alloc.num_free == 3


def test_allocate_whole_pool_then_memory_error():
    """The whole pool can be taken; one more page raises MemoryError."""
    alloc = PageAllocator(4)
    pages = alloc.allocate(4)
    assert sorted(pages) == [0, 1, 2, 3]
    assert alloc.num_free == 0
    with pytest.raises(MemoryError):
        alloc.allocate(1)


def test_failed_allocate_changes_nothing():
    """A MemoryError leaves the free list and ref counts untouched (no partial allocation)."""
    alloc = PageAllocator(4)
    held = alloc.allocate(2)
    with pytest.raises(MemoryError):
        alloc.allocate(3)
    assert alloc.num_free == 2
    assert [alloc.ref_count(p) for p in range(4)] == [1, 1, 0, 0]
    # The two remaining pages are still usable.
    rest = alloc.allocate(2)
    assert sorted(held + rest) == [0, 1, 2, 3]


def test_free_returns_pages_and_they_are_reused():
    """Freed pages go back to the free list and are handed out again."""
    alloc = PageAllocator(3)
    pages = alloc.allocate(3)
    alloc.free([pages[1]])
    assert alloc.num_free == 1
    assert alloc.ref_count(pages[1]) == 0
    assert alloc.allocate(1) == [pages[1]]
    assert alloc.num_free == 0


def test_double_free_raises():
    """Freeing a page that is not allocated raises RuntimeError."""
    alloc = PageAllocator(3)
    pages = alloc.allocate(2)
    alloc.free(pages)
    with pytest.raises(RuntimeError):
        alloc.free([pages[0]])
    with pytest.raises(RuntimeError):
        alloc.free([2])  # never allocated
    assert alloc.num_free == 3


def test_shared_page_is_freed_last():
    """share() adds a reference; the page returns to the free list only at ref count zero."""
    alloc = PageAllocator(4)
    pages = alloc.allocate(2)
    alloc.share(pages)
    alloc.share([pages[0]])
    assert alloc.ref_count(pages[0]) == 3
    assert alloc.ref_count(pages[1]) == 2
    assert alloc.num_free == 2

    alloc.free(pages)
    assert alloc.ref_count(pages[0]) == 2
    assert alloc.ref_count(pages[1]) == 1
    assert alloc.num_free == 2

    alloc.free(pages)
    assert alloc.ref_count(pages[0]) == 1
    assert alloc.ref_count(pages[1]) == 0
    assert alloc.num_free == 3

    alloc.free([pages[0]])
    assert alloc.ref_count(pages[0]) == 0
    assert alloc.num_free == 4
    with pytest.raises(RuntimeError):
        alloc.free([pages[0]])


def test_share_unallocated_page_raises():
    """A free page cannot be shared."""
    alloc = PageAllocator(2)
    with pytest.raises(RuntimeError):
        alloc.share([0])
    assert alloc.ref_count(0) == 0
    assert alloc.num_free == 2


def test_random_alloc_free_keeps_accounting():
    """Over a random sequence of allocate/share/free, free + allocated == num_pages and no page is duplicated."""
    import random

    rng = random.Random(0)
    n_pages = 16
    alloc = PageAllocator(n_pages)
    refs = [0] * n_pages  # model of the expected ref counts
    for _ in range(2000):
        op = rng.random()
        if op < 0.4:
            k = rng.randint(0, 5)
            if k > alloc.num_free:
                with pytest.raises(MemoryError):
                    alloc.allocate(k)
            else:
                got = alloc.allocate(k)
                assert len(set(got)) == k
                for p in got:
                    assert refs[p] == 0
                    refs[p] = 1
        elif op < 0.55:
            live = [p for p in range(n_pages) if refs[p] > 0]
            if live:
                p = rng.choice(live)
                alloc.share([p])
                refs[p] += 1
        else:
            live = [p for p in range(n_pages) if refs[p] > 0]
            if live:
                p = rng.choice(live)
                alloc.free([p])
                refs[p] -= 1
        assert [alloc.ref_count(p) for p in range(n_pages)] == refs
        assert alloc.num_free == sum(r == 0 for r in refs)


# -- PagedKVCache.update -------------------------------------------------------------------------

SENTINEL = -7.0


def _cache(num_layers=2, kv_heads=3, head_dim=4, num_pages=5, page_size=4, dtype=torch.float32):
    layout = KVLayout.uniform(num_layers, kv_heads, head_dim)
    cache = PagedKVCache(layout, num_pages=num_pages, page_size=page_size, dtype=dtype,
                         device=torch.device("cpu"))
    for t in cache.keys + cache.values:
        t.fill_(SENTINEL)
    return cache


def _step(slots: list[int]) -> StepMetadata:
    """One request whose n new tokens go to `slots` (its whole context is these tokens)."""
    n = len(slots)
    return StepMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        block_table=torch.zeros(1, 1, dtype=torch.long),  # update() reads slot_mapping only
        query_start=torch.tensor([0, n]),
        context_lens=torch.tensor([n]),
        page_size=4,
        max_query_len=n,
        max_context=n,
    )


def test_pool_shapes():
    """Each layer gets flat [num_pages * page_size, kv_heads, head_dim] key and value pools."""
    cache = _cache(num_layers=3, kv_heads=2, head_dim=8, num_pages=6, page_size=4)
    assert len(cache) == 3
    assert len(cache.keys) == len(cache.values) == 3
    for t in cache.keys + cache.values:
        assert t.shape == (24, 2, 8)
    assert cache.bytes == 2 * 3 * 24 * 2 * 8 * 4


def test_update_without_step_raises():
    """update() outside an engine step (cache.step is None) raises RuntimeError."""
    cache = _cache()
    k = torch.zeros(1, 3, 2, 4)
    with pytest.raises(RuntimeError):
        cache.update(k, k.clone(), 0)


@pytest.mark.parametrize("slots", [
    [0],
    [5],
    [0, 1, 2, 3],
    [19, 3, 8, 12, 13],  # scattered, out of order, across pages
    list(range(20)),  # the whole pool
])
@pytest.mark.parametrize("head_major", [False, True])
def test_update_writes_exactly_the_slots(slots, head_major, monkeypatch):
    """update() writes key/value token t at slot_mapping[t] of the given layer and touches nothing
    else, in either pool memory order."""
    monkeypatch.setattr(PagedKVCache, "HEAD_MAJOR", head_major)
    cache = _cache()
    assert cache.keys[0].is_contiguous() != head_major and cache.keys[0].transpose(0, 1).is_contiguous() == head_major
    T = len(slots)
    gen = torch.Generator().manual_seed(T)
    key_states = torch.randn(1, 3, T, 4, generator=gen)
    value_states = torch.randn(1, 3, T, 4, generator=gen)
    cache.step = _step(slots)
    layer = 1
    k_view, v_view = cache.update(key_states, value_states, layer)
    k_pool, v_pool = PagedKVCache.pool_of(k_view), PagedKVCache.pool_of(v_view)

    # The returned states are [1, heads, slots, dim] views of the layer's pools, not copies.
    assert k_view.shape == (1, 3, 20, 4) and k_view.data_ptr() == cache.keys[layer].data_ptr()
    assert v_view.data_ptr() == cache.values[layer].data_ptr()
    assert torch.equal(k_pool, cache.keys[layer]) and torch.equal(v_pool, cache.values[layer])
    for t, slot in enumerate(slots):
        torch.testing.assert_close(k_pool[slot], key_states[0, :, t, :], rtol=0, atol=0)
        torch.testing.assert_close(v_pool[slot], value_states[0, :, t, :], rtol=0, atol=0)
    untouched = torch.ones(k_pool.shape[0], dtype=torch.bool)
    untouched[torch.tensor(slots)] = False
    assert (k_pool[untouched] == SENTINEL).all()
    assert (v_pool[untouched] == SENTINEL).all()
    # Other layers are untouched.
    for other in range(len(cache)):
        if other != layer:
            assert (cache.keys[other] == SENTINEL).all()
            assert (cache.values[other] == SENTINEL).all()


def test_update_keys_and_values_independent():
    """Keys go to the key pool and values to the value pool (not swapped or mixed)."""
    cache = _cache(num_layers=1)
    cache.step = _step([2, 9])
    k = torch.full((1, 3, 2, 4), 1.0)
    v = torch.full((1, 3, 2, 4), 2.0)
    k_pool, v_pool = map(PagedKVCache.pool_of, cache.update(k, v, 0))
    assert (k_pool[[2, 9]] == 1.0).all()
    assert (v_pool[[2, 9]] == 2.0).all()


def test_update_successive_steps_accumulate():
    """A second step writes its own slots and keeps what the first step wrote."""
    cache = _cache(num_layers=1)
    k1, v1 = torch.randn(1, 3, 3, 4), torch.randn(1, 3, 3, 4)
    cache.step = _step([4, 5, 6])
    cache.update(k1, v1, 0)
    k2, v2 = torch.randn(1, 3, 1, 4), torch.randn(1, 3, 1, 4)
    cache.step = _step([7])
    k_pool, v_pool = map(PagedKVCache.pool_of, cache.update(k2, v2, 0))
    expected_k = torch.cat([k1[0], k2[0]], dim=1).transpose(0, 1)  # [4, heads, dim]
    expected_v = torch.cat([v1[0], v2[0]], dim=1).transpose(0, 1)
    torch.testing.assert_close(k_pool[4:8], expected_k, rtol=0, atol=0)
    torch.testing.assert_close(v_pool[4:8], expected_v, rtol=0, atol=0)
    assert (k_pool[:4] == SENTINEL).all() and (k_pool[8:] == SENTINEL).all()
    assert (v_pool[:4] == SENTINEL).all() and (v_pool[8:] == SENTINEL).all()


def test_update_overwrites_a_slot():
    """Writing a slot again replaces its previous contents."""
    cache = _cache(num_layers=1)
    cache.step = _step([3])
    cache.update(torch.ones(1, 3, 1, 4), torch.ones(1, 3, 1, 4), 0)
    cache.update(torch.full((1, 3, 1, 4), 5.0), torch.full((1, 3, 1, 4), 6.0), 0)
    assert (cache.keys[0][3] == 5.0).all()
    assert (cache.values[0][3] == 6.0).all()


def test_update_casts_to_pool_dtype():
    """Inputs in another dtype are cast to the pool's dtype."""
    cache = _cache(num_layers=1, dtype=torch.float16)
    cache.step = _step([0, 1])
    k = torch.randn(1, 3, 2, 4, dtype=torch.float32)
    v = torch.randn(1, 3, 2, 4, dtype=torch.float32)
    k_pool, v_pool = map(PagedKVCache.pool_of, cache.update(k, v, 0))
    assert k_pool.dtype == v_pool.dtype == torch.float16
    torch.testing.assert_close(k_pool[:2], k[0].transpose(0, 1).half(), rtol=0, atol=0)
    torch.testing.assert_close(v_pool[:2], v[0].transpose(0, 1).half(), rtol=0, atol=0)
    assert (k_pool[2:] == SENTINEL).all()


def test_layers_of_different_shapes_get_their_own_pools():
    """A measured layout with per-layer shapes (MLA: keys wider than values; Gemma 4: per-layer
    head_dim) gives each layer pools of its own shape, and the pool bytes add up."""
    from hf_async_cb.model.kv_layout import LayerKV

    layout = KVLayout((LayerKV(1, 48, 1, 16), LayerKV(4, 8, 4, 8)))
    cache = PagedKVCache(layout, num_pages=3, page_size=4, dtype=torch.float32, device=torch.device("cpu"))
    assert [k.shape for k in cache.keys] == [(12, 1, 48), (12, 4, 8)]
    assert [v.shape for v in cache.values] == [(12, 1, 16), (12, 4, 8)]
    assert cache.bytes == 12 * layout.bytes_per_token(torch.float32) == 12 * 4 * (48 + 16 + 32 + 32)
    cache.step = _step([5, 6])
    k, v = torch.randn(1, 1, 2, 48), torch.randn(1, 1, 2, 16)
    k_pool, v_pool = map(PagedKVCache.pool_of, cache.update(k, v, 0))
    assert torch.equal(k_pool[5:7], k[0].transpose(0, 1)) and torch.equal(v_pool[5:7], v[0].transpose(0, 1))
