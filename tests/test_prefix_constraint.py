"""`generate(prefix_allowed_tokens_fn=...)` (constrained decoding) against stock generate: each row
keeps only the tokens `fn(batch_id, sent)` allows, with stock's batch ids (copies of a prompt
included, as the installed transformers numbers them), its padded rows, its error for an empty
list, and its forcing where every allowed token was already banned."""

from __future__ import annotations

import pytest
import torch
from models import left_pad, random_prompts, tiny_model

MODES = ["sync", "async"]
PROMPTS = random_prompts(4, 3, 12, seed=21)
VOCAB = 256


def allowed(batch_id: int, sent: torch.Tensor) -> list[int]:
    """Five tokens that follow from the row's number and its last token."""
    return [(batch_id * 37 + int(sent[-1]) * 3 + k * 11) % VOCAB for k in range(5)]


def generate(model, mode=None, **kwargs):
    ids, mask = left_pad(PROMPTS)
    if mode is not None:
        kwargs["batching"] = mode
    kwargs.setdefault("do_sample", False)
    return model.generate(ids, attention_mask=mask, max_new_tokens=6, pad_token_id=0, **kwargs)


@pytest.mark.parametrize("mode", MODES)
def test_each_row_keeps_the_tokens_its_batch_id_allows(mode):
    model = tiny_model("llama")
    seen = []

    def fn(batch_id, sent):
        seen.append(batch_id)
        return allowed(batch_id, sent)

    expected = generate(model, prefix_allowed_tokens_fn=allowed)
    got = generate(model, mode, prefix_allowed_tokens_fn=fn)
    assert torch.equal(got, expected)
    assert set(seen) == set(range(len(PROMPTS)))
    width = got.shape[1] - 6
    for b, row in enumerate(got.tolist()):  # (the oracle's own semantics, checked too)
        for t in range(width, len(row)):
            assert row[t] in allowed(b, torch.tensor(row[:t]))


@pytest.mark.parametrize("mode", MODES)
def test_copies_of_a_prompt_get_stocks_batch_ids(mode):
    """num_return_sequences=2 (top_k=1: each copy's draw is its argmax, so stock's RNG plays no
    part): transformers numbers the copies' rows by row or by prompt, depending on its version."""
    model = tiny_model("llama")
    options = dict(prefix_allowed_tokens_fn=allowed, do_sample=True, top_k=1, num_return_sequences=2)
    expected = generate(model, **options)
    assert torch.equal(generate(model, mode, **options), expected)


@pytest.mark.parametrize("mode", MODES)
def test_an_empty_list_raises_stocks_error_and_a_row_with_every_allowed_token_banned_is_forced(mode):
    model = tiny_model("llama")

    def empty(batch_id, sent):
        return [] if batch_id == 2 else allowed(batch_id, sent)

    with pytest.raises(ValueError, match="empty list for batch ID 2"):
        generate(model, prefix_allowed_tokens_fn=empty)
    with pytest.raises(ValueError, match="empty list for batch ID 2"):
        generate(model, mode, prefix_allowed_tokens_fn=empty)

    def narrow(batch_id, sent):
        return [5, 6] if batch_id == 1 else allowed(batch_id, sent)

    options = dict(prefix_allowed_tokens_fn=narrow, bad_words_ids=[[5], [6]])  # row 1: nothing left
    expected = generate(model, **options)
    assert torch.equal(generate(model, mode, **options), expected)


@pytest.mark.parametrize("mode", MODES)
def test_a_constraint_that_runs_the_model_gives_stock_tokens(mode):
    """Allowed: the model's own top five on the row's last two tokens (callback forwards: the
    engine hands the function the stock model)."""
    model = tiny_model("llama")

    def top_five(batch_id, sent):
        return model(sent[None, -2:]).logits[0, -1].topk(5).indices.tolist()

    assert torch.equal(generate(model, mode, prefix_allowed_tokens_fn=top_five),
                       generate(model, prefix_allowed_tokens_fn=top_five))


@pytest.mark.parametrize("mode", MODES)
def test_a_prefix_constraint_processor_of_the_callers_gives_stock_tokens(mode):
    """Stock's PrefixConstrainedLogitsProcessor passed in `logits_processor`: bound per row to its batch id."""
    from transformers import LogitsProcessorList
    from transformers.generation.logits_process import PrefixConstrainedLogitsProcessor

    model = tiny_model("llama")
    given = LogitsProcessorList([PrefixConstrainedLogitsProcessor(allowed, 1)])
    assert torch.equal(generate(model, mode, logits_processor=given), generate(model, logits_processor=given))
