"""Every option's type and range checked where it comes in: a ValueError naming it, before any work
(never a struct.error, a TypeError or an OverflowError later, nor a silently truncated value), and
what stock generate runs, run as stock runs it."""

import copy
import dataclasses

import numpy as np
import pytest
import torch
from models import left_pad, random_prompts, stock_generate, tiny_model
from transformers import StoppingCriteria, StoppingCriteriaList

from hf_async_cb import BatchingConfig, Engine, SamplingParams


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def engine(model):
    return Engine(model, BatchingConfig(mode="sync", page_size=4, num_pages=32))


@pytest.fixture
def no_engine(monkeypatch):
    """Fails the test if an Engine gets built: the error must come before any work."""
    def refuse(self, *args, **kwargs):
        raise AssertionError("an Engine was built before the error")

    monkeypatch.setattr(Engine, "__init__", refuse)


# -- BatchingConfig ------------------------------------------------------------------------------

@pytest.mark.parametrize("field, value", [
    ("seed", "abc"), ("seed", -1), ("seed", 2**63), ("seed", 2**70), ("seed", 1.0), ("seed", True),
    ("cuda_graphs", "yes"), ("cuda_graphs", 1), ("progress", "no"), ("progress", None), ("profile", 1),
    ("prefill_graphs", None), ("trust_untested_model", "false"), ("fuse_projections", 0),
    ("fuse_elementwise", "auto"), ("kv_memory_fraction", "0.5"), ("kv_memory_fraction", 0),
    ("kv_memory_fraction", float("nan")), ("kv_memory_fraction", True), ("page_size", True),
    ("page_size", "4"), ("num_pages", 2.0), ("cpu_kv_cache_bytes", -1), ("max_batch_tokens", np.float64(8)),
    ("max_running_requests", None), ("mode", None), ("mode", ["sync"]), ("attention", None),
])
def test_config_field_types_and_ranges(field, value):
    with pytest.raises(ValueError, match=f"BatchingConfig.{field}"):
        BatchingConfig(**{field: value})


@pytest.mark.parametrize("value", [object(), "yes", [1]])
@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(BatchingConfig)])
def test_every_config_field_is_checked(field, value):
    """A field added later without a check fails here."""
    with pytest.raises(ValueError, match=f"BatchingConfig.{field}"):
        BatchingConfig(**{field: value})


def test_config_checked_again_when_changed(model):
    config = BatchingConfig(mode="sync")
    config.seed = "abc"
    with pytest.raises(ValueError, match="BatchingConfig.seed"):
        Engine(model, config)


def test_config_accepts_numpy_scalars_as_plain_values():
    config = BatchingConfig(seed=np.int64(2**63 - 1), page_size=np.int32(8), kv_memory_fraction=np.float32(0.25),
                            num_pages=np.int64(4))
    assert type(config.seed) is int and config.seed == 2**63 - 1
    assert type(config.page_size) is int and type(config.num_pages) is int
    assert type(config.kv_memory_fraction) is float
    assert BatchingConfig(kv_memory_fraction=1).kv_memory_fraction == 1.0
    assert BatchingConfig(seed=0, cuda_graphs=None, fuse_projections=False).seed == 0


# -- SamplingParams ------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, field", [
    (dict(top_k=2.5), "top_k"), (dict(top_k=3.0), "top_k"), (dict(top_k=True), "top_k"), (dict(top_k=-1), "top_k"),
    (dict(temperature="1"), "temperature"), (dict(temperature=None), "temperature"),
    (dict(do_sample=True, temperature=0.0), "temperature"), (dict(top_p="0.9"), "top_p"),
    (dict(do_sample=True, top_p=1.5), "top_p"), (dict(min_p=None), "min_p"), (dict(do_sample=True, min_p=-0.1), "min_p"),
    (dict(repetition_penalty="1"), "repetition_penalty"), (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(max_new_tokens=2.5), "max_new_tokens"), (dict(max_new_tokens=True), "max_new_tokens"),
    (dict(max_new_tokens="3"), "max_new_tokens"), (dict(do_sample=1), "do_sample"), (dict(do_sample="no"), "do_sample"),
    (dict(no_repeat_ngram_size=2.0), "no_repeat_ngram_size"), (dict(min_new_tokens=1.5), "min_new_tokens"),
    (dict(min_new_tokens=-1), "min_new_tokens"), (dict(seed=-1), "seed"), (dict(seed=2**63), "seed"),
    (dict(seed=1.0), "seed"), (dict(eos_token_ids=5.0), "eos_token_ids"), (dict(eos_token_ids=[2.0]), "eos_token_ids"),
    (dict(eos_token_ids=[True]), "eos_token_ids"), (dict(eos_token_ids=-1), "eos_token_ids"),
    (dict(eos_token_ids="2"), "eos_token_ids"), (dict(suppress_tokens=5), "suppress_tokens"),
    (dict(suppress_tokens=[1.5]), "suppress_tokens"), (dict(begin_suppress_tokens=[True]), "begin_suppress_tokens"),
    (dict(bad_words_ids=5), "bad_words_ids"), (dict(bad_words_ids=[[1.0]]), "bad_words_ids"),
    (dict(sequence_bias=5), "sequence_bias"), (dict(sequence_bias={(5,): "1"}), "sequence_bias"),
])
def test_sampling_params_types_and_ranges(engine, kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)
    with pytest.raises(ValueError, match=field):  # the engine's keyword form builds the same
        engine.generate([[5, 6]], **kwargs)


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(SamplingParams) if f.init])
def test_every_sampling_field_is_checked(field):
    """A field added later without a check fails here."""
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: object()})


def test_sampling_params_normalised():
    params = SamplingParams(max_new_tokens=3.0, top_k=np.int64(4), temperature=1, eos_token_ids=np.int64(5),
                            suppress_tokens=torch.tensor([7, 8]), seed=np.uint64(9))
    assert params.max_new_tokens == 3 and type(params.max_new_tokens) is int
    assert type(params.top_k) is int and type(params.temperature) is float and type(params.seed) is int
    assert params.eos_token_ids == (5,) and params.suppress_tokens == (7, 8)
    assert all(type(t) is int for t in params.eos_token_ids + params.suppress_tokens)
    assert SamplingParams(eos_token_ids=5) == SamplingParams(eos_token_ids=[5])


def test_engine_takes_one_eos_id_as_stock_does(engine, model):
    """eos_token_ids=int stops where stock's eos_token_id=int does."""
    prompts = random_prompts(3, 2, 6, seed=42)
    width = max(map(len, prompts))
    first = stock_generate(model, prompts, max_new_tokens=4, eos_token_id=None)[0, width + 1].item()
    expected = stock_generate(model, prompts, max_new_tokens=6, eos_token_id=first, pad_token_id=0)[:, width:]
    outputs = engine.generate(prompts, max_new_tokens=6, eos_token_ids=first)
    assert len(outputs[0].output_token_ids) == 2 and outputs[0].output_token_ids[-1] == first
    for out, row in zip(outputs, expected.tolist()):
        assert out.output_token_ids == row[:len(out.output_token_ids)]
        assert all(t == 0 for t in row[len(out.output_token_ids):])


# -- prompts -------------------------------------------------------------------------------------

@pytest.mark.parametrize("prompts", [
    [[5.7, 6]], [[5.0, 6]], [[True, 6]], [[5, np.float32(6)]], [torch.tensor([5.0, 6.0])], torch.tensor([[5.0, 6.0]]),
    [np.array([5.5, 6.0])], [torch.tensor([True, False])], [[5, torch.tensor(6.0)]], [[[5, 6]]], [5],
])
def test_float_or_bool_token_ids_are_refused(engine, prompts):
    with pytest.raises(ValueError, match="prompt 0"):
        engine.generate(prompts, max_new_tokens=2)


def test_integer_scalars_and_arrays_are_token_ids(engine):
    expected = engine.generate([[5, 6, 7]], max_new_tokens=3)[0].output_token_ids
    for prompts in ([[np.int64(5), torch.tensor(6), 7]], [np.array([5, 6, 7], dtype=np.int32)],
                    torch.tensor([[5, 6, 7]]), [torch.tensor([5, 6, 7], dtype=torch.int16)]):
        (out,) = engine.generate(prompts, max_new_tokens=3)
        assert out.prompt_token_ids == [5, 6, 7] and out.output_token_ids == expected
        assert all(type(t) is int for t in out.prompt_token_ids)
