"""PEFT prefix tuning (and cartridges, served alike) on the engine: per-layer keys and values for
the virtual tokens, given instead of computed (model/prefix_kv.py, generate/prompt_learning.py).

The oracle is stock PEFT generate. PEFT 0.21 on transformers 5.24 hands its prefix to the model as
`past_key_values`, which 5.24's models drop for the `cache` keyword that generate passes (stock then
generates without the prefix), and looks for the cache under its old name at every step;
`stock_peft_generate` gives PEFT each keyword where it looks (the cache as `past_key_values` to
PEFT's step preparation, the injected prefix as `cache` to the model), as older transformers did.
That oracle is checked against PEFT's own forward (no generate, no cache), greedy step by step.
"""

from __future__ import annotations

import inspect

import pytest
import torch
import transformers
from models import COMMON, left_pad, random_prompts, scaled

import hf_async_cb
from hf_async_cb import BatchingConfig
from hf_async_cb.model.kv_layout import KVLayout
from hf_async_cb.model.prefix_kv import PrefixKV

peft = pytest.importorskip("peft", reason="peft is not installed")

MODES = ("sync", "async")
FAMILIES = {
    "llama": lambda: transformers.LlamaConfig(**COMMON),  # GQA: 4 heads, 2 KV heads
    "qwen2": lambda: transformers.Qwen2Config(**COMMON),
    "mistral": lambda: transformers.MistralConfig(**COMMON, sliding_window=24),
}
NEW = 8


def _model(family: str = "llama", seed: int = 0, method: str = "prefix", **config):
    """A tiny base model and its PEFT model, the adapter's parameters far from their start."""
    torch.manual_seed(seed)
    base = scaled(transformers.AutoModelForCausalLM.from_config(FAMILIES[family](), dtype=torch.float32).eval())
    make = {"prefix": peft.PrefixTuningConfig, "cartridge": peft.CartridgeConfig,
            "prompt": peft.PromptTuningConfig}[method]
    model = peft.get_peft_model(base, make(task_type="CAUSAL_LM", **{"num_virtual_tokens": 5, **config})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "prompt_encoder" in name:
                p.normal_(0, 2)
    return base, model


def stock_peft_generate(model, *args, **kwargs):
    """Stock PEFT generate, each keyword where PEFT looks for it (see the module docstring): as it is
    where the models still take `past_key_values` (before 5.24)."""
    if "cache" not in inspect.signature(type(model.get_base_model()).forward).parameters:
        return model.generate(*args, batching="off", **kwargs)
    own, own_base = model.prepare_inputs_for_generation, model.base_model_prepare_inputs_for_generation

    def base_prepare(*args, **kwargs):
        out = own_base(*args, **kwargs)
        cache = out.get("cache")
        if cache is not None and cache.get_seq_length():
            out["past_key_values"] = cache  # where PEFT looks for the cache
        return out

    def prepare(*args, **kwargs):
        out = own(*args, **kwargs)
        given = out.pop("past_key_values", None)
        if given is not None and given is not out.get("cache"):
            out["cache"] = given  # the prefix PEFT injected, where the model reads it
        return out

    model.prepare_inputs_for_generation = prepare
    model.base_model_prepare_inputs_for_generation = base_prepare
    try:
        return model.generate(*args, batching="off", **kwargs)
    finally:
        del model.prepare_inputs_for_generation
        model.base_model_prepare_inputs_for_generation = own_base


@torch.no_grad()
def _peft_forward_greedy(model, ids, mask, new):
    """Greedy tokens from PEFT's forward over the whole sequence at each step, with generate's
    position ids (PEFT adds the virtual tokens to them)."""
    for _ in range(new):
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        token = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, -1].argmax(-1)
        ids, mask = torch.cat([ids, token[:, None]], 1), torch.cat([mask, torch.ones_like(token)[:, None]], 1)
    return ids


def _call(prompts=None, seed=7, **kwargs):
    ids, mask = left_pad(prompts if prompts is not None else random_prompts(4, 5, 20, seed=seed))
    return ids, dict(attention_mask=mask, do_sample=False, max_new_tokens=NEW, eos_token_id=None, pad_token_id=0,
                     **kwargs)


def assert_exact(base, model, ids, configs=(None,), **kwargs):
    """Stock PEFT's tokens differ from the base model's (the adapter matters, so the check can fail),
    and every loop and config of the engine gives them."""
    expected = stock_peft_generate(model, ids, **kwargs)
    assert not torch.equal(expected, base.generate(ids, batching="off", **kwargs))
    for mode in MODES:
        for config in configs:
            got = model.generate(input_ids=ids, batching=mode, batching_config=config, **kwargs)
            assert torch.equal(got, expected), (mode, config)


def test_the_oracle_is_peft_forward():
    _, model = _model()
    ids, kwargs = _call()
    assert torch.equal(stock_peft_generate(model, ids, **kwargs),
                       _peft_forward_greedy(model, ids, kwargs["attention_mask"], NEW))


@pytest.mark.parametrize("family,config", [
    ("llama", {}),
    ("llama", {"prefix_projection": True, "encoder_hidden_size": 32, "num_virtual_tokens": 6}),
    ("qwen2", {"num_virtual_tokens": 20}),  # more virtual tokens than a page
])
def test_prefix_tuning_matches_stock_peft(family, config):
    """Left-padded rows (PEFT's positions skip the padding), both loops, the prefix cache on and
    off, projections fused and not, chunks that end inside the virtual tokens."""
    base, model = _model(family, **config)
    ids, kwargs = _call()
    assert_exact(base, model, ids, (None, BatchingConfig(prefix_caching=False),
                                    BatchingConfig(fuse_projections=True, page_size=4, max_batch_tokens=6)), **kwargs)
    hf_async_cb.release(base)


def test_a_cartridge_matches_stock_peft():
    base, model = _model(method="cartridge", num_virtual_tokens=6)
    ids, kwargs = _call()
    assert_exact(base, model, ids, **kwargs)
    hf_async_cb.release(base)


def test_prefix_pages_are_shared_by_rows_and_calls_and_by_nothing_else():
    """16 virtual tokens on pages of 8: two pages hold only the prefix. The rows of a call share
    them, a later call takes them, another adapter's rows and a plain prompt that starts with the
    placeholder ids never do; the base model after the adapter is disabled gives its own tokens."""
    base, model = _model(num_virtual_tokens=16)
    config = BatchingConfig(page_size=8)
    prompts = random_prompts(4, 5, 7, seed=3)  # no page of their own is full: only prefix pages are cached
    ids, kwargs = _call(prompts, batching_config=config)
    expected = stock_peft_generate(model, ids, **{k: v for k, v in kwargs.items() if k != "batching_config"})
    hits = []
    for mode in ("sync", "async"):
        assert torch.equal(model.generate(input_ids=ids, batching=mode, **kwargs), expected), mode
        hits.append(hf_async_cb.prefix_cache_stats(base)["hit_tokens"])
    assert hits == [3 * 16, 3 * 16 + 4 * 16]  # the later rows of the call, then every row of the next call

    model.add_adapter("other", peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=16))
    model.set_adapter("other")  # another adapter on the same base model
    with torch.no_grad():
        for p in model.prompt_encoder["other"].parameters():
            p.normal_(0, 2)
    model.eval()
    want = stock_peft_generate(model, ids, **{k: v for k, v in kwargs.items() if k != "batching_config"})
    assert not torch.equal(want, expected)
    assert torch.equal(model.generate(input_ids=ids, batching="sync", **kwargs), want)
    assert hf_async_cb.prefix_cache_stats(base)["hit_tokens"] == hits[-1] + 3 * 16  # its own pages only
    model.set_adapter("default")

    plain = [[0] * 16 + p for p in prompts]  # the placeholders' ids, without the adapter
    plain_ids, plain_kwargs = _call(plain, batching_config=config)
    before = hf_async_cb.prefix_cache_stats(base)["hit_tokens"]
    stock = base.generate(plain_ids, **{k: v for k, v in plain_kwargs.items() if k != "batching_config"},
                          batching="off")
    assert torch.equal(base.generate(plain_ids, batching="sync", **plain_kwargs), stock)
    assert hf_async_cb.prefix_cache_stats(base)["hit_tokens"] - before == 3 * 16  # each other, not the adapter's

    stock_base = base.generate(ids, batching="off", **{k: v for k, v in kwargs.items() if k != "batching_config"})
    for mode in MODES:
        with model.disable_adapter():
            assert torch.equal(model.generate(input_ids=ids, batching=mode, **kwargs), stock_base), mode
    hf_async_cb.release(base)


def test_seeded_sampled_copies_run():
    base, model = _model()
    ids, kwargs = _call()
    kwargs.update(do_sample=True, num_return_sequences=2, top_k=0)
    outs = []
    for mode in MODES:
        out = model.generate(input_ids=ids, batching=mode, batching_config=BatchingConfig(seed=5), **kwargs)
        assert out.shape == (2 * ids.shape[0], ids.shape[1] + NEW)
        assert torch.equal(out[::2, :ids.shape[1]], ids) and torch.equal(out[1::2, :ids.shape[1]], ids)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])  # seeded: the same draws in both loops
    hf_async_cb.release(base)


@pytest.mark.parametrize("method", ["prefix", "prompt"])
def test_a_sliding_window_with_padded_rows_is_refused_and_unpadded_rows_run(method):
    """Stock's cache holds the padding between the virtual tokens and a left-padded row, and its
    window counts it: past the window, such rows would see the virtual tokens leave at other steps."""
    base, model = _model("mistral", method=method)
    ids, kwargs = _call()
    for mode in MODES:
        with pytest.raises(ValueError, match=rf"PEFT {method.upper()}_TUNING on a model with a sliding window of 24"):
            model.generate(input_ids=ids, batching=mode, **kwargs)
    ids, kwargs = _call(random_prompts(1, 20, 20, seed=9) * 3)  # 5 + 20 + 8 tokens: past the window
    assert_exact(base, model, ids, **kwargs)
    hf_async_cb.release(base)


def test_history_options_are_refused_by_name():
    base, model = _model()
    ids, kwargs = _call(repetition_penalty=1.2)
    with pytest.raises(ValueError, match=r"PEFT PREFIX_TUNING: stock generate's logits processors"):
        model.generate(input_ids=ids, batching="sync", **kwargs)
    assert hf_async_cb.runtime_info(base) is None  # refused before any engine was built
    hf_async_cb.release(base)


def test_given_kv_must_fit_the_cache_layout():
    keys = [torch.zeros(2, 3, 16) for _ in range(2)]
    prefix = PrefixKV(keys, [k.clone() for k in keys], b"k", name="this prefix")
    assert prefix.checked(KVLayout.uniform(2, 2, 16), torch.float32, torch.device("cpu")) is prefix
    assert prefix.checked(KVLayout.uniform(2, 2, 16), torch.float16, torch.device("cpu")).keys[0].dtype == torch.float16
    with pytest.raises(ValueError, match=r"this prefix gives keys and values for 2 layers; the model caches 3"):
        prefix.checked(KVLayout.uniform(3, 2, 16), torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"this prefix: layer 0 gets keys \(2, 3, 16\)"):
        prefix.checked(KVLayout.uniform(2, 4, 16), torch.float32, torch.device("cpu"))
