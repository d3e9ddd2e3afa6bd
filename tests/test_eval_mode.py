"""A model left in train mode runs on the engine as in eval mode (model/eval_mode.py): the eval-mode
tokens of stock generate in every call, nothing computed with dropout kept in the prefix cache for a
later call, one warning, and every module's mode given back after the call."""

from __future__ import annotations

import logging
import threading

import pytest
import torch
import transformers
from models import left_pad, random_prompts, scaled

from hf_async_cb import BatchingConfig, Engine, SamplingParams
from hf_async_cb.model.eval_mode import as_in_eval

PROMPTS = random_prompts(3, 20, 40, seed=5)
NEW = 12


def _dropping(family: str) -> torch.nn.Module:
    """A tiny fp32 model whose dropout acts in train mode: GPT-2's module dropouts (embeddings,
    residuals, attention weights) or Llama's attention dropout, which its attention function applies."""
    torch.manual_seed(0)
    if family == "gpt2":
        config = transformers.GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=512,
                                          bos_token_id=1, eos_token_id=None, pad_token_id=0, resid_pdrop=0.3,
                                          embd_pdrop=0.3, attn_pdrop=0.3)
    else:
        config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                          pad_token_id=0, bos_token_id=1, eos_token_id=None, attention_dropout=0.5)
    return scaled(transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval())


def _eval_tokens(model) -> torch.Tensor:
    ids, mask = left_pad(PROMPTS)
    return model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, batching="off")


def _modes(model) -> list[bool]:
    return [m.training for m in model.modules()]


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_train_mode_generates_the_eval_tokens_and_keeps_the_modes(family, mode, caplog):
    model = _dropping(family)
    expected = _eval_tokens(model)
    model.train()
    model.transformer.h[0].eval() if family == "gpt2" else model.model.layers[0].eval()  # a mixed model
    modes = _modes(model)
    ids, mask = left_pad(PROMPTS)
    with caplog.at_level(logging.WARNING, logger="hf_async_cb"):
        for _ in range(2):
            got = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, batching=mode)
            assert torch.equal(got, expected)
            assert _modes(model) == modes
    assert sum("training mode with dropout" in r.getMessage() for r in caplog.records) == 1


def test_a_train_mode_call_leaves_nothing_in_the_prefix_cache_for_eval_calls():
    """Prompts of a train-mode call, then the same prompts in eval mode: stock's eval tokens (pages
    computed with dropout would have been taken from the cache)."""
    model = _dropping("gpt2")
    expected = _eval_tokens(model)
    ids, mask = left_pad(PROMPTS)
    model.train()
    model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, batching="sync")
    model.eval()
    got = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, batching="sync")
    assert torch.equal(got, expected)


def test_a_held_engine_and_its_serving_loop_run_a_train_mode_model_as_in_eval():
    model = _dropping("llama")
    expected = [row[len(prompt) + (max(map(len, PROMPTS)) - len(prompt)):].tolist()
                for row, prompt in zip(_eval_tokens(model), PROMPTS)]
    model.train()
    params = SamplingParams(max_new_tokens=NEW, eos_token_ids=())
    with Engine(model, BatchingConfig(prefix_caching=False)) as engine:
        assert [o.output_token_ids for o in engine.generate(PROMPTS, params)] == expected
        assert all(_modes(model))
        engine.start()
        try:
            handles = [engine.add_request(p, params) for p in PROMPTS]
            assert [h.result(timeout=60).output_token_ids for h in handles] == expected
        finally:
            engine.shutdown()
    assert all(_modes(model))


def test_calls_of_several_threads_give_the_modes_back_once_the_last_has_ended():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.5)).train()
    entered, release = threading.Barrier(2), threading.Event()
    seen = []

    def call():
        with as_in_eval(model, warn=False):
            entered.wait()
            release.wait()
            seen.append(_modes(model))

    first = threading.Thread(target=call)
    first.start()
    with as_in_eval(model, warn=False):
        entered.wait()
        release.set()
        first.join()
        assert not any(_modes(model))  # the other call has ended; this one still runs in eval mode
    assert seen == [[False, False, False]] and all(_modes(model))


def test_an_engine_call_waiting_for_a_stock_call_leaves_its_modes_alone():
    """An engine call takes the model's guard before it switches the model to eval mode: a stock call
    of another thread still running (in train mode, dropping) keeps its modes to the end, and the
    engine call then runs as in eval mode and gives the modes back."""
    from transformers import LogitsProcessor, LogitsProcessorList

    model = _dropping("gpt2").train()
    inside, release, seen = threading.Event(), threading.Event(), []

    class Pause(LogitsProcessor):  # holds the stock call inside its generation
        def __call__(self, input_ids, scores):
            if not inside.is_set():
                inside.set()
                release.wait(timeout=30)
            seen.append(_modes(model))
            return scores

    ids, mask = left_pad(PROMPTS)
    stock = threading.Thread(target=lambda: model.generate(
        ids, attention_mask=mask, max_new_tokens=3, do_sample=False, batching="off",
        logits_processor=LogitsProcessorList([Pause()])))
    stock.start()
    assert inside.wait(timeout=30)
    results = []
    engine_call = threading.Thread(target=lambda: results.append(model.generate(
        ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, batching="sync")))
    engine_call.start()
    engine_call.join(timeout=2)  # it waits for the model's guard meanwhile
    assert engine_call.is_alive() and all(_modes(model))
    release.set()
    stock.join(timeout=60)
    engine_call.join(timeout=120)
    assert not stock.is_alive() and not engine_call.is_alive()
    assert seen and all(all(modes) for modes in seen)  # every stock step in train mode
    assert all(_modes(model))
    assert torch.equal(results[0], _eval_tokens(model.eval()))


@pytest.mark.parametrize("family, rates", [
    ("starcoder2", dict(residual_dropout=0.3)),  # functional dropout of the module's own rate
    ("starcoder2", dict(embedding_dropout=0.3)),
    ("mixtral", dict(router_jitter_noise=0.5)),  # a router's noise, in training only
    ("starcoder2", dict()),  # nothing random in training: no warning
])
def test_the_train_mode_warning_names_every_rate_that_acts_in_training(family, rates, caplog):
    """The one warning for a train-mode model reads a module's own rates by name (functional dropout,
    a router's jitter noise), not a fixed list of dropout names; the tokens are the eval tokens."""
    from model_configs import tiny_config

    config, _ = tiny_config(family)
    for name, value in rates.items():
        setattr(config, name, value)
    torch.manual_seed(0)
    model = scaled(transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval())
    ids, mask = left_pad(PROMPTS)
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, batching="off")
    model.train()
    with caplog.at_level(logging.WARNING, logger="hf_async_cb"):
        got = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, batching="sync")
    assert torch.equal(got, expected)
    warned = sum("training mode with dropout" in r.getMessage() for r in caplog.records)
    assert warned == (1 if rates else 0)
