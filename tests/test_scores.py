"""output_scores / output_logits with return_dict_in_generate: stock's values, stock's shapes."""

import math

import pytest
import torch
from models import left_pad, random_prompts, stock_generate, tiny_model


def run(model, prompts, mode, **kwargs):
    ids, mask = left_pad(prompts)
    return model.generate(ids, attention_mask=mask, batching=mode, return_dict_in_generate=True,
                          output_scores=True, output_logits=True, **kwargs)


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("extra", [{}, {"repetition_penalty": 1.4}])
def test_greedy_scores_and_logits_match_stock(mode, extra):
    model = tiny_model("llama")
    prompts = random_prompts(4, 3, 20, seed=81)
    first = stock_generate(model, prompts, max_new_tokens=10, eos_token_id=None)[:, max(map(len, prompts)):]
    kwargs = dict(max_new_tokens=10, eos_token_id=first[1, 3].item(), pad_token_id=0, **extra)
    expected, got = run(model, prompts, "off", **kwargs), run(model, prompts, mode, **kwargs)
    assert torch.equal(got.sequences, expected.sequences)
    assert len(got.scores) == len(expected.scores) and len(got.logits) == len(expected.logits)
    width = expected.sequences.shape[1] - len(expected.scores)
    for t, (ours, theirs, our_raw, their_raw) in enumerate(zip(got.scores, expected.scores, got.logits,
                                                               expected.logits)):
        assert ours.shape == theirs.shape
        for row in range(len(prompts)):
            done_before = (expected.sequences[row, width:width + t] == kwargs["eos_token_id"]).any()
            if done_before:
                assert torch.isnan(ours[row]).all()
            else:
                torch.testing.assert_close(ours[row], theirs[row], rtol=1e-4, atol=1e-4)
                torch.testing.assert_close(our_raw[row], their_raw[row], rtol=1e-4, atol=1e-4)


def test_sampled_scores_are_the_warped_distribution():
    model = tiny_model("qwen2")
    prompts = random_prompts(3, 3, 10, seed=82)
    out = run(model, prompts, "async", max_new_tokens=6, do_sample=True, top_k=5, temperature=0.7)
    for step in out.scores:
        finite = torch.isfinite(step)
        assert (finite.sum(-1) <= 5).all() and (finite.sum(-1) >= 1).all()
    for step, raw in zip(out.scores, out.logits):
        kept = torch.isfinite(step)
        torch.testing.assert_close(step[kept], (raw / 0.7)[kept])
    assert math.isfinite(out.logits[0].sum().item())
