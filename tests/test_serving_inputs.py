"""What a serving loop takes from its callers as stock generate takes it, or refuses clearly: the weights
as they are when it starts again, a processor's one-row result, plain lists of processors and criteria
(stock generate is the oracle for tokens)."""

import copy

import pytest
import torch
from models import generated_rows, random_prompts, stock_generate, tiny_model
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

from hf_async_cb import BatchingConfig, Engine


def own_model(family="llama"):
    return copy.deepcopy(tiny_model(family))


def stock_row(model, prompt, new, **options):
    out = stock_generate(model, [prompt], max_new_tokens=new, eos_token_id=[], pad_token_id=0, do_sample=False,
                         **options)
    return generated_rows(out, len(prompt), pad=0, eos=())[0]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_weights_written_back_through_data_between_serving_sessions_are_not_served_stale(mode):
    """Serve with W0; write W1 through .data and clear_prefix_cache() (as the docs ask while serving);
    serve the prompt again (its pages now hold W1's K/V); shutdown; write W0 back through .data;
    start again: the prompt must get W0's tokens. Today start() compares the weights' contents with
    the fingerprint taken at the previous start() (W0's), finds them equal and keeps W1's pages."""
    model = own_model()
    w0 = {n: p.detach().clone() for n, p in model.named_parameters()}
    prompt = random_prompts(1, 48, 48, seed=5)[0]
    expected = stock_row(model, prompt, 8)
    engine = Engine(model, BatchingConfig(mode=mode))
    try:
        engine.start()
        assert engine.add_request(prompt, max_new_tokens=8, eos_token_ids=()).result(timeout=30).output_token_ids \
            == expected
        g = torch.Generator().manual_seed(1)
        for p in model.parameters():
            p.data.add_(torch.randn(p.shape, generator=g) * 0.2)
        engine.clear_prefix_cache()
        engine.add_request(prompt, max_new_tokens=8, eos_token_ids=()).result(timeout=30)
        engine.shutdown(timeout=30)
        for n, p in model.named_parameters():
            p.data.copy_(w0[n])
        engine.start()
        again = engine.add_request(prompt, max_new_tokens=8, eos_token_ids=()).result(timeout=30).output_token_ids
        engine.shutdown(timeout=30)
    finally:
        engine.shutdown(cancel=True, timeout=30)
        engine.close()
    assert again == expected


class _RowScores(LogitsProcessor):
    """Returns the scores as a 1-D row (vocab,) for its batch of one: stock's argmax(-1) reads it as is."""

    def __call__(self, input_ids, scores):
        return scores[0].clone()


class _TwoRows(LogitsProcessor):
    def __call__(self, input_ids, scores):
        return scores.expand(2, -1).clone()


def _served(model, mode, prompt, processor=None):
    """One request with `processor` (if any) then one without, on a serving loop: their handles' results,
    or the errors their results raise."""
    engine = Engine(model, BatchingConfig(mode=mode))
    engine.start()
    try:
        out = []
        for given in (processor, None):
            handle = engine.add_request(prompt, max_new_tokens=4, eos_token_ids=(), logits_processor=given)
            try:
                out.append(handle.result(timeout=30).output_token_ids)
            except RuntimeError as error:
                out.append(error)
        return out
    finally:
        engine.shutdown(cancel=True, timeout=30)
        engine.close()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_processor_returning_a_1d_row_gives_stock_tokens(mode):
    """Stock's batch of one reads a (vocab,) result as the row; the engine wrote `logits[row] = scores[0]`,
    broadcasting the first score over the row: token 0 every step."""
    model = own_model()
    prompt = random_prompts(1, 20, 20, seed=7)[0]
    expected = stock_row(model, prompt, 4, logits_processor=LogitsProcessorList([_RowScores()]))
    assert _served(model, mode, prompt, LogitsProcessorList([_RowScores()])) == [expected, stock_row(model, prompt, 4)]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_processor_returning_other_rows_fails_its_request_with_the_shape(mode):
    """Two rows for a batch of one (stock raises on it too): that request fails, naming the shape; the
    loop serves on."""
    model = own_model()
    prompt = random_prompts(1, 20, 20, seed=7)[0]
    bad, after = _served(model, mode, prompt, LogitsProcessorList([_TwoRows()]))
    assert "returned (2, 256) for a batch of one row of 256 scores" in str(bad.__cause__)
    assert after == stock_row(model, prompt, 4)


class _Ban(LogitsProcessor):
    def __call__(self, input_ids, scores):
        scores = scores.clone()
        scores[:, int(input_ids[0, -1]) % 256] = -float("inf")
        return scores


class _Never(StoppingCriteria):
    def __call__(self, input_ids, scores, **kwargs):
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("option", ["logits_processor", "stopping_criteria"])
def test_plain_lists_of_processors_are_taken_as_stock_and_model_generate_take_them(mode, option):
    """Stock generate and model.generate(batching=...) take a plain Python list; add_request takes it too (it
    queued it, and the request failed on the loop: "'list' object is not callable")."""
    model = own_model()
    prompt = random_prompts(1, 15, 15, seed=9)[0]
    item = _Ban() if option == "logits_processor" else _Never()
    expected = stock_row(model, prompt, 5, **{option: [item]})
    engine = Engine(model, BatchingConfig(mode=mode))
    engine.start()
    try:
        got = engine.add_request(prompt, max_new_tokens=5, eos_token_ids=(), **{option: [item]}).result(timeout=30)
    finally:
        engine.shutdown(cancel=True, timeout=30)
        engine.close()
    assert got.output_token_ids == expected


def test_what_is_not_a_list_of_callables_is_refused_in_the_callers_thread():
    model = own_model()
    engine = Engine(model, BatchingConfig(mode="sync"))
    engine.start()
    try:
        for option in ("logits_processor", "stopping_criteria"):
            with pytest.raises(ValueError, match=f"{option} takes"):
                engine.add_request([5, 6, 7], max_new_tokens=2, **{option: [5]})
    finally:
        engine.shutdown(cancel=True, timeout=30)
        engine.close()


@pytest.mark.parametrize("seeded", [False, True])
def test_each_serving_session_seeds_its_requests_as_documented(seeded):
    """Without BatchingConfig.seed the session's engine seed is drawn from torch's generator when its first
    sampled request arrives (torch.manual_seed before it reproduces the session; a session that samples
    nothing draws nothing); with it, each session numbers its requests from 0, so sessions repeat."""
    model = own_model()
    prompt = random_prompts(1, 10, 10, seed=3)[0]
    engine = Engine(model, BatchingConfig(mode="async", seed=11 if seeded else None))

    def session(sampled: bool = True):
        engine.start()
        try:
            if not sampled:
                return engine.add_request(prompt, max_new_tokens=3, eos_token_ids=()).result(timeout=30)
            return [engine.add_request(prompt, max_new_tokens=8, do_sample=True, temperature=2.0,
                                       eos_token_ids=()).result(timeout=30).output_token_ids for _ in range(2)]
        finally:
            engine.shutdown(timeout=30)

    try:
        torch.manual_seed(1234)
        first = session()
        assert first[0] != first[1]  # (two requests: two indices, two seeds)
        torch.manual_seed(1234)
        assert session() == first
        torch.manual_seed(7)
        expected = torch.rand(3)
        torch.manual_seed(7)
        session(sampled=False)
        assert torch.equal(torch.rand(3), expected)  # greedy only: torch's generator untouched
    finally:
        engine.close()
