"""The engine's own checks and refusals, as a user meets them: bad input refused before anything is
built or grown for it; a check's forward that fails refuses the model (never a check skipped, which
ran a model without its sliding window); a model sharing the checked model's config object is told
so, never given the check's stand-in attention; the checks' own work not counted as the user's."""

from __future__ import annotations

import pytest
import torch
import transformers
from models import left_pad, random_prompts, scaled
from transformers.generation.streamers import BaseStreamer

import hf_async_cb

COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _llama(config=None) -> torch.nn.Module:
    torch.manual_seed(0)
    return scaled(transformers.LlamaForCausalLM(config or transformers.LlamaConfig(**COMMON)).eval())


def test_bad_input_is_refused_before_the_runtime_changes():
    model = _llama()
    ids, mask = left_pad(random_prompts(4, 20, 40, seed=3))
    model.generate(ids, attention_mask=mask, max_new_tokens=4, batching="sync")
    before = hf_async_cb.runtime_info(model), hf_async_cb.prefix_cache_stats(model)["cached_pages"]
    with pytest.raises(ValueError, match="longer than the model's maximum of 512"):
        model.generate(torch.randint(3, 256, (1, 600)), max_new_tokens=4, batching="sync")
    padded = ids.clone()
    padded[1, 0] = 999  # in the padding: stock embeds it, and fails
    assert mask[1, 0] == 0
    with pytest.raises(ValueError, match="outside the vocabulary .* padding included: \\[999\\]"):
        model.generate(padded, attention_mask=mask, max_new_tokens=4, batching="sync")
    assert (hf_async_cb.runtime_info(model), hf_async_cb.prefix_cache_stats(model)["cached_pages"]) == before


def test_a_first_forward_that_fails_refuses_the_model_and_the_next_call_runs(monkeypatch):
    """PhiMoE's attention passes no window keyword while its mask slides: only the masks' check sets
    its window. A failure of that check's forward once ran the model without it, silently."""
    torch.manual_seed(0)
    config = transformers.PhimoeConfig(**{**COMMON, "num_local_experts": 4, "sliding_window": 48})
    model = scaled(transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval())
    ids = torch.randint(3, 256, (2, 100), generator=torch.Generator().manual_seed(0))
    expected = model.generate(ids, max_new_tokens=10, do_sample=False)
    forward, calls = type(model).forward, []

    def flaky(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("transient")
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(type(model), "forward", flaky)
    with pytest.raises(ValueError, match="reading its attention masks .* failed \\(RuntimeError: transient\\)"):
        model.generate(ids, max_new_tokens=10, do_sample=False, batching="sync")
    assert torch.equal(model.generate(ids, max_new_tokens=10, do_sample=False, batching="sync"), expected)


def test_a_model_sharing_the_config_object_is_told_so_during_the_checks():
    """A policy and a reference model built on one config object: the engine switches that config's
    attention for its checks and calls; the other model's attention then raises, saying why."""
    first = _llama()
    second = _llama(first.config)
    ids = torch.randint(3, 256, (1, 8))
    ran = []

    def run_the_other(module, args, output):  # another model run meanwhile (another thread, in practice)
        if not ran:
            ran.append(1)
            second(ids)

    first.model.layers[0].register_forward_hook(run_the_other)
    with pytest.raises(RuntimeError, match="another model ran while hf_async_cb .* give each model its own config"):
        first.generate(ids, max_new_tokens=2, batching="sync")


def test_the_checks_own_tokens_are_not_counted_as_the_users():
    model = _llama()
    ids = torch.randint(3, 256, (1, 20))
    model.generate(ids, max_new_tokens=2, batching="sync")
    stats = hf_async_cb.prefix_cache_stats(model)
    assert stats["prefilled_tokens"] == 20 and stats["cached_pages"] == 1 and stats["clears"] == 0


def test_a_streamer_that_raises_is_named_in_the_error():
    class Failing(BaseStreamer):
        def __init__(self):
            self.calls = 0

        def put(self, value):
            self.calls += 1
            if self.calls == 3:
                raise ValueError("put failed")

        def end(self):
            pass

    model = _llama()
    with pytest.raises(ValueError, match="put failed") as raised:
        model.generate(torch.randint(3, 256, (2, 8)), max_new_tokens=6, streamer=Failing(), batching="sync")
    assert any("the streamer's put()" in note for note in raised.value.__notes__)


def test_a_row_larger_than_the_memory_budget_is_refused_without_a_rebuild():
    model = _llama()
    config = {"cpu_kv_cache_bytes": 2**20}  # the pool's memory budget: 128 pages of 16 tokens
    ids = torch.randint(3, 256, (4, 20))
    model.generate(ids, max_new_tokens=4, batching="sync", batching_config=config)
    model.generate(ids, max_new_tokens=520, batching="sync", batching_config=config)  # 136 pages asked: the budget's 128
    before = hf_async_cb.runtime_info(model)
    assert "2 builds" in before
    with pytest.raises(ValueError, match="all its memory budget allows"):
        model.generate(ids, max_new_tokens=30000, batching="sync", batching_config=config)
    assert hf_async_cb.runtime_info(model) == before


def test_a_row_no_pool_could_hold_is_refused_before_the_pool_grows():
    """The pool is below its memory budget (the first call was small): a row larger than the whole
    budget is refused at once, the pool kept (it was rebuilt at the budget first, then refused)."""
    model = _llama()
    config = {"cpu_kv_cache_bytes": 2**20}  # the pool's memory budget: 128 pages of 16 tokens
    ids = torch.randint(3, 256, (4, 20))
    model.generate(ids, max_new_tokens=4, batching="sync", batching_config=config)
    before = hf_async_cb.runtime_info(model)
    assert "1 builds" in before
    with pytest.raises(ValueError, match="could hold at most 2048 .128 pages of 16.*memory budget allows"):
        model.generate(ids, max_new_tokens=10**7, batching="sync", batching_config=config)
    assert hf_async_cb.runtime_info(model) == before
    # a row the budget holds still grows the pool
    model.generate(ids, max_new_tokens=1000, batching="sync", batching_config=config)
    assert "2 builds" in hf_async_cb.runtime_info(model)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_row_that_fits_the_pool_exactly_runs_in_every_call(mode):
    """A pool of 4 pages of 8 tokens holds a row of prompt + max_new_tokens - 1 = 32 KV tokens (the last
    sampled token is never fed): the first call (checked by the engine) ran it, and later calls (checked
    before the engine is taken) refused it, counting prompt + max_new_tokens."""
    model = _llama()
    config = {"num_pages": 4, "page_size": 8}
    ids = torch.randint(3, 256, (1, 20), generator=torch.Generator().manual_seed(3))
    expected = model.generate(ids, max_new_tokens=13, eos_token_id=None, batching="off")
    for _ in range(2):
        out = model.generate(ids, max_new_tokens=13, eos_token_id=None, batching=mode, batching_config=config)
        assert torch.equal(out, expected)
    with pytest.raises(ValueError, match="needs up to 33 tokens.*BatchingConfig.num_pages sets it; raise num_pages"):
        model.generate(ids, max_new_tokens=14, eos_token_id=None, batching=mode, batching_config=config)


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_a_window_of_one_token_is_refused_by_name_and_two_runs(family):
    """At sliding_window=1 stock's cached generate disagrees with its own uncached forward (its cache
    keeps no past token), so there are no stock tokens to give: refused by name, before any work.
    A window of 2 gives stock's tokens."""
    from model_configs import tiny_config

    prompts = random_prompts(3, 4, 12, seed=41)
    ids, mask = left_pad(prompts)
    for window in (1, 2):
        config, _ = tiny_config(family)
        config.sliding_window = window
        torch.manual_seed(0)
        model = scaled(transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval())
        expected = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, batching="off")
        if window == 1:
            uncached = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, batching="off",
                                      use_cache=False)
            assert not torch.equal(expected, uncached)  # (why it is refused: stock disagrees with itself)
            with pytest.raises(ValueError, match="sliding_window=1"):
                model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, batching="sync")
        else:
            for mode in ("sync", "async"):
                got = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, batching=mode)
                assert torch.equal(got, expected), mode
