"""Stopping criteria get the scores stock hands them: the tuple of the steps' processed scores when
return_dict_in_generate and output_scores, else None (stock generate is the oracle)."""

import pytest
import torch
from models import left_pad, random_prompts, tiny_model
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.generation.stopping_criteria import ConfidenceCriteria

MODES = ("sync", "async")


class StopAfterThreeScores(StoppingCriteria):
    """Reads the `scores` stock passes to its criteria: the tuple of the steps' processed scores
    (when return_dict_in_generate and output_scores), else None."""

    def __call__(self, input_ids, scores, **kwargs):
        stop = scores is not None and len(scores) >= 3
        return torch.full((input_ids.shape[0],), stop, dtype=torch.bool, device=input_ids.device)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("rows", [1, 3])
def test_stopping_criteria_receive_the_scores_stock_passes(mode, rows):
    model = tiny_model("llama")
    ids, mask = left_pad(random_prompts(rows, 2, 10, seed=6))
    kwargs = dict(max_new_tokens=10, pad_token_id=0, output_scores=True, return_dict_in_generate=True,
                  stopping_criteria=StoppingCriteriaList([StopAfterThreeScores()]))
    expected = model.generate(ids, attention_mask=mask, **kwargs)
    assert expected.sequences.shape[1] == ids.shape[1] + 3  # stock stops once three steps are scored
    got = model.generate(ids, attention_mask=mask, batching=mode, **kwargs)
    assert torch.equal(got.sequences, expected.sequences)


@pytest.mark.parametrize("mode", MODES)
def test_transformers_confidence_criteria_runs_as_in_stock(mode):
    """transformers' own ConfidenceCriteria reads scores[-1]: stock runs it (with output_scores);
    the engine called it with scores=None (a TypeError from inside the criterion)."""
    model = tiny_model("llama")
    ids, mask = left_pad(random_prompts(1, 2, 10, seed=6))
    kwargs = dict(max_new_tokens=6, output_scores=True, return_dict_in_generate=True,
                  stopping_criteria=StoppingCriteriaList([ConfidenceCriteria(assistant_confidence_threshold=0.9)]))
    expected = model.generate(ids, attention_mask=mask, **kwargs)
    got = model.generate(ids, attention_mask=mask, batching=mode, **kwargs)
    assert torch.equal(got.sequences, expected.sequences)


@pytest.mark.parametrize("mode", MODES)
def test_a_criterion_deciding_for_the_whole_batch_is_refused_by_name(mode):
    """ConfidenceCriteria returns one bool for the batch (from row 0's scores): stock stops every row
    on it; the engine, checking rows one at a time, cannot: refused with the reason, scores given."""
    model = tiny_model("llama")
    ids, mask = left_pad(random_prompts(3, 2, 10, seed=6))
    kwargs = dict(max_new_tokens=6, output_scores=True, return_dict_in_generate=True,
                  stopping_criteria=StoppingCriteriaList([ConfidenceCriteria(assistant_confidence_threshold=0.9)]))
    model.generate(ids, attention_mask=mask, **kwargs)  # (stock runs it)
    with pytest.raises(ValueError, match="ConfidenceCriteria returned one value for a batch of 3 rows"):
        model.generate(ids, attention_mask=mask, batching=mode, **kwargs)


@pytest.mark.parametrize("mode", MODES)
def test_criteria_get_no_scores_where_stock_gives_none(mode):
    """Without return_dict_in_generate (or output_scores) stock hands its criteria scores=None."""
    seen = []

    class Records(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            seen.append(scores)
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    model = tiny_model("llama")
    ids, mask = left_pad(random_prompts(2, 2, 10, seed=6))
    for options in (dict(output_scores=True), dict(return_dict_in_generate=True)):
        expected = model.generate(ids, attention_mask=mask, max_new_tokens=4,
                                  stopping_criteria=StoppingCriteriaList([Records()]), **options)
        assert seen and all(s is None for s in seen)
        seen.clear()
        got = model.generate(ids, attention_mask=mask, max_new_tokens=4, batching=mode,
                             stopping_criteria=StoppingCriteriaList([Records()]), **options)
        assert seen and all(s is None for s in seen)
        seen.clear()
        sequences = got.sequences if hasattr(got, "sequences") else got
        assert torch.equal(sequences, expected.sequences if hasattr(expected, "sequences") else expected)
