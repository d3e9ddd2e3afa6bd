"""The K/V layout is measured from the model's own cache writes, not read from its config.

The oracle is stock transformers: a DynamicCache filled by the model's forward holds, per layer,
exactly the shapes the paged cache must store; and families whose shapes the config does not
tell (multi-query Falcon, DeepSeek's MLA, Gemma 4's per-layer head sizes) run token-exact.
"""

import pytest
import torch
from family_sweep import run_family
from model_configs import tiny_model
from transformers import DynamicCache

from hf_async_cb.model.kv_cache import cache_keyword
from hf_async_cb.model.kv_layout import KVLayout, LayerKV, measured_layout


def _stock_cache_shapes(model) -> list[tuple[int, int, int, int]]:
    cache = DynamicCache(config=model.config.get_text_config(decoder=True))
    ids = torch.tensor([[3, 4, 5]])
    with torch.no_grad():
        model(input_ids=ids, use_cache=True, **{cache_keyword(model): cache})
    return [(layer.keys.shape[1], layer.keys.shape[-1], layer.values.shape[1], layer.values.shape[-1])
            for layer in cache.layers]


@pytest.mark.parametrize("model_type", ["llama", "falcon", "gpt_bigcode", "deepseek_v3", "gemma4_text", "gemma3_text"])
def test_measured_layout_is_what_a_stock_cache_holds(model_type):
    model, _ = tiny_model(model_type)
    layout = measured_layout(model, torch.float32, torch.device("cpu"))
    got = [(kv.key_heads, kv.key_dim, kv.value_heads, kv.value_dim) for kv in layout.layers]
    assert got == _stock_cache_shapes(model)


def test_layouts_the_config_does_not_tell():
    falcon, _ = tiny_model("falcon")  # multi-query: one K/V head for every query head
    assert {kv.key_heads for kv in measured_layout(falcon, torch.float32, torch.device("cpu")).layers} == {1}
    assert falcon.config.num_attention_heads > 1
    gemma4, _ = tiny_model("gemma4_text")
    dims = {kv.key_dim for kv in measured_layout(gemma4, torch.float32, torch.device("cpu")).layers}
    assert len(dims) > 1, "Gemma 4's global layers have their own head size"


def test_llama_layout_equals_the_uniform_one():
    model, _ = tiny_model("llama")
    c = model.config
    expected = KVLayout.uniform(c.num_hidden_layers, c.num_key_value_heads, c.head_dim)
    assert measured_layout(model, torch.float32, torch.device("cpu")) == expected
    assert expected.bytes_per_token(torch.bfloat16) == 2 * 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim
    assert LayerKV(1, 48, 1, 16).elements_per_token == 64


def test_a_forward_that_fails_is_a_refusal_with_the_reason(monkeypatch):
    model, _ = tiny_model("qwen2")
    broken = type(model)

    def forward(self, *args, **kwargs):
        raise RuntimeError("no forward today")

    class Broken(broken):
        pass

    Broken.forward = forward
    model.__class__ = Broken
    try:
        with pytest.raises(ValueError, match="measuring its K/V layout.*no forward today"):
            measured_layout(model, torch.float32, torch.device("cpu"))
    finally:
        model.__class__ = broken


@pytest.mark.parametrize("model_type", ["falcon", "gpt_bigcode", "deepseek_v2", "minicpm3", "gemma4_text", "nemotron"])
def test_families_that_needed_the_measured_layout_are_exact(model_type):
    verdict, per_mode = run_family(model_type)
    assert verdict.kind == "exact", (verdict, per_mode)


@pytest.mark.parametrize("attention", ["reference", "triton"])
def test_layers_that_transform_their_cache_get_the_step_contexts_not_the_pool(attention, monkeypatch):
    """DeepSeek's MLA expands its cached latents before attending: the cache hands it each
    request's context gathered (a few rows), never the whole pool, and the tokens stay stock's
    with either attention kernel (Triton runs interpreted on the CPU)."""
    from models import random_prompts, stock_generate

    from hf_async_cb import BatchingConfig, Engine
    from hf_async_cb.model.kv_cache import PagedKVCache

    model, _ = tiny_model("deepseek_v3")
    layout = measured_layout(model, torch.float32, torch.device("cpu"))
    assert all(kv.gathered for kv in layout.layers)
    seen = []
    original = PagedKVCache.update

    def update(self, *args, **kwargs):
        k, v = original(self, *args, **kwargs)
        seen.append((k.shape[2], self.keys[0].shape[0]))
        return k, v

    monkeypatch.setattr(PagedKVCache, "update", update)
    prompts = random_prompts(3, 5, 20, seed=3, vocab=256)
    engine = Engine(model, BatchingConfig(mode="sync", attention=attention, num_pages=512, trust_untested_model=True))
    outputs = engine.generate(prompts, max_new_tokens=6)
    expected = stock_generate(model, prompts, max_new_tokens=6)
    for prompt, out, row in zip(prompts, outputs, expected):
        assert out.output_token_ids == row[-6:].tolist()
    assert seen and all(rows < slots // 8 for rows, slots in seen)
