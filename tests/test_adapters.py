"""Families whose attention bypasses transformers' attention interface (Falcon) or drops the
forward kwargs on the way to it (StableLM): exact against stock, and stock between calls."""

import pytest
import torch
import transformers
from models import left_pad, random_prompts, scaled

import hf_async_cb


def _falcon(**overrides):
    config = transformers.FalconConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                       bos_token_id=1, eos_token_id=2, pad_token_id=0, **overrides)
    torch.manual_seed(0)
    return scaled(transformers.FalconForCausalLM(config).eval())


def _greedy(model, batching):
    ids, mask = left_pad(random_prompts(3, 5, 20, seed=7, vocab=256))
    return model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=8, eos_token_id=None,
                          pad_token_id=0, batching=batching)


@pytest.mark.parametrize("overrides", [
    dict(multi_query=True),  # Falcon-7B: one K/V head
    dict(new_decoder_architecture=True, num_kv_heads=2),  # Falcon-40B/180B: grouped K/V heads
    dict(multi_query=False, parallel_attn=False, bias=True),
], ids=["multi-query", "grouped", "sequential-with-bias"])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_falcon_is_exact_and_stock_between_calls(overrides, mode):
    model = _falcon(**overrides)
    expected = _greedy(model, "off")
    assert torch.equal(_greedy(model, mode), expected)
    attention = [m for m in model.modules() if type(m).__name__ == "FalconAttention"]
    assert attention and all("forward" not in vars(m) for m in attention)
    assert torch.equal(_greedy(model, "off"), expected)
    hf_async_cb.release(model)


def test_falcon_with_alibi_is_refused():
    model = _falcon(alibi=True)
    with pytest.raises(ValueError, match="ALiBi"):
        _greedy(model, "sync")


def test_grouped_falcon_caches_one_head_per_kv_group():
    """Stock Falcon-40B broadcasts its grouped K/V to every query head before caching; the adapted
    module caches one per KV head (a sixteenth of the memory for 128 heads on 8), same tokens."""
    from hf_async_cb.model.kv_layout import measured_layout

    model = _falcon(new_decoder_architecture=True, num_kv_heads=2)
    layout = measured_layout(model, torch.float32, torch.device("cpu"))
    assert {(kv.key_heads, kv.value_heads) for kv in layout.layers} == {(2, 2)}
    assert model.config.num_attention_heads == 4


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_bloom_alibi_is_exact_and_stock_between_calls(mode):
    """Bloom's ALiBi runs as per-head slopes in the paged attention (its dense bias tensor is never
    needed), token-exact against stock; its attention modules are stock again after the call."""
    config = transformers.BloomConfig(vocab_size=256, hidden_size=64, n_layer=2, n_head=4, bos_token_id=1,
                                      eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    model = scaled(transformers.BloomForCausalLM(config).eval())
    expected = _greedy(model, "off")
    assert torch.equal(_greedy(model, mode), expected)
    attention = [m for m in model.modules() if type(m).__name__ == "BloomAttention"]
    assert attention and all(not {"forward", "hf_async_cb_alibi_slopes"} & set(vars(m)) for m in attention)
    hf_async_cb.release(model)


def test_bloom_slopes_are_the_models_own():
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    from hf_async_cb.model.adapters import _bloom_slopes

    for heads in (4, 6, 32):
        slopes = _bloom_slopes(None, heads, torch.device("cpu"))
        bias = build_alibi_tensor(torch.ones(1, 5), heads, torch.float32).view(heads, 5)
        torch.testing.assert_close(bias, slopes[:, None] * torch.arange(5.0))
