"""The Engine's EOS default against stock generate's stopping position: without eos_token_ids, a
request stops at the model's EOS ids (its generation config's eos_token_id, an int or a list, else
the tokenizer's), in Engine.generate, add_request and DataParallel; eos_token_ids=() runs past EOS
as stock's eos_token_id=None does; generate(batching=...) keeps stock's own semantics.

EOS is the token the tiny Llama greedily produces at step STOP_STEP of the first prompt, so that
the oracle stops that row early (and the third row, which produces it at once)."""

from __future__ import annotations

import copy
import functools
import types

import pytest
from models import generated_rows, random_prompts, stock_generate, tiny_model

from hf_async_cb import BatchingConfig, DataParallel, Engine, FinishReason, SamplingParams
from hf_async_cb.engine.eos import MODEL_EOS, model_eos_token_ids

NEW = 12
STOP_STEP = 2
PROMPTS = random_prompts(4, 3, 12, seed=31)
WIDTH = max(map(len, PROMPTS))


@functools.lru_cache(maxsize=None)
def greedy_eos() -> int:
    """The first prompt's greedy token at STOP_STEP, which it has not produced before."""
    row = stock_generate(tiny_model("llama"), PROMPTS[:1], max_new_tokens=NEW, eos_token_id=None)[0, len(PROMPTS[0]):]
    token = int(row[STOP_STEP])
    assert token not in row[:STOP_STEP].tolist()
    return token


def eos_model(eos):
    """A copy of the tiny Llama whose generation config names `eos` (an int, a list or None)."""
    model = copy.deepcopy(tiny_model("llama"))
    model.generation_config.eos_token_id = eos
    return model


def stock_rows(model, prompts=PROMPTS, **kwargs) -> list[list[int]]:
    """Stock generate's tokens per row, up to and including its EOS (the model's, unless kwargs say)."""
    eos = kwargs.get("eos_token_id", model.generation_config.eos_token_id)
    eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
    out = stock_generate(model, prompts, max_new_tokens=NEW, pad_token_id=0, **kwargs)
    return generated_rows(out, max(map(len, prompts)), pad=0, eos=eos)


def tokens(outputs) -> list[list[int]]:
    return [o.output_token_ids for o in outputs]


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("as_list", [False, True])
def test_engine_generate_stops_at_the_generation_configs_eos(mode, as_list):
    t = greedy_eos()
    model = eos_model([255, t] if as_list else t)
    expected = stock_rows(model)
    assert len(expected[0]) == STOP_STEP + 1 and expected[0][-1] == t  # the oracle stops early
    with Engine(model, BatchingConfig(mode=mode)) as engine:
        outputs = engine.generate(PROMPTS, max_new_tokens=NEW)
        assert tokens(outputs) == expected
        assert outputs[0].finish_reason is FinishReason.EOS
        params = SamplingParams(max_new_tokens=NEW)  # the default, given as params
        assert params.eos_token_ids is MODEL_EOS
        assert tokens(engine.generate(PROMPTS, params)) == expected


def test_the_tokenizers_eos_when_the_generation_config_names_none():
    t = greedy_eos()
    model = eos_model(None)
    tokenizer = types.SimpleNamespace(eos_token_id=t)
    with Engine(model, BatchingConfig(mode="async"), tokenizer=tokenizer) as engine:
        assert tokens(engine.generate(PROMPTS, max_new_tokens=NEW)) == stock_rows(model, eos_token_id=t)
    assert model_eos_token_ids(model) == () and model_eos_token_ids(eos_model(-1)) == ()
    assert model_eos_token_ids(eos_model(t), tokenizer=types.SimpleNamespace(eos_token_id=3)) == (t,)


def test_empty_eos_token_ids_run_past_eos_as_stock_eos_none():
    model = eos_model(greedy_eos())
    expected = stock_rows(model, eos_token_id=None)
    assert len(expected[0]) == NEW
    with Engine(model, BatchingConfig(mode="async")) as engine:
        outputs = engine.generate(PROMPTS, max_new_tokens=NEW, eos_token_ids=())
        assert tokens(outputs) == expected and outputs[0].finish_reason is FinishReason.LENGTH
    with pytest.raises(ValueError, match="eos_token_ids=None is ambiguous"):
        SamplingParams(eos_token_ids=None)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_add_request_stops_at_the_models_eos(mode):
    """The online API, token ids and text (through the engine's tokenizer) alike."""
    t = greedy_eos()
    model = eos_model(t)
    text = "a chat prompt"

    class Tokenizer:
        eos_token_id = None  # the generation config's EOS comes first

        def __call__(self, prompt):
            return {"input_ids": [3 + ord(c) % 200 for c in prompt]}

    text_ids = Tokenizer()(text)["input_ids"]
    expected = stock_rows(model)
    expected_text = stock_rows(model, [text_ids])[0]
    expected_past = stock_rows(model, PROMPTS[:1], eos_token_id=None)[0]
    engine = Engine(model, BatchingConfig(mode=mode), tokenizer=Tokenizer())
    engine.start()
    try:
        handles = [engine.add_request(p, max_new_tokens=NEW) for p in PROMPTS]
        by_text = engine.add_request(text, max_new_tokens=NEW)
        past = engine.add_request(PROMPTS[0], max_new_tokens=NEW, eos_token_ids=())
        outputs = [h.result(timeout=60) for h in handles]
        assert tokens(outputs) == expected and outputs[0].finish_reason is FinishReason.EOS
        assert by_text.result(timeout=60).output_token_ids == expected_text
        out = past.result(timeout=60)
        assert out.output_token_ids == expected_past and out.finish_reason is FinishReason.LENGTH
    finally:
        engine.shutdown(timeout=30)
        engine.close()


def test_data_parallel_takes_the_models_eos_as_it_is_now():
    """The replicas are copies made when DataParallel was built: a generation config changed after
    that still decides where every replica's requests stop."""
    t = greedy_eos()
    model = eos_model(None)
    prompts = [PROMPTS[0]] * 4  # alike: both replicas get some
    with DataParallel(model, devices=["cpu", "cpu"], config=BatchingConfig(mode="async")) as dp:
        model.generation_config.eos_token_id = t
        expected = stock_rows(model, prompts)
        assert all(len(row) == STOP_STEP + 1 for row in expected)
        assert tokens(dp.generate(prompts, max_new_tokens=NEW)) == expected
        assert all(dp.last_assignment)
        assert tokens(dp.generate(prompts, max_new_tokens=NEW, eos_token_ids=())) == \
            stock_rows(model, prompts, eos_token_id=None)


@pytest.mark.parametrize("eos_token_id", ["default", None])
def test_generate_with_batching_keeps_stocks_eos_semantics(eos_token_id):
    """model.generate(batching=...) passes its GenerationConfig's ids: eos_token_id=None is no EOS there."""
    from models import left_pad

    model = eos_model(greedy_eos())
    kwargs = {} if eos_token_id == "default" else {"eos_token_id": eos_token_id}
    ids, mask = left_pad(PROMPTS)
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, pad_token_id=0, batching="off", **kwargs)
    got = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, pad_token_id=0, batching="async", **kwargs)
    assert got.tolist() == expected.tolist()


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("kwargs", [dict(eos_token_id=-5), dict(eos_token_id=-5, min_new_tokens=3),
                                    dict(eos_token_id="both", min_new_tokens=1)])
def test_negative_eos_ids_run_as_stock_runs_them(mode, kwargs):
    """Stock warns of a negative eos_token_id and goes on: no token meets it (its min-new-tokens mask
    matches no column), so alone it runs to max_new_tokens, and beside a real id the real one stops."""
    from models import left_pad

    model = tiny_model("llama")
    if kwargs["eos_token_id"] == "both":
        kwargs = {**kwargs, "eos_token_id": [greedy_eos(), -5]}
    ids, mask = left_pad(PROMPTS)
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, pad_token_id=0, **kwargs)
    got = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, pad_token_id=0, batching=mode, **kwargs)
    assert got.tolist() == expected.tolist()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_negative_first_eos_pads_the_stopped_rows_as_stock_would(mode):
    """Without pad_token_id, stock pads with the first EOS id even when it is negative (and then
    crashes embedding it on the next step, if other rows go on); the engine fills those rows with it."""
    from models import left_pad

    model = tiny_model("llama")
    ids, mask = left_pad(PROMPTS)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, eos_token_id=[-5, greedy_eos()],
                         pad_token_id=None, batching=mode)
    first = out[0, WIDTH:].tolist()
    assert first[:STOP_STEP + 1] == stock_rows(model, PROMPTS[:1], eos_token_id=greedy_eos())[0]
    assert first[STOP_STEP + 1:] == [-5] * (NEW - STOP_STEP - 1)
