"""num_return_sequences: copies of a prompt share its cached prompt pages and stay correct."""

import pytest
import torch
from models import generated_rows, left_pad, random_prompts, stock_generate, tiny_model

from hf_async_cb import BatchingConfig, Engine, SamplingParams


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("pages", [None, 40])
def test_greedy_copies_share_pages_and_match_stock(mode, pages):
    model = tiny_model("llama")
    prompts = random_prompts(4, 18, 50, seed=61)
    expected = generated_rows(stock_generate(model, prompts, max_new_tokens=12), max(map(len, prompts)),
                              pad=0, eos=(2,))
    engine = Engine(model, BatchingConfig(mode=mode, page_size=8, num_pages=pages, max_batch_tokens=64))
    outs = engine.generate(prompts, max_new_tokens=12, eos_token_ids=(2,), num_return_sequences=3)
    assert [o.output_token_ids for o in outs] == [row for row in expected for _ in range(3)]
    assert [o.prompt_token_ids for o in outs] == [p for p in prompts for _ in range(3)]
    assert engine.scheduler.num_shared_tokens > 0
    assert engine.allocator.num_free == engine.allocator.num_pages


def test_seeded_copies_differ_and_are_reproducible():
    model = tiny_model("llama")
    prompts = random_prompts(2, 20, 20, seed=62)
    params = SamplingParams(max_new_tokens=10, do_sample=True, temperature=1.5, seed=7)
    runs = [[o.output_token_ids for o in Engine(model, BatchingConfig(mode=mode)).generate(
        prompts, params, num_return_sequences=3)] for mode in ("sync", "async")]
    assert runs[0] == runs[1]
    assert len({tuple(r) for r in runs[0][:3]}) > 1, "copies with derived seeds should differ"


def test_generate_num_return_sequences_layout():
    model = tiny_model("qwen2")
    prompts = random_prompts(3, 5, 30, seed=63)
    ids, mask = left_pad(prompts)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=True, num_return_sequences=2,
                         batching="async", batching_config=BatchingConfig(seed=0))
    assert out.shape[0] == 6
    assert torch.equal(out[:, : ids.shape[1]], ids.repeat_interleave(2, dim=0))
    with pytest.raises(ValueError, match="do_sample"):
        model.generate(ids, attention_mask=mask, max_new_tokens=4, num_return_sequences=2, batching="sync")


def test_bad_num_return_sequences():
    engine = Engine(tiny_model("llama"), BatchingConfig(mode="sync"))
    with pytest.raises(ValueError, match="num_return_sequences"):
        engine.generate([[5, 6]], max_new_tokens=2, num_return_sequences=0)
