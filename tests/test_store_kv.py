"""The K/V store kernel writes exactly what index_copy_ writes (Triton's interpreter on the CPU)."""

import pytest
import torch

from hf_async_cb.kernels.store_kv import store_kv

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("heads,head_dim,dtype", [(8, 64, torch.bfloat16), (2, 128, torch.float32), (3, 80, torch.float16)])
def test_store_kv_matches_index_copy(heads, head_dim, dtype):
    g = torch.Generator().manual_seed(heads)
    slots_total, tokens = 96, 11
    pools = [torch.zeros(slots_total, heads, head_dim, dtype=dtype, device=DEVICE) for _ in range(4)]
    # The model's layout: [1, T, heads, D] transposed to [1, heads, T, D] (not contiguous).
    k = torch.randn(1, tokens, heads, head_dim, generator=g).to(dtype).to(DEVICE).transpose(1, 2)
    v = torch.randn(1, tokens, heads, head_dim, generator=g).to(dtype).to(DEVICE).transpose(1, 2)
    slots = torch.randperm(slots_total, generator=g)[:tokens].to(DEVICE)
    store_kv(pools[0], pools[1], k, v, slots)
    pools[2].index_copy_(0, slots, k[0].transpose(0, 1))
    pools[3].index_copy_(0, slots, v[0].transpose(0, 1))
    assert torch.equal(pools[0], pools[2]) and torch.equal(pools[1], pools[3])
    assert pools[0].abs().sum() > 0


@pytest.mark.parametrize("k_heads,k_dim,v_heads,v_dim", [(4, 24, 4, 16), (1, 32, 1, 16), (1, 48, 4, 8)])
def test_store_kv_with_keys_and_values_of_different_shapes(k_heads, k_dim, v_heads, v_dim):
    """MLA (keys wider than values) and latent caches: each pool is written with its own shape."""
    g = torch.Generator().manual_seed(k_dim)
    slots_total, tokens = 40, 7
    k = torch.randn(1, tokens, k_heads, k_dim, generator=g).to(DEVICE).transpose(1, 2)
    v = torch.randn(1, v_heads, tokens, v_dim, generator=g).to(DEVICE)
    slots = torch.randperm(slots_total, generator=g)[:tokens].to(DEVICE)
    k_pool = torch.zeros(slots_total, k_heads, k_dim, device=DEVICE)
    v_pool = torch.zeros(slots_total, v_heads, v_dim, device=DEVICE)
    store_kv(k_pool, v_pool, k, v, slots)
    expected_k = torch.zeros_like(k_pool).index_copy_(0, slots, k[0].transpose(0, 1))
    expected_v = torch.zeros_like(v_pool).index_copy_(0, slots, v[0].transpose(0, 1))
    assert torch.equal(k_pool, expected_k) and torch.equal(v_pool, expected_v)
