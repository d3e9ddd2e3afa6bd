"""Prompt embeddings on the engine: generate(inputs_embeds=...) token-exact against stock generate,
chunked, cached and preempted; PromptEmbeds' own arithmetic; refusals by name."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from models import left_pad, tiny_model

import hf_async_cb
from hf_async_cb import BatchingConfig, Engine, SamplingParams
from hf_async_cb.engine.cuda_graphs import DecodeGraphs
from hf_async_cb.engine.prompt_embeds import PromptEmbeds
from hf_async_cb.engine.requests import Request
from hf_async_cb.engine.step_plan import ScheduledChunk, StepPlan

MODES = ("sync", "async")


def _model(family="llama", seed=0):
    """A copy of the shared tiny model: these tests change its generation config and its forward."""
    model = copy.deepcopy(tiny_model(family, seed))
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def _embeds(model, ids, noise=0.5, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        plain = model.get_input_embeddings()(ids)
    return plain + noise * torch.randn(plain.shape, generator=g)


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen2"])
@pytest.mark.parametrize("with_ids", [False, True])
def test_inputs_embeds_match_stock(family, with_ids):
    model = _model(family)
    ids, mask = left_pad([[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [15, 16, 17, 18, 19]])
    embeds = _embeds(model, ids)
    kwargs = dict(inputs_embeds=embeds, attention_mask=mask, max_new_tokens=8, do_sample=False)
    if with_ids:
        kwargs["input_ids"] = ids
    expected = model.generate(**kwargs)
    assert expected.shape[1] == (ids.shape[1] if with_ids else 0) + 8  # embeddings alone: only the new tokens
    plain = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    assert not torch.equal(expected[:, -8:], plain[:, -8:])  # the embeddings matter
    for mode in MODES:
        assert torch.equal(model.generate(**kwargs, batching=mode), expected), mode


@pytest.mark.parametrize("mode", MODES)
def test_inputs_embeds_in_another_dtype_than_the_models_are_refused(mode):
    """Stock generate runs the prompt in the embeddings' dtype (its rotary tables follow them) and the
    new tokens in the model's; the engine would run both in the model's: other tokens. Refused, with
    the cast to make; cast, they match stock."""
    model = _model()
    ids, mask = left_pad([[5, 6, 7, 8, 9], [12, 13, 14]])
    embeds = _embeds(model, ids).to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"inputs_embeds are torch.bfloat16 and the model's embeddings "
                                         r"torch.float32.*inputs_embeds.to\(torch.float32\)"):
        model.generate(inputs_embeds=embeds, attention_mask=mask, max_new_tokens=4, batching=mode)
    cast = dict(inputs_embeds=embeds.float(), attention_mask=mask, max_new_tokens=4, do_sample=False)
    assert torch.equal(model.generate(**cast, batching=mode), model.generate(**cast))


@pytest.mark.parametrize("mode", MODES)
def test_embeddings_split_across_chunks_preempted_and_cached_stay_exact(mode):
    """Prompts longer than a step's token budget (chunks start and end inside the embeddings), a
    pool small enough to preempt, and a second call with other embeddings at the same placeholder
    ids: a cache keyed by token ids alone would serve the first call's pages."""
    model = _model()
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (40, 23, 37, 51)]
    ids, mask = left_pad(prompts)
    config = BatchingConfig(max_batch_tokens=16, num_pages=14, page_size=8)
    for seed in (1, 2):
        embeds = _embeds(model, ids, seed=seed)
        expected = model.generate(inputs_embeds=embeds, attention_mask=mask, max_new_tokens=12, do_sample=False)
        got = model.generate(inputs_embeds=embeds, attention_mask=mask, max_new_tokens=12, do_sample=False,
                             batching=mode, batching_config=config)
        assert torch.equal(got, expected), seed
    hf_async_cb.release(model)


def test_copies_share_their_row_embeddings_pages():
    """num_return_sequences copies hold one PromptEmbeds: they share its pages through the cache."""
    model = _model()
    ids, mask = left_pad([list(range(3, 40))])
    embeds = _embeds(model, ids)
    out = model.generate(inputs_embeds=embeds, attention_mask=mask, max_new_tokens=4, do_sample=True,
                         num_return_sequences=4, batching="sync", batching_config=BatchingConfig(seed=0))
    assert out.shape == (4, 4)
    stats = hf_async_cb.prefix_cache_stats(model)
    assert stats["hit_tokens"] == 3 * 32  # each later copy took the first one's 2 full pages
    hf_async_cb.release(model)


def test_history_reading_options_with_embeddings_alone_are_refused():
    model = _model()
    ids, mask = left_pad([[5, 6, 7]])
    with pytest.raises(ValueError, match="inputs_embeds without input_ids"):
        model.generate(inputs_embeds=_embeds(model, ids), attention_mask=mask, max_new_tokens=3,
                       repetition_penalty=1.3, batching="sync")
    assert hf_async_cb.runtime_info(model) is None  # refused before any engine was built
    with pytest.raises(ValueError, match="does not match input_ids"):
        model.generate(input_ids=ids, inputs_embeds=_embeds(model, ids)[:, 1:], max_new_tokens=3, batching="sync")
    with pytest.raises(ValueError, match=r"inputs_embeds must be a floating-point tensor \[batch, length, hidden\]"):
        model.generate(inputs_embeds=torch.zeros(1, 3), max_new_tokens=3, batching="sync")


def test_engine_requests_with_embeddings_and_their_checks():
    model = _model()
    ids = [5, 6, 7, 8, 9, 10]
    with torch.no_grad():
        plain = model.get_input_embeddings()(torch.tensor(ids))
    engine = Engine(model, BatchingConfig(mode="sync"))
    try:
        same = engine.make_request(ids, SamplingParams(max_new_tokens=6), embeds=PromptEmbeds(plain[2:4], [2, 3]))
        base = engine.make_request(ids, SamplingParams(max_new_tokens=6))
        moved = engine.make_request(ids, SamplingParams(max_new_tokens=6),
                                    embeds=PromptEmbeds(plain[2:4] + 1.0, [2, 3]))
        engine.run([same, base, moved])
        assert same.output_token_ids == base.output_token_ids  # its own embeddings: the tokens' ones
        assert moved.output_token_ids != base.output_token_ids
        with pytest.raises(ValueError, match="width 5"):
            engine.make_request(ids, SamplingParams(), embeds=PromptEmbeds(torch.zeros(1, 5), [0]))
        with pytest.raises(ValueError, match=r"lie in \[0, 6\)"):
            engine.make_request(ids, SamplingParams(), embeds=PromptEmbeds(plain[:1], [6]))
    finally:
        engine.close()


def test_a_model_whose_forward_does_more_with_ids_is_refused_by_name():
    model = _model()
    forward = model.forward

    def doubled(input_ids=None, inputs_embeds=None, **kwargs):
        if input_ids is not None:  # a forward that treats ids and embeddings differently
            inputs_embeds, input_ids = model.get_input_embeddings()(input_ids) * 2, None
        return forward(input_ids=input_ids, inputs_embeds=inputs_embeds, **kwargs)

    model.forward = doubled
    ids, mask = left_pad([[5, 6, 7]])
    with pytest.raises(ValueError, match="computes more from input_ids than get_input_embeddings"):
        model.generate(inputs_embeds=_embeds(model, ids), attention_mask=mask, max_new_tokens=3, batching="sync",
                       batching_config=BatchingConfig(trust_untested_model=True))


def test_prompt_embeds_arithmetic():
    values = torch.arange(12.0).view(3, 4)
    e = PromptEmbeds(values, [2, 3, 7])
    assert (e.first, e.end) == (2, 8)
    assert e.feeds(0, 3) and e.feeds(7, 9) and not e.feeds(0, 2) and not e.feeds(8, 20)
    rel, vals = e.slice(3, 8)
    assert rel.tolist() == [0, 4] and torch.equal(vals, values[1:])
    assert e.page_salt(0, 2) is None and e.page_salt(4, 7) is None
    assert e.page_salt(0, 4) == e.page_salt(6, 8) != PromptEmbeds(values, [2, 3, 7]).page_salt(0, 4)
    assert PromptEmbeds(values, [2, 3, 7], key=b"x").page_salt(0, 4) == (b"x",)
    with pytest.raises(ValueError, match="strictly increasing"):
        PromptEmbeds(values, [2, 2, 7])
    # Multimodal rotary positions: rows differ over [1, 3); generated tokens shifted by the delta.
    rope = np.array([[0, 1, 1, 3, 4], [0, 1, 2, 3, 4], [0, 2, 1, 3, 4]])
    r = PromptEmbeds(values[:2], [1, 2], rope=rope, rope_delta=-1)
    assert (r.rope_first, r.rope_end) == (1, 3)
    assert r.rope_positions(3, 7, 5).tolist() == [[3, 4, 4, 5]] * 3
    assert r.page_salt(3, 5) is not None  # after the rows departed from the plain positions
    shifted = PromptEmbeds(values[:1], [0], key=b"v", rope=np.array([[0, 3, 4]]), rope_delta=2)
    unshifted = PromptEmbeds(values[:1], [0], key=b"v")
    assert shifted.page_salt(0, 1) == unshifted.page_salt(0, 1)  # position 0: the same K/V either way
    assert shifted.page_salt(0, 2) != unshifted.page_salt(0, 2)


def test_steps_feeding_embeddings_never_take_a_graph():
    graphs = DecodeGraphs(None, 8, is_cuda=False, prefill=True)
    plain = Request([3] * 5, SamplingParams())
    embedded = Request([3] * 5, SamplingParams(), embeds=PromptEmbeds(torch.zeros(1, 4), [4]))
    decode = StepPlan([ScheduledChunk(plain, 4, 1, True), ScheduledChunk(embedded, 4, 1, True)], [])
    assert decode.embedded == [1] and graphs.key_for(decode) is None
    after = Request([3] * 5, SamplingParams(), embeds=PromptEmbeds(torch.zeros(1, 4), [2]))
    later = StepPlan([ScheduledChunk(plain, 4, 1, True), ScheduledChunk(after, 4, 1, True)], [])
    assert later.embedded == [] and graphs.key_for(later) is not None


def test_chunks_never_end_inside_a_bidirectional_block():
    """Positions 3-6 see each other (an image), 9-10 too: a chunk ends before a block or after it,
    the nearest end before the budget's when there is one after the chunk's start, else the block's end."""
    visible = np.arange(12)
    visible[3:7], visible[9:11] = 6, 10
    e = PromptEmbeds(torch.zeros(4, 2), [3, 4, 5, 6], visible=visible)
    assert e.sees_ahead == (3, 11) and e.visible_from[3:7].tolist() == [3] * 4 and e.visible_from[7] == 7
    ends = {(0, 5): 3, (0, 3): 3, (0, 7): 7, (4, 5): 7, (0, 10): 9, (8, 10): 9, (0, 12): 12, (10, 11): 11}
    assert {k: e.chunk_end(*k) for k in ends} == ends
    assert e.feeds(7, 10) and not e.feeds(11, 12)  # (the second block sees ahead too: an eager chunk)
    assert e.feeds(10, 11)  # (a block's last token alone still sees its whole block, whatever the window)


@pytest.mark.parametrize("mode", MODES)
def test_online_requests_take_embeddings(mode):
    """add_request(..., embeds=...) on a started engine gives what stock generate gives for them."""
    model = _model()
    ids, mask = left_pad([[5, 6, 7, 8, 9, 10, 11], [12, 13, 14, 15]])
    embeds = _embeds(model, ids)
    expected = model.generate(inputs_embeds=embeds, attention_mask=mask, max_new_tokens=6, do_sample=False)
    engine = Engine(model, BatchingConfig(mode=mode))
    engine.start()
    try:
        handles = [engine.add_request([0] * int(keep.sum()), max_new_tokens=6, eos_token_ids=(),
                                      embeds=PromptEmbeds(row[keep.bool()], np.arange(int(keep.sum()))))
                   for row, keep in zip(embeds, mask)]
        assert [h.result(timeout=60).output_token_ids for h in handles] == expected.tolist()
    finally:
        engine.shutdown()
        engine.close()


def test_a_content_key_does_not_depend_on_what_it_is_named_with():
    """The same embeddings keep their key whatever else a call names beside them (a longer or wider
    row), so a later call's image finds the pages and tower outputs of an earlier one."""
    from hf_async_cb.engine.prompt_embeds import content_keys

    g = torch.Generator().manual_seed(0)
    image = torch.randn(5, 8, generator=g)
    alone = content_keys([image])[0]
    assert content_keys([torch.randn(3000, 1500, generator=g), image])[1] == alone
    assert content_keys([image.clone()])[0] == alone
    changed = image.clone()
    changed[4, 7] += 1e-6
    others = {content_keys([x])[0] for x in (changed, image.half(), image.reshape(8, 5), image[:4])}
    assert alone not in others and len(others) == 4


def test_the_embeddings_check_runs_at_the_first_call_that_feeds_embeddings(monkeypatch):
    """Its two forwards are not part of a text-only first call; a call with inputs_embeds checks
    once, and an Engine about to serve checks before its loop holds the model."""
    from hf_async_cb.model import prepared

    checked = []
    check = prepared.embeddings_refusal
    monkeypatch.setattr(prepared, "embeddings_refusal", lambda model: checked.append(1) or check(model))
    model = _model()
    ids, mask = left_pad([[5, 6, 7], [8, 9]])
    kwargs = dict(attention_mask=mask, max_new_tokens=3, do_sample=False)
    model.generate(ids, batching="sync", **kwargs)
    assert checked == []
    for _ in range(2):
        got = model.generate(inputs_embeds=_embeds(model, ids), batching="async", **kwargs)
        assert torch.equal(got, model.generate(inputs_embeds=_embeds(model, ids), **kwargs))
    assert checked == [1]
    hf_async_cb.release(model)
    engine = Engine(model, BatchingConfig())
    engine.start()
    try:
        assert checked == [1, 1]
        handle = engine.add_request([5, 6, 7], max_new_tokens=2, embeds=PromptEmbeds(_embeds(model, ids)[0, 1:2], [1]))
        assert len(handle.result(timeout=60).output_token_ids) == 2
    finally:
        engine.shutdown(timeout=60)
        engine.close()
