"""Greedy output of the engine == stock generate, token for token (fp32, CPU).

Swept over model families, both modes, batch sizes, prompt lengths, page sizes, token budgets
(small budgets force chunked prefill) and pool sizes (small pools force preemption).
"""

import pytest
import torch
from models import FAMILIES, generated_rows, left_pad, random_prompts, stock_generate, tiny_model

import hf_async_cb
from hf_async_cb import BatchingConfig, Engine

MODES = ("sync", "async")


def engine_generate(model, prompts, mode, config=None, **kwargs):
    ids, mask = left_pad(prompts)
    return model.generate(ids, attention_mask=mask, batching=mode, batching_config=config, **kwargs)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", FAMILIES)
def test_families_match_stock(family, mode):
    model = tiny_model(family)
    prompts = random_prompts(10, 1, 110, seed=hash(family) % 1000)
    expected = stock_generate(model, prompts, max_new_tokens=20)
    config = BatchingConfig(page_size=16, max_batch_tokens=48)  # prompts > 48 tokens are chunked
    got = engine_generate(model, prompts, mode, config, max_new_tokens=20)
    assert got.shape == expected.shape
    assert torch.equal(got, expected)


SWEEP = {
    # name: (batch, prompt lengths, page_size, max_batch_tokens, num_pages, max_new_tokens)
    "one-token-prompt": (1, (1, 1), 4, 512, None, 12),
    "batch32-chunked": (32, (1, 120), 16, 64, None, 16),
    "tiny-budget": (12, (1, 40), 4, 5, None, 10),
    "page64": (9, (30, 100), 64, 512, None, 20),
    "page-boundaries": (6, (15, 17), 16, 16, None, 18),
    "new-tokens-1": (7, (1, 30), 16, 512, None, 1),
    "new-tokens-2": (7, (1, 30), 16, 512, None, 2),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", list(SWEEP))
@pytest.mark.parametrize("family", ["llama", "qwen3", "gpt2"])
def test_sweep_matches_stock(family, case, mode):
    batch, (lo, hi), page_size, budget, num_pages, new = SWEEP[case]
    model = tiny_model(family)
    prompts = random_prompts(batch, lo, hi, seed=len(case))
    expected = stock_generate(model, prompts, max_new_tokens=new)
    config = BatchingConfig(page_size=page_size, max_batch_tokens=budget, num_pages=num_pages)
    assert torch.equal(engine_generate(model, prompts, mode, config, max_new_tokens=new), expected)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", ["llama", "mistral", "phi3", "gpt2"])
def test_preemption_keeps_stock_output(family, mode):
    """A pool that holds ~3 requests at full length forces preemption and recomputation."""
    model = tiny_model(family)
    prompts = random_prompts(16, 10, 50, seed=7)
    new = 24
    expected = generated_rows(stock_generate(model, prompts, max_new_tokens=new),
                              max(map(len, prompts)), pad=0, eos=(2,))
    engine = Engine(model, BatchingConfig(mode=mode, page_size=4, num_pages=60, max_batch_tokens=64))
    outputs = engine.generate(prompts, max_new_tokens=new, eos_token_ids=(2,))
    assert [o.output_token_ids for o in outputs] == expected
    assert sum(o.num_preemptions for o in outputs) > 0, "the pool was meant to force preemption"
    assert engine.allocator.num_free == engine.allocator.num_pages


def _eos_candidates(model, prompts, new):
    """Tokens stock generates at varied positions, to use as EOS ids."""
    width = max(map(len, prompts))
    rows = stock_generate(model, prompts, max_new_tokens=new, eos_token_id=None)[:, width:].tolist()
    return rows[0][3], rows[1][0], rows[-1][new // 2]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2"])
def test_eos_stops_exactly_where_stock_does(family, mode):
    model = tiny_model(family)
    prompts = random_prompts(8, 1, 40, seed=11)
    new = 16
    first, second, third = _eos_candidates(model, prompts, new)
    for eos in (first, [second, third]):
        kwargs = dict(max_new_tokens=new, eos_token_id=eos, pad_token_id=0)
        expected = stock_generate(model, prompts, **kwargs)
        got = engine_generate(model, prompts, mode, BatchingConfig(page_size=8, max_batch_tokens=32), **kwargs)
        assert torch.equal(got, expected)
    assert (expected == 0).any(), "some rows should have finished early and been padded"


@pytest.mark.parametrize("mode", MODES)
def test_max_length_instead_of_max_new_tokens(mode):
    model = tiny_model("llama")
    prompts = random_prompts(5, 3, 20, seed=3)
    expected = stock_generate(model, prompts, max_length=30)
    assert torch.equal(engine_generate(model, prompts, mode, max_length=30), expected)


def test_same_output_for_every_page_size_and_budget():
    """The tokens depend on nothing but the model and the prompts."""
    model = tiny_model("qwen2")
    prompts = random_prompts(6, 1, 70, seed=5)
    results = []
    for page_size, budget in [(1, 7), (4, 13), (16, 512), (64, 1)]:
        config = BatchingConfig(page_size=page_size, max_batch_tokens=budget)
        results.append(engine_generate(model, prompts, "sync", config, max_new_tokens=8))
    for r in results[1:]:
        assert torch.equal(r, results[0])


def test_engine_api_matches_stock_and_keeps_order():
    model = tiny_model("llama")
    prompts = random_prompts(20, 1, 64, seed=9)
    expected = generated_rows(stock_generate(model, prompts, max_new_tokens=12), max(map(len, prompts)),
                              pad=0, eos=(2,))
    engine = Engine(model, BatchingConfig(mode="sync", max_running_requests=4, max_batch_tokens=40))
    outputs = engine.generate(prompts, max_new_tokens=12, eos_token_ids=(2,))
    assert [o.prompt_token_ids for o in outputs] == prompts
    assert [o.output_token_ids for o in outputs] == expected
    assert all(o.finished for o in outputs)
    # The engine is reusable and its pool is whole again.
    assert engine.allocator.num_free == engine.allocator.num_pages
    again = engine.generate(prompts[:3], max_new_tokens=12, eos_token_ids=(2,))
    assert [o.output_token_ids for o in again] == expected[:3]
    assert hf_async_cb.is_installed()
