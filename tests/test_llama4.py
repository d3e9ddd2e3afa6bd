"""Llama 4's text model on the engine, within the positions where its attention is plain causal
attention (model/checks.full_attention_reach): its chunked-attention layers (each key seen only by
queries of its chunk of attention_chunk_size positions) and its NoPE layers' temperature tuning (a
query scale that leaves 1 from position floor_scale - 1 on, counted over stock's padded rows and over
a packed step's tokens). Stock generate (transformers' own Llama 4 code) is the oracle: tokens and
logits, left padding included, both loops; past the reach a row is refused by name."""

import pytest
import torch
import transformers

from hf_async_cb import BatchingConfig, Engine, SamplingParams

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def llama4(chunk: int, floor_scale: int, attn_scale: float = 4.0, seed: int = 0):
    """Four layers: chunked attention with RoPE at 0 and 2, full attention without RoPE (temperature
    tuning) at 1 and 3, a mixture of two experts in each. attn_scale 4 (Llama 4's is 0.1): a query
    scaled past the reach moves the logits by far more than rounding."""
    torch.manual_seed(seed)
    config = transformers.Llama4TextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=64, intermediate_size_mlp=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=2, num_experts_per_tok=1,
        interleave_moe_layer_step=1, no_rope_layer_interval=2, attention_chunk_size=chunk, floor_scale=floor_scale,
        attn_scale=attn_scale, pad_token_id=0)
    model = transformers.Llama4ForCausalLM(config).eval()
    assert config.layer_types == ["chunked_attention", "full_attention"] * 2 and config.attn_temperature_tuning
    return model


def padded(rows: int, width: int, pads=(), seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 256, (rows, width), generator=g)
    mask = torch.ones_like(ids)
    for row, n in enumerate(pads):
        ids[row, :n], mask[row, :n] = 0, 0
    return ids, mask


def generated(model, ids, mask, new, **kwargs):
    return model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0,
                          output_logits=True, return_dict_in_generate=True, **kwargs)


def assert_as_stock(model, ids, mask, new):
    stock = generated(model, ids, mask, new)
    for mode in ("sync", "async"):
        ours = generated(model, ids, mask, new, batching=mode)
        assert ours.sequences.tolist() == stock.sequences.tolist(), mode
        for a, b in zip(ours.logits, stock.logits):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_runs_as_stock_up_to_the_last_position_of_a_chunk():
    """Chunk of 64 (the reach; floor_scale 200 beyond it): padded width 40 + 25 new - 1 = 64 positions fed."""
    model = llama4(chunk=64, floor_scale=200)
    ids, mask = padded(3, 40, pads=(9, 0, 17))
    assert_as_stock(model, ids, mask, 25)


def test_a_row_past_the_reach_is_refused_by_name_and_padding_counts_as_stock_counts_it():
    model = llama4(chunk=64, floor_scale=200)
    ids, mask = padded(2, 40)
    for mode in ("sync", "async"):
        with pytest.raises(ValueError, match=r"65 positions run past 64, the reach of its chunked-attention layers"):
            model.generate(ids, attention_mask=mask, max_new_tokens=26, batching=mode, pad_token_id=0)
    # Every row fits unpadded (30 + 30 - 1), but stock's positions count the padding of the 40-wide batch.
    ids, mask = padded(2, 40, pads=(10, 10))
    with pytest.raises(ValueError, match=r"padded prompt width \+ max_new_tokens - 1 = 69 positions run past 64"):
        model.generate(ids, attention_mask=mask, max_new_tokens=30, batching="sync", pad_token_id=0)
    engine = Engine(model, BatchingConfig(mode="sync"))
    with pytest.raises(ValueError, match="the reach of its chunked-attention layers"):
        engine.make_request(list(range(3, 43)), SamplingParams(max_new_tokens=26))
    out = engine.generate([list(range(3, 43))], max_new_tokens=25, eos_token_ids=())
    assert len(out[0].output_token_ids) == 25


def test_a_step_holds_fewer_tokens_than_the_temperature_tunings_floor():
    """floor_scale 24: the NoPE layers scale a query by positions counted over a packed step's tokens,
    so the engine's steps hold at most 23 (72 prompt tokens run over several steps); each row's own
    positions stay under 23 (12 + 10 - 1)."""
    model = llama4(chunk=200, floor_scale=24)
    assert Engine(model, BatchingConfig(mode="sync")).config.max_batch_tokens == 23
    ids, mask = padded(6, 12, pads=(0, 3))
    assert_as_stock(model, ids, mask, 10)
    with pytest.raises(ValueError, match=r"reach of its NoPE layers' attention temperature tuning"):
        model.generate(ids, attention_mask=mask, max_new_tokens=13, batching="async", pad_token_id=0)


def test_chunked_layers_without_a_chunk_size_are_refused_by_name():
    """The reach needs the chunk: chunked-attention layers whose size the config does not give (edited
    to None) are refused as before, never run as full attention."""
    import hf_async_cb  # noqa: F401 (generate's batching= hook)

    model = llama4(chunk=64, floor_scale=200)
    model.config.attention_chunk_size = None
    with pytest.raises(ValueError, match=r"other than full or sliding-window attention \(\['chunked_attention'\]\)"):
        model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2, batching="sync")
