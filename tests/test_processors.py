"""Logits processors and stopping criteria on the slow path: every option behaves as in stock
generate (greedy: the same tokens), in sync and async, with the carried-over token in the history."""

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

from hf_async_cb import BatchingConfig, Engine
from models import left_pad, random_prompts, stock_generate, tiny_model

MODES = ("sync", "async")


def both(model, prompts, mode, **kwargs):
    ids, mask = left_pad(prompts)
    expected = model.generate(ids, attention_mask=mask, batching="off", **kwargs)
    got = model.generate(ids, attention_mask=mask, batching=mode,
                         batching_config=BatchingConfig(page_size=4, max_batch_tokens=32), **kwargs)
    return got, expected


def on_the_device(monkeypatch, prompts, **kwargs):
    """generate() in every mode against stock, with the slow path watched: returns stock's output
    and whether any mode took the slow path. Graph buckets are on (their CPU stand-in)."""
    from hf_async_cb import integration

    slow = []
    monkeypatch.setattr(integration, "_warn_once", lambda message: slow.append(message))
    model = tiny_model("llama")
    ids, mask = left_pad(prompts)
    expected = model.generate(ids, attention_mask=mask, batching="off", **kwargs)
    for mode in MODES:
        got = model.generate(ids, attention_mask=mask, batching=mode, **kwargs,
                             batching_config=BatchingConfig(page_size=4, max_batch_tokens=32, cuda_graphs=True))
        assert torch.equal(got, expected), mode
    return expected, bool(slow)


@pytest.fixture(scope="module")
def eos_candidates():
    """Tokens the tiny Llama generates early, to make min_new_tokens and EOS matter."""
    model = tiny_model("llama")
    prompts = random_prompts(6, 2, 30, seed=31)
    rows = stock_generate(model, prompts, max_new_tokens=12, eos_token_id=None)[:, max(map(len, prompts)):]
    return rows[0, 1].item(), rows[2, 3].item()


OPTIONS = {
    "repetition_penalty": dict(repetition_penalty=1.5),
    "no_repeat_ngram_size": dict(no_repeat_ngram_size=2),
    "bad_words_ids": dict(bad_words_ids=[[5], [7, 8]]),
    "suppress_tokens": dict(suppress_tokens=list(range(10, 60))),
    "sequence_bias": dict(sequence_bias={(9,): 5.0}),
    "forced_eos_token_id": dict(forced_eos_token_id=3, max_new_tokens=6),
    "exponential_decay": dict(exponential_decay_length_penalty=(3, 1.5), eos_token_id=4),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("option", list(OPTIONS))
def test_processor_options_match_stock(option, mode):
    model = tiny_model("llama")
    prompts = random_prompts(6, 2, 30, seed=31)
    kwargs = {"max_new_tokens": 12, **OPTIONS[option]}
    got, expected = both(model, prompts, mode, **kwargs)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("mode", MODES)
def test_min_new_tokens_holds_eos_back(mode, eos_candidates):
    model = tiny_model("llama")
    prompts = random_prompts(6, 2, 30, seed=31)
    eos = list(eos_candidates)
    got, expected = both(model, prompts, mode, max_new_tokens=12, eos_token_id=eos, pad_token_id=0, min_new_tokens=5)
    assert torch.equal(got, expected)
    plain, _ = both(model, prompts, mode, max_new_tokens=12, eos_token_id=eos, pad_token_id=0)
    assert not torch.equal(plain, got), "min_new_tokens should have changed where rows stop"


class EvenOnly(LogitsProcessor):
    """A user processor that depends on the history: after an odd token, only even tokens."""

    def __call__(self, input_ids, scores):
        odd_last = (input_ids[:, -1] % 2 == 1)[:, None]
        odd_vocab = (torch.arange(scores.shape[-1], device=scores.device) % 2 == 1)[None]
        return scores.masked_fill(odd_last & odd_vocab, float("-inf"))


@pytest.mark.parametrize("mode", MODES)
def test_user_logits_processor_sees_the_full_history(mode):
    model = tiny_model("qwen3")
    prompts = random_prompts(5, 3, 20, seed=32)
    got, expected = both(model, prompts, mode, max_new_tokens=10, logits_processor=LogitsProcessorList([EvenOnly()]))
    assert torch.equal(got, expected)


@pytest.mark.parametrize("mode", MODES)
def test_sampling_with_processors_runs_and_respects_them(mode):
    model = tiny_model("llama")
    prompts = random_prompts(4, 3, 10, seed=33)
    ids, mask = left_pad(prompts)
    out = model.generate(ids, attention_mask=mask, batching=mode, max_new_tokens=10, do_sample=True, top_k=20,
                         min_p=0.05, suppress_tokens=list(range(0, 128)), batching_config=BatchingConfig(seed=0))
    assert (out[:, ids.shape[1]:] >= 128).all()


class StopAfterToken(StoppingCriteria):
    def __init__(self, token):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


@pytest.mark.parametrize("mode", MODES)
def test_user_stopping_criteria_stop_where_stock_does(mode, eos_candidates):
    model = tiny_model("llama")
    prompts = random_prompts(6, 2, 30, seed=31)
    criteria = StoppingCriteriaList([StopAfterToken(eos_candidates[0])])
    got, expected = both(model, prompts, mode, max_new_tokens=12, pad_token_id=0, stopping_criteria=criteria)
    assert torch.equal(got, expected)


def test_engine_api_takes_processors_and_criteria():
    model = tiny_model("gpt2")
    prompts = random_prompts(3, 2, 8, seed=34)
    engine = Engine(model, BatchingConfig(mode="async"))
    outs = engine.generate(prompts, max_new_tokens=8, logits_processor=LogitsProcessorList([EvenOnly()]),
                           stopping_criteria=StoppingCriteriaList([StopAfterToken(40)]))
    for o in outs:
        history = o.prompt_token_ids + o.output_token_ids
        for prev, tok in zip(history[len(o.prompt_token_ids) - 1:], o.output_token_ids):
            assert not (prev % 2 == 1 and tok % 2 == 1)
        assert 40 not in o.output_token_ids[:-1]
        if o.output_token_ids[-1] == 40 and len(o.output_token_ids) < 8:
            assert o.finish_reason.value == "stop"


@pytest.mark.parametrize("mode", MODES)
def test_max_time_zero_stops_after_one_token_like_stock(mode):
    model = tiny_model("llama")
    prompts = random_prompts(4, 2, 10, seed=35)
    got, expected = both(model, prompts, mode, max_new_tokens=12, max_time=0.0, pad_token_id=0)
    assert expected.shape[1] == max(map(len, prompts)) + 1
    assert torch.equal(got, expected)


@pytest.mark.parametrize("penalty", [0.7, 1.3, 3.0])
def test_repetition_penalty_runs_on_the_device_and_matches_stock(penalty, monkeypatch):
    """The penalty is applied to every request at once on the device (no slow path), on each row's
    history as stock holds it (left padding included), the carried-over token too."""
    prompts = random_prompts(6, 2, 30, seed=33)
    _, slow = on_the_device(monkeypatch, prompts, max_new_tokens=16, repetition_penalty=penalty)
    assert not slow
    # Next to a processor the engine does not run natively, stock's own list applies it (slow path).
    _, slow = on_the_device(monkeypatch, prompts, max_new_tokens=10, repetition_penalty=penalty,
                            no_repeat_ngram_size=3)
    assert slow


@pytest.mark.parametrize("mode", MODES)
def test_per_request_penalties_in_one_batch(mode):
    """Requests with different penalties (and none) share steps, in a pool small enough to preempt;
    each gets stock's tokens for its prompt alone."""
    from hf_async_cb import SamplingParams

    model = tiny_model("qwen3")
    prompts = random_prompts(8, 2, 40, seed=34)
    penalties = [1.0, 1.3, 2.0, 0.8] * 2
    engine = Engine(model, BatchingConfig(mode=mode, page_size=4, num_pages=40, max_batch_tokens=24))
    outs = engine.generate(prompts, [SamplingParams(max_new_tokens=12, repetition_penalty=p) for p in penalties])
    for prompt, penalty, out in zip(prompts, penalties, outs):
        stock = model.generate(torch.tensor([prompt]), max_new_tokens=12, repetition_penalty=penalty,
                               eos_token_id=None, batching="off")
        assert out.output_token_ids == stock[0, len(prompt):].tolist()
    assert sum(o.num_preemptions for o in outs) > 0
    assert engine.allocator.num_free == engine.allocator.num_pages


@pytest.mark.parametrize("option", [dict(min_new_tokens=5), dict(min_length=38), dict(min_new_tokens=3, min_length=40)])
def test_min_length_options_run_on_the_device(option, eos_candidates, monkeypatch):
    """min_new_tokens / min_length with several EOS ids, on the device (no slow path), in graph
    buckets too: stock's tokens, and they do change where rows stop."""
    common = dict(max_new_tokens=12, eos_token_id=list(eos_candidates), pad_token_id=0)
    prompts = random_prompts(6, 2, 30, seed=31)
    expected, slow = on_the_device(monkeypatch, prompts, **common, **option)
    assert not slow
    plain, _ = on_the_device(monkeypatch, prompts, **common)
    assert not torch.equal(plain, expected), "the option should change where rows stop"


def test_per_request_min_new_tokens_in_one_batch(eos_candidates):
    from hf_async_cb import SamplingParams

    model = tiny_model("llama")
    prompts = random_prompts(6, 2, 30, seed=31)
    mins = [0, 3, 7, 0, 11, 5]
    eos = tuple(eos_candidates)
    engine = Engine(model, BatchingConfig(mode="async", page_size=4, max_batch_tokens=32, cuda_graphs=True))
    outs = engine.generate(prompts, [SamplingParams(max_new_tokens=12, min_new_tokens=m, eos_token_ids=eos)
                                     for m in mins])
    for prompt, m, out in zip(prompts, mins, outs):
        stock = model.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=m or None,
                               eos_token_id=list(eos), pad_token_id=0, batching="off")[0, len(prompt):].tolist()
        if eos[0] in stock or eos[1] in stock:
            stock = stock[: min(stock.index(t) for t in eos if t in stock) + 1]
        assert out.output_token_ids == stock
        assert not any(t in eos for t in out.output_token_ids[:m])


@pytest.mark.parametrize("option", [
    dict(suppress_tokens=list(range(10, 60)) + [100_000]),  # an id outside the vocabulary is ignored, as stock
    dict(begin_suppress_tokens=list(range(0, 200))),
    dict(suppress_tokens=[7, 8, 9], begin_suppress_tokens=list(range(100, 250)), min_new_tokens=4),
])
def test_suppressed_tokens_run_on_the_device(option, eos_candidates, monkeypatch):
    common = dict(max_new_tokens=10, eos_token_id=list(eos_candidates), pad_token_id=0)
    prompts = random_prompts(6, 2, 30, seed=35)
    expected, slow = on_the_device(monkeypatch, prompts, **common, **option)
    assert not slow
    plain, _ = on_the_device(monkeypatch, prompts, **common)
    assert not torch.equal(plain, expected), "the option should change the tokens"


def test_suppress_tokens_outside_the_vocabulary_are_a_clear_error_on_the_engine():
    from hf_async_cb import SamplingParams

    engine = Engine(tiny_model("llama"), BatchingConfig())
    with pytest.raises(ValueError, match="suppress_tokens"):
        engine.generate([[3, 4]], SamplingParams(suppress_tokens=(5, 10_000)))
    assert engine.allocator.num_free == engine.allocator.num_pages
