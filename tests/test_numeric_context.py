"""What a call computes in (model/numeric_context.py: autocast, matmul precisions) keys what the engine
keeps across calls: prefix-cache pages and tower outputs (through the K/V fingerprint) and CUDA graphs.
Against stock generate, which computes each call in its own context."""

from __future__ import annotations

import copy

import pytest
import torch
from models import left_pad, random_prompts, tiny_model

from hf_async_cb import BatchingConfig, Engine, SamplingParams
from hf_async_cb.model.kv_fingerprint import WeightVersions, kv_fingerprint
from hf_async_cb.model.numeric_context import numeric_context

PROMPTS = random_prompts(4, 64, 64, seed=1)  # whole pages, every one of them cached
NEW = 32


def _bf16():
    return torch.autocast("cpu", dtype=torch.bfloat16)


def _generate(model, **kwargs) -> torch.Tensor:
    ids, mask = left_pad(PROMPTS)
    return model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=None, **kwargs)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_pages_cached_under_autocast_are_not_served_to_an_fp32_call(mode):
    model = tiny_model("llama")
    expected = _generate(model)
    with _bf16():
        assert not torch.equal(_generate(model), expected)  # (else this test could not tell the caches apart)
        _generate(model, batching=mode)  # the prompts' pages cached, computed in bf16
    assert torch.equal(_generate(model, batching=mode), expected)


def test_pages_cached_in_fp32_are_not_served_to_an_autocast_call():
    model = copy.deepcopy(tiny_model("llama"))
    with _bf16():
        fresh = _generate(copy.deepcopy(model), batching="sync")
    _generate(model, batching="sync")
    with _bf16():
        assert torch.equal(_generate(model, batching="sync"), fresh)


def test_each_setting_is_part_of_the_context_and_of_the_fingerprints():
    model = tiny_model("llama")
    versions = WeightVersions(model)
    base, fingerprint, read = numeric_context("cpu"), kv_fingerprint(model), versions.read()
    saved = (torch.get_float32_matmul_precision(), torch.are_deterministic_algorithms_enabled())
    changes = [_bf16, lambda: _setting(torch.set_float32_matmul_precision, "medium", saved[0]),
               lambda: _setting(torch.use_deterministic_algorithms, not saved[1], saved[1])]
    for change in changes:
        with change():
            assert numeric_context("cpu") != base
            assert kv_fingerprint(model) != fingerprint and versions.read() != read
    assert (numeric_context("cpu"), kv_fingerprint(model), versions.read()) == (base, fingerprint, read)


class _setting:
    def __init__(self, setter, value, back):
        self.setter, self.value, self.back = setter, value, back

    def __enter__(self):
        self.setter(self.value)

    def __exit__(self, *exc):
        self.setter(self.back)


def test_graphs_captured_in_one_context_are_not_replayed_in_another():
    """On the CPU a graph's stand-in runs eagerly, so the tokens cannot tell: the captures are counted."""
    model = tiny_model("llama")
    params = SamplingParams(max_new_tokens=8, eos_token_ids=())
    with Engine(model, BatchingConfig(cuda_graphs=True, prefix_caching=False, page_size=4)) as engine:
        engine.generate(PROMPTS, params)
        first = dict(engine.graphs._graphs)
        assert first
        engine.generate(PROMPTS, params)
        assert all(engine.graphs._graphs[k] is g for k, g in first.items())  # the same context: replayed
        with _bf16():
            engine.generate(PROMPTS, params)
        assert engine.graphs._graphs and not any(engine.graphs._graphs.get(k) is g for k, g in first.items())
        again = dict(engine.graphs._graphs)
        engine.generate(PROMPTS, params)
        assert not any(engine.graphs._graphs.get(k) is g for k, g in again.items())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs are captured on CUDA alone")
def test_cuda_graphs_follow_each_calls_arithmetic():
    """An fp32 model: a call in fp32 captures its graphs, then a call under bf16 autocast must not
    replay them (its tokens are those of a fresh engine's autocast call), nor the fp32 call after
    replay the autocast ones. Unscaled random weights: near-ties, so bf16 rounding flips tokens."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)
    model = transformers.LlamaForCausalLM(config).eval().cuda()
    fresh = copy.deepcopy(model)
    ids, mask = (t.cuda() for t in left_pad(PROMPTS))
    kwargs = dict(attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=None, batching="async",
                  batching_config={"prefix_caching": False})
    with torch.autocast("cuda", dtype=torch.bfloat16):
        in_bf16 = fresh.generate(ids, **kwargs)
    in_fp32 = model.generate(ids, **kwargs)
    assert not torch.equal(in_bf16, in_fp32)  # (else the test could not tell the graphs apart)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        assert torch.equal(model.generate(ids, **kwargs), in_bf16)
    assert torch.equal(model.generate(ids, **kwargs), in_fp32)
