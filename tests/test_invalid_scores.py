"""Scores with no distribution (NaN, +inf, or every token at -inf) in a sampled row: stock generate
raises ("probability tensor contains either `inf`, `nan` or element < 0"); the draw marks the row
with INVALID_TOKEN, on the device and without a sync, in the torch sampler and in the kernels alike,
and the host refuses the request when it reads it. Greedy rows take the argmax, as stock does."""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from hf_async_cb.engine.requests import SamplingParams
from hf_async_cb.kernels.draw_sampled import sampled_packed
from hf_async_cb.sampling.sampler import (
    INVALID_TOKEN,
    InvalidScoresError,
    SamplingTensors,
    invalid_scores_error,
    sample,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # the interpreter without CUDA
VOCAB = 300
NAN, INF = float("nan"), float("inf")
NEG_NAN = torch.tensor(0.0) / 0  # x86's default NaN has the sign bit set: its score key sorts below -inf


def _rows() -> tuple[torch.Tensor, list[dict], list[bool]]:
    """Logits, each row's sampling options, and whether stock would refuse the row."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(12, VOCAB, generator=g) * 3
    options: list[dict] = []
    refused: list[bool] = []

    def row(i: int, refuse: bool, **o) -> None:
        options.append(o)
        refused.append(refuse)

    logits[0, 7] = NAN
    row(0, True)
    logits[1, 250] = NEG_NAN
    row(1, True, top_k=5)  # a NaN that a filter would drop still poisons stock's softmax
    logits[2] = -INF
    row(2, True, top_p=0.9)
    logits[3, 11] = INF
    row(3, True, temperature=0.7)
    logits[4, 20:] = -INF  # a few finite tokens: a distribution
    row(4, False, top_k=3)
    row(5, False, top_p=0.8, min_p=0.05)
    logits[6, [9, 40]] = NAN
    row(6, False, do_sample=False)  # greedy: the first NaN, as torch.argmax
    logits[7] = -INF
    row(7, False, do_sample=False)  # greedy: token 0
    logits[8, [30, 31]] = INF
    row(8, False, do_sample=False)  # greedy: the first +inf
    logits[9, 3] = NEG_NAN
    row(9, False, do_sample=False, top_k=2)
    logits[10, 100] = NAN
    row(10, True, top_k=50, top_p=0.95, min_p=0.1)
    row(11, False, temperature=1.3, top_k=20)
    return logits, options, refused


def _params(options: list[dict]) -> SamplingTensors:
    params = [SamplingParams(max_new_tokens=4, seed=10 + i, **{"do_sample": True, **o}) for i, o in enumerate(options)]
    return SamplingTensors.build(params, DEVICE, token_index=list(range(len(options))))


def _stock_refuses(scores: torch.Tensor, o: dict) -> bool:
    """Stock's warpers, softmax and multinomial on one row."""
    for warper in (TemperatureLogitsWarper(o.get("temperature", 1.0)), TopKLogitsWarper(o.get("top_k", 0) or VOCAB),
                   TopPLogitsWarper(o.get("top_p", 1.0))):
        scores = warper(None, scores)
    try:
        torch.multinomial(scores.softmax(dim=-1), 1)
    except RuntimeError as error:
        assert "probability tensor contains" in str(error)
        return True
    return False


def test_the_refused_rows_are_those_stock_refuses():
    logits, options, refused = _rows()
    for r, o in enumerate(options):
        if o.get("do_sample", True) and "min_p" not in o:
            assert _stock_refuses(logits[r : r + 1].clone(), o) is refused[r], r


@pytest.mark.parametrize("seeded", [True, False])
def test_torch_sampler_marks_rows_without_a_distribution(seeded):
    logits, options, refused = _rows()
    params = _params(options)
    if not seeded:
        params.seed.fill_(-1)
        params.unseeded = True
    tokens, logprobs = sample(logits.to(DEVICE), params, torch.Generator(DEVICE).manual_seed(0))
    tokens, logprobs = tokens.cpu(), logprobs.cpu()
    for r, bad in enumerate(refused):
        assert (int(tokens[r]) == INVALID_TOKEN) is bad, r
        if bad:
            assert logprobs[r].isnan()
    greedy = logits.argmax(dim=-1)
    assert tokens[[6, 7, 8, 9]].tolist() == greedy[[6, 7, 8, 9]].tolist() == [9, 0, 30, 3]
    assert int(tokens[4]) < 20 and logprobs[[4, 5, 11]].isfinite().all()
    # The valid rows draw what they draw without their batch mates.
    for r in (4, 5, 11):
        alone = sample(logits[r : r + 1].to(DEVICE), params.rows([r]), torch.Generator(DEVICE).manual_seed(0))[0]
        if seeded:
            assert int(alone) == int(tokens[r])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_mark_the_same_rows_and_pick_the_same_greedy_tokens(dtype):
    logits, options, refused = _rows()
    logits = logits.to(dtype).to(DEVICE)
    params = _params(options)
    got = sampled_packed(logits, params).cpu()
    tokens, logprobs = sample(logits.float(), params)
    assert got[0].tolist() == tokens.cpu().tolist()
    assert [int(t) == INVALID_TOKEN for t in got[0]] == refused
    got_logprobs = got[1].view(torch.float64)
    assert torch.equal(got_logprobs.isnan(), logprobs.cpu().isnan())
    finite = ~got_logprobs.isnan()
    torch.testing.assert_close(got_logprobs[finite], logprobs.cpu().double()[finite], rtol=1e-5, atol=1e-5)


def test_the_host_error_names_the_request_and_reads_as_stock():
    error = invalid_scores_error("req-7", 3)
    assert isinstance(error, RuntimeError) and isinstance(error, InvalidScoresError)
    assert "req-7" in str(error) and "output token 3" in str(error) and "probability tensor contains" in str(error)


class NanAtStep(LogitsProcessor):
    """NaN scores for batch row `row` once the sequence is `length` tokens long."""

    def __init__(self, row: int, length: int) -> None:
        self.row, self.length = row, length

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if input_ids.shape[0] > 1 and input_ids.shape[1] == self.length:  # stock: the whole batch at once
            scores[self.row, 5] = NAN
        return scores


class PerRow(LogitsProcessor):
    """The engine runs a user processor once per request: this one poisons the request of prompt `prompt`."""

    def __init__(self, prompt: list[int], length: int) -> None:
        self.prompt, self.length = prompt, length

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        for r in range(input_ids.shape[0]):
            if input_ids[r, : len(self.prompt)].tolist() == self.prompt and input_ids.shape[1] == self.length:
                scores[r, 5] = NAN
        return scores


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_greedy_nan_scores_give_stock_tokens(mode):
    from tests.models import left_pad, tiny_model

    model = tiny_model("llama")
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12]]
    ids, mask = left_pad(prompts)
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, batching="off",
                              logits_processor=LogitsProcessorList([NanAtStep(1, 6)]))
    got = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, batching=mode,
                         logits_processor=LogitsProcessorList([PerRow(prompts[1], 6)]))
    assert torch.equal(got, expected) and int(got[1, 6]) == 5


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_sampled_nan_scores_fail_the_request_as_stock_does(mode):
    """Also: the async loop carries the marked token into the next step without an index error."""
    from tests.models import left_pad, tiny_model

    model = tiny_model("llama")
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12]]
    ids, mask = left_pad(prompts)
    with pytest.raises(RuntimeError, match="probability tensor contains"):
        model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=True, batching="off",
                       logits_processor=LogitsProcessorList([NanAtStep(1, 6)]))
    with pytest.raises(InvalidScoresError, match="req-.*output token 2"):
        model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=True, batching=mode,
                       logits_processor=LogitsProcessorList([PerRow(prompts[1], 6)]))
