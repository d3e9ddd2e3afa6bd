"""Every option's type and range checked where it comes in: a ValueError naming it, before any work
(never a struct.error, a TypeError or an OverflowError later, nor a silently truncated value), and
what stock generate runs, run as stock runs it."""

import copy
import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
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


@pytest.mark.parametrize("prefix, match", [
    ([5.5], "holds 5.5"), ([True], "holds True"), (["a"], "holds 'a'"), ([256], "outside the vocabulary"),
    ([-1], "outside the vocabulary"), ([3, 2**40], "outside the vocabulary"), (5, "sequence of integer"),
    (torch.tensor([[5]]), "1-D"),
])
def test_a_history_prefix_is_checked_as_a_prompt_is(engine, prefix, match):
    """make_request's history_prefix was read with int(): 5.5 ran as 5 and True as 1, and ids outside the
    vocabulary ran too (the device's history options skip them without a word)."""
    with pytest.raises(ValueError, match=match):
        engine.make_request([5, 6], SamplingParams(max_new_tokens=2, no_repeat_ngram_size=2), history_prefix=prefix)


def test_a_history_prefix_of_integers_runs(engine):
    prefix = [np.int64(5), torch.tensor(38), 7]
    request = engine.make_request([5], SamplingParams(max_new_tokens=2, no_repeat_ngram_size=2), history_prefix=prefix)
    assert request.history_prefix == [5, 38, 7]
    engine.run([request])
    assert request.output_token_ids[0] != 38  # (5, 38) is in the history: 38 is banned after the prompt's 5


def test_integer_scalars_and_arrays_are_token_ids(engine):
    expected = engine.generate([[5, 6, 7]], max_new_tokens=3)[0].output_token_ids
    for prompts in ([[np.int64(5), torch.tensor(6), 7]], [np.array([5, 6, 7], dtype=np.int32)],
                    torch.tensor([[5, 6, 7]]), [torch.tensor([5, 6, 7], dtype=torch.int16)]):
        (out,) = engine.generate(prompts, max_new_tokens=3)
        assert out.prompt_token_ids == [5, 6, 7] and out.output_token_ids == expected
        assert all(type(t) is int for t in out.prompt_token_ids)


# -- generate() ----------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["sync", "async"])
def test_int32_input_ids_give_int64_as_stock(model, mode):
    prompts = random_prompts(3, 2, 8, seed=42)
    ids, mask = left_pad(prompts)
    expected = model.generate(ids.int(), attention_mask=mask, max_new_tokens=4, batching="off")
    got = model.generate(ids.int(), attention_mask=mask, max_new_tokens=4, batching=mode)
    assert expected.dtype == torch.int64 and got.dtype == torch.int64
    assert torch.equal(got, expected)
    out = model.generate(ids.int(), attention_mask=mask, max_new_tokens=4, batching=mode, return_dict_in_generate=True)
    assert out.sequences.dtype == torch.int64 and torch.equal(out.sequences, expected)


@pytest.mark.parametrize("kwargs", [dict(max_new_tokens=3.0), dict(max_length=10.0), dict(max_new_tokens=np.int64(3)),
                                    dict(eos_token_id=2.0), dict(pad_token_id=0.0)])
def test_integral_floats_run_as_in_stock(model, kwargs):
    prompts = random_prompts(3, 2, 7, seed=43)
    kwargs = {"max_new_tokens": 4, **kwargs} if "max_length" not in kwargs else kwargs
    expected = stock_generate(model, prompts, **kwargs)
    ids, mask = left_pad(prompts)
    assert torch.equal(model.generate(ids, attention_mask=mask, batching="sync", **kwargs), expected)


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_new_tokens=2.5), "max_new_tokens"), (dict(max_length=6.5), "max_length"),
    (dict(eos_token_id=2.5), "eos_token_id"),
    (dict(pad_token_id=0.5), "pad_token_id"),
])
def test_fractional_lengths_and_ids_are_refused(model, no_engine, kwargs, match):
    with pytest.raises(ValueError, match=match):
        model.generate(torch.tensor([[5, 6, 7]]), batching="sync", **{"max_new_tokens": 3, **kwargs})


@pytest.mark.parametrize("value", [-1, 0, 2.0, True])
def test_num_return_sequences_must_be_positive(model, no_engine, value):
    with pytest.raises(ValueError, match="num_return_sequences"):
        model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=3, do_sample=True, num_return_sequences=value,
                       batching="sync")


def test_greedy_copies_refused_before_any_work(model, no_engine):
    with pytest.raises(ValueError, match="do_sample"):
        model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=3, num_return_sequences=2, batching="sync")


class StopAfterToken(StoppingCriteria):
    def __init__(self, token):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


@pytest.fixture(scope="module")
def no_eos_model():
    """The tiny Llama with neither EOS nor pad token, in its config and its generation config."""
    m = copy.deepcopy(tiny_model("llama"))
    for config in (m.config, m.generation_config):
        config.eos_token_id = config.pad_token_id = None
    return m


@pytest.mark.parametrize("kwargs, named", [
    (dict(stopping_criteria="stop-after-first"), "stopping_criteria"),
    (dict(max_time=100.0), "max_time"), (dict(max_time=0.0), "max_time"),
    (dict(stopping_criteria="stop-after-first", pad_token_id=0), "stopping_criteria"),
])
def test_rows_stopping_apart_without_eos_refused_up_front(no_eos_model, no_engine, kwargs, named):
    """Without EOS, stock keeps generating on a row that a criterion stopped (it pads only behind
    EOS): the engine cannot, so such a batch is refused before any work, pad token or not."""
    prompts = random_prompts(2, 3, 6, seed=44)
    ids, mask = left_pad(prompts)
    if kwargs.get("stopping_criteria"):
        first = no_eos_model.generate(ids, attention_mask=mask, max_new_tokens=1, batching="off")[0, -1].item()
        kwargs = {**kwargs, "stopping_criteria": StoppingCriteriaList([StopAfterToken(first)])}
    with pytest.raises(ValueError, match=f"{named}.*no eos_token_id"):
        no_eos_model.generate(ids, attention_mask=mask, max_new_tokens=5, batching="sync", **kwargs)


def test_one_row_without_eos_still_runs_with_criteria(no_eos_model):
    ids = torch.tensor([random_prompts(1, 4, 4, seed=45)[0]])
    first = no_eos_model.generate(ids, max_new_tokens=1, batching="off")[0, -1].item()
    kwargs = dict(max_new_tokens=5, stopping_criteria=StoppingCriteriaList([StopAfterToken(first)]))
    expected = no_eos_model.generate(ids, batching="off", **kwargs)
    assert expected.shape[1] == ids.shape[1] + 1
    assert torch.equal(no_eos_model.generate(ids, batching="sync", **kwargs), expected)


def test_rows_stopping_apart_with_eos_match_stock(model):
    """With EOS (pad falling back to it), stopped rows are padded by stock too: the batch runs."""
    prompts = random_prompts(3, 3, 8, seed=46)
    ids, mask = left_pad(prompts)
    first = model.generate(ids, attention_mask=mask, max_new_tokens=1, batching="off")[0, -1].item()
    kwargs = dict(max_new_tokens=5, stopping_criteria=StoppingCriteriaList([StopAfterToken(first)]))
    expected = model.generate(ids, attention_mask=mask, batching="off", **kwargs)
    assert torch.equal(model.generate(ids, attention_mask=mask, batching="sync", **kwargs), expected)


def test_device_sized_defaults(monkeypatch):
    """max_batch_tokens and kv_memory_fraction left to the device: 512 tokens on the CPU; on CUDA
    by the GPU's memory (8192 at 70 GiB or more, 4096 at 32, 2048 below) and 0.9 of free memory;
    a user's value is kept; the Engine runs with the decided values."""
    import hf_async_cb.config as config_module

    config = BatchingConfig()
    assert config.max_batch_tokens is None and config.kv_memory_fraction is None
    cpu = config.for_device("cpu")
    assert (cpu.max_batch_tokens, cpu.kv_memory_fraction) == (512, 0.9)
    assert cpu.for_device("cpu") is cpu
    assert BatchingConfig(max_batch_tokens=64, kv_memory_fraction=0.3).for_device("cpu").max_batch_tokens == 64

    class Props:
        def __init__(self, gib):
            self.total_memory = gib * 2**30

    for gib, tokens in ((141, 8192), (80, 8192), (48, 4096), (24, 2048)):
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device, gib=gib: Props(gib))
        assert config_module.default_batch_tokens(torch.device("cuda", 0)) == tokens
    monkeypatch.undo()

    engine = Engine(tiny_model("llama"), BatchingConfig())
    assert engine.config.max_batch_tokens == 512 and engine.scheduler.max_batch_tokens == 512


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(st.lists(st.booleans(), min_size=1, max_size=9), min_size=1, max_size=5).filter(
    lambda rows: len({len(r) for r in rows}) == 1))
def test_a_generate_mask_is_read_as_a_row_by_row_reading_reads_it(rows):
    """generate()'s attention mask, read in torch (generate/arguments.unpad): each row's prompt and
    padding as a reading of every token in Python gives them, and a refusal for the same masks
    (a row all zeros, padding after a row's first token)."""
    from hf_async_cb.generate.arguments import unpad

    ids = torch.arange(len(rows) * len(rows[0])).view(len(rows), -1)
    expected = []
    for tokens, flags in zip(ids.tolist(), rows):
        first = flags.index(True) if any(flags) else None
        if first is None or not all(flags[first:]):
            expected = None
            break
        expected.append((tokens[first:], tokens[:first]))
    if expected is None:
        with pytest.raises(ValueError, match="attention_mask"):
            unpad(ids, torch.tensor(rows, dtype=torch.long))
    else:
        prompts, prefixes = unpad(ids, torch.tensor(rows, dtype=torch.long))
        assert list(zip(prompts, prefixes)) == expected


@pytest.mark.parametrize("value", [2, 0.5, -1])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_mask_holding_other_values_than_0_and_1_is_refused(value, mode):
    """Stock generate takes a mask's values into its position ids (mask.cumsum): a mask of 2s runs
    with doubled positions. The engine reads a padding mask; any other value is refused by name, not
    read as 1 (which gave neither stock's tokens nor a refusal)."""
    model = tiny_model("llama")
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    mask = torch.ones_like(ids, dtype=torch.float if isinstance(value, float) else torch.long)
    mask[1, 2] = value
    with pytest.raises(ValueError, match=r"row 1 of attention_mask holds .*1 for a token and 0 for padding"):
        model.generate(ids, attention_mask=mask, max_new_tokens=2, batching=mode)
    float_ones = torch.ones_like(ids, dtype=torch.float)  # 1.0 and 0.0 are a padding mask
    assert model.generate(ids, attention_mask=float_ones, max_new_tokens=2, batching=mode).shape == (2, 6)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_length_given_as_a_one_value_tensor_runs_as_in_stock(mode):
    """Stock runs max_new_tokens=torch.tensor(5); it was refused."""
    model = tiny_model("llama")
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    kwargs = dict(max_new_tokens=torch.tensor(5), do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(model.generate(ids, batching=mode, **kwargs), model.generate(ids, **kwargs))


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_beam_groups_option_without_beam_groups_is_ignored_as_in_stock(mode):
    """diversity_penalty acts between beam groups alone: without them stock ignores it (the engine
    refused it); with num_beam_groups > 1 the call is refused by name."""
    model = tiny_model("llama")
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    kwargs = dict(max_new_tokens=5, do_sample=False, eos_token_id=None, pad_token_id=0, diversity_penalty=1.0)
    assert torch.equal(model.generate(ids, batching=mode, **kwargs), model.generate(ids, **kwargs))
    with pytest.raises(ValueError, match="num_beam"):
        model.generate(ids, batching=mode, num_beams=4, num_beam_groups=2, **kwargs)


def test_the_held_engines_arguments_are_checked_in_the_callers_thread():
    """A dict config is read as generate's batching_config is; other configs, a pool too large to
    allocate, a non-callable on_token or done-callback, and add_request after close() are refused
    with the field or the reason named (not a TypeError from torch or a failure on the loop thread)."""
    model = tiny_model("llama")
    with Engine(model, {"page_size": 4, "mode": "sync"}) as engine:
        assert engine.config.page_size == 4
    with pytest.raises(TypeError, match="Engine takes a BatchingConfig"):
        Engine(model, "async")
    for huge in (dict(num_pages=2**70), dict(num_pages=10**13), dict(cpu_kv_cache_bytes=2**62)):
        with pytest.raises(ValueError, match=r"the KV pool of \d+ pages .* cannot be allocated"):
            Engine(model, BatchingConfig(**huge))
    engine = Engine(model, BatchingConfig(mode="async"))
    engine.start()
    try:
        with pytest.raises(ValueError, match="on_token must be a callable"):
            engine.add_request([5, 6, 7], max_new_tokens=2, on_token=5)
        handle = engine.add_request([5, 6, 7], max_new_tokens=2)
        with pytest.raises(ValueError, match="add_done_callback takes a callable"):
            handle.add_done_callback(5)
        assert len(handle.result(timeout=60).output_token_ids) == 2
    finally:
        engine.shutdown()
        engine.close()
    with pytest.raises(RuntimeError, match="this Engine was closed"):
        engine.add_request([5, 6, 7], max_new_tokens=2)


def test_data_parallels_seed_arguments_to_engine_generate_are_checked():
    """engine_seed and seed_indices (DataParallel's) are range-checked as BatchingConfig.seed is."""
    with Engine(tiny_model("llama"), BatchingConfig(mode="sync")) as engine:
        for bad in (dict(engine_seed="x"), dict(engine_seed=-1), dict(engine_seed=2**64),
                    dict(seed_indices=["a"]), dict(seed_indices=[0.5]), dict(seed_indices=[-1])):
            with pytest.raises(ValueError, match="engine_seed|seed_indices"):
                engine.generate([[5, 6, 7]], max_new_tokens=2, do_sample=True, **bad)
        assert len(engine.generate([[5, 6, 7]], max_new_tokens=2, do_sample=True, engine_seed=3,
                                   seed_indices=[np.int64(4)])[0].output_token_ids) == 2
