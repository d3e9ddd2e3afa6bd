"""The device token pool and the history processors read from it, against stock's processors.

Each case builds a real step (BatchBuilder, block table, carry-over placeholders left out) over
requests whose histories (prefix + prompt) are drawn from a tiny vocabulary, so that tokens,
n-grams and keys repeat a lot, fills the pool as earlier steps would have, applies the step's
HistoryProcessors to random logits, and compares them, exactly, with stock's processor objects
applied row by row to the row's full history, in stock generate's order.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    NoBadWordsLogitsProcessor,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from hf_async_cb.devices import Streams
from hf_async_cb.engine.batch import BatchBuilder
from hf_async_cb.engine.io_slots import IOSlot
from hf_async_cb.engine.page_table import PageTable
from hf_async_cb.engine.requests import Request, SamplingParams
from hf_async_cb.engine.step_plan import ScheduledChunk, StepPlan
from hf_async_cb.sampling.token_history import TokenHistory

PAGE = 4
CPU = torch.device("cpu")


def _random_params(rng: random.Random, vocab: int) -> dict:
    def sequence():
        return tuple(rng.randrange(vocab) for _ in range(rng.choice([1, 1, 2, 3, 4])))

    options = {}
    if rng.random() < 0.6:
        options["repetition_penalty"] = rng.choice([0.5, 0.9, 1.3, 2.5])
    if rng.random() < 0.6:
        options["no_repeat_ngram_size"] = rng.choice([1, 2, 2, 3, 4, 6])
    if rng.random() < 0.5:
        options["bad_words_ids"] = tuple({sequence() for _ in range(rng.randrange(1, 6))})
    if rng.random() < 0.5:
        options["sequence_bias"] = {sequence(): rng.choice([-4.0, -0.5, 0.25, 3.0]) for _ in range(rng.randrange(1, 7))}
    return options


def _stock(options: dict, penalty_start: int) -> LogitsProcessorList:
    """Stock's processors for these options, in the order generate builds them."""
    processors = LogitsProcessorList()
    if "sequence_bias" in options:
        processors.append(SequenceBiasLogitsProcessor(dict(options["sequence_bias"])))
    if options.get("repetition_penalty", 1.0) != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(options["repetition_penalty"],
                                                           prompt_ignore_length=penalty_start or None))
    if options.get("no_repeat_ngram_size"):
        processors.append(NoRepeatNGramLogitsProcessor(options["no_repeat_ngram_size"]))
    if "bad_words_ids" in options:
        processors.append(NoBadWordsLogitsProcessor([list(w) for w in options["bad_words_ids"]]))
    return processors


def _step(requests: list[Request], prefill: set[int], num_pages: int):
    """One step over `requests` (those in `prefill` feed their whole prompt, the others their last
    token), the pool holding what earlier steps wrote; returns (inputs, pool)."""
    next_page, chunks, table = 0, [], PageTable()
    for i, req in enumerate(requests):
        n = len(req.prompt_token_ids)
        req.pages = list(range(next_page, next_page + -(-n // PAGE)))
        table.sync(req, req.pages)
        next_page += len(req.pages)
        start = 0 if i in prefill else n - 1
        chunks.append(ScheduledChunk(req, start=start, num_tokens=n - start, samples=True))
    assert next_page <= num_pages
    builder = BatchBuilder(PAGE, trash_slot=num_pages * PAGE, page_table=table)
    inputs = builder.build(StepPlan(chunks, []), IOSlot(Streams(CPU)), {})
    pool = TokenHistory((num_pages + 1) * PAGE, CPU)
    for i, req in enumerate(requests):  # what the steps before this one wrote
        known = chunks[i].start
        positions = torch.arange(known)
        slots = torch.tensor(req.pages)[positions // PAGE] * PAGE + positions % PAGE
        pool.tokens[slots] = torch.tensor(req.prompt_token_ids[:known], dtype=torch.long)
    pool.record(inputs.meta.slot_mapping, inputs.input_ids[0])
    return inputs, pool


@pytest.mark.parametrize("case", range(40))
def test_history_processors_equal_stock_on_random_histories(case):
    rng = random.Random(case)
    vocab = rng.choice([3, 5, 8, 16])
    rows, requests, prefill = [], [], set()
    for i in range(rng.randrange(1, 9)):
        options = _random_params(rng, vocab) or {"no_repeat_ngram_size": 2}
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
        prefix = [rng.choice([0, rng.randrange(vocab)]) for _ in range(rng.choice([0, 0, 1, 3, 7]))]
        penalty_start = rng.choice([0, len(prefix)])
        req = Request(prompt, SamplingParams(**options), history_prefix=prefix, penalty_start=penalty_start)
        if rng.random() < 0.3:
            prefill.add(i)
        requests.append(req)
        rows.append((options, prefix + prompt, penalty_start))
    inputs, pool = _step(requests, prefill, num_pages=256)
    assert inputs.processors is not None
    logits = torch.randn(len(requests), vocab, generator=torch.Generator().manual_seed(case)) * 3
    logits[:, 0] = 0.0  # zero scores take the dividing branch of the penalty
    got = logits.clone()
    inputs.processors.apply(got, pool, inputs.meta)
    for row, (options, history, penalty_start) in enumerate(rows):
        expected = _stock(options, penalty_start)(torch.tensor([history]), logits[row : row + 1].clone())[0]
        assert torch.equal(got[row], expected), (row, options, history)


@pytest.mark.parametrize("history", [[3], [3, 4], [3, 4, 5], [1, 3, 4, 5]])
def test_keys_as_long_as_the_history(history):
    """A key whose prefix is the whole history: newer transformers apply it, 5.17 waits for one
    token more; the engine does what the installed one does (bias and bad words alike)."""
    keys = [(3, 4), (3, 4, 5), (3, 4, 5, 6), (4, 5, 6), (5, 6)]
    options = [dict(sequence_bias={k: 2.0 + i for i, k in enumerate(keys)}),
               dict(bad_words_ids=tuple(keys), no_repeat_ngram_size=len(history))]
    requests = [Request(list(history), SamplingParams(**o)) for o in options]
    inputs, pool = _step(requests, set(), num_pages=8)
    logits = torch.randn(2, 8, generator=torch.Generator().manual_seed(len(history)))
    got = logits.clone()
    inputs.processors.apply(got, pool, inputs.meta)
    for row, o in enumerate(options):
        expected = _stock(o, 0)(torch.tensor([history]), logits[row : row + 1].clone())[0]
        assert torch.equal(got[row], expected), o


def test_rows_without_options_are_left_alone_and_only_they_are_read():
    """A step mixes rows with and without history options: the others keep their logits bit for bit."""
    plain = Request([1, 2, 3], SamplingParams())
    banned = Request([4, 5, 4, 5, 4], SamplingParams(no_repeat_ngram_size=2))
    inputs, pool = _step([plain, banned], set(), num_pages=8)
    logits = torch.randn(2, 8)
    got = logits.clone()
    inputs.processors.apply(got, pool, inputs.meta)
    assert inputs.processors.sample_rows.tolist() == [1]
    assert torch.equal(got[0], logits[0])
    assert got[1, 5] == float("-inf") and torch.isfinite(got[1, [0, 1, 2, 3, 4, 6, 7]]).all()


def test_pool_follows_the_slots_of_a_step():
    pool = TokenHistory(12, CPU)
    pool.record(torch.tensor([5, 2, 9]), torch.tensor([11, 12, 13]))
    assert pool.tokens[[5, 2, 9]].tolist() == [11, 12, 13]
    assert pool.tokens.sum() == 36


@pytest.mark.parametrize("value", [
    dict(bad_words_ids=[[]]), dict(bad_words_ids=[[1, -2]]), dict(bad_words_ids=["ab"]),
    dict(sequence_bias={(): 1.0}), dict(sequence_bias=[[[1], "x"]]), dict(no_repeat_ngram_size=-1),
    dict(no_repeat_ngram_size=True),
])
def test_invalid_history_options_are_refused(value):
    with pytest.raises(ValueError):
        SamplingParams(**value)


def test_history_options_are_normalised():
    p = SamplingParams(bad_words_ids=[[3], [4, 5], [3]], sequence_bias=[[[1, 2], 2], [[7], -1.5]])
    assert p.bad_words_ids == ((3,), (4, 5))
    assert p.sequence_bias == (((1, 2), 2.0), ((7,), -1.5))
    assert SamplingParams(sequence_bias={(1, 2): 2.0}).sequence_bias == p.sequence_bias[:1]
    hash(p)  # still a frozen, hashable value


def test_the_kept_history_tensor_is_the_history_as_tokens_arrive():
    """Request.history_tensor (what stopping criteria and the slow path's processors read) equals
    history() after every token, through the buffer's growth; a view handed out keeps its length
    and values while later tokens arrive; the prompt part is converted once, not per token."""
    req = Request([5, 6, 7], SamplingParams(max_new_tokens=200), history_prefix=[0, 0])
    views = []
    for token in range(100, 190):
        req.append_token(token)
        got = req.history_tensor()
        assert got.dtype == torch.long and got.tolist() == req.history()
        views.append((got, req.history()))
    assert req._history.numel() >= 95  # grown past its first size
    for view, expected in views:  # earlier views are unchanged by later tokens and growth
        assert view.tolist() == expected
    assert req.history_tensor(4).tolist() == [0, 0, 5, 6]
    with pytest.raises(ValueError):
        req.history_tensor(len(req.history()) + 1)


def test_a_stopping_criterion_reads_the_kept_history(monkeypatch):
    """append_token hands a criterion the row as stock holds it, and builds no tensor of the whole
    history per token (the O(length) cost it had)."""
    seen = []

    class Criterion:
        def __call__(self, input_ids, scores):
            seen.append(input_ids.clone())
            return torch.zeros(1, dtype=torch.bool)

    req = Request(list(range(3, 1003)), SamplingParams(max_new_tokens=50), stopping_criteria=Criterion())
    built = []
    real = torch.tensor
    def counted(data, *args, **kwargs):
        out = real(data, *args, **kwargs)
        built.append(out.numel())
        return out

    monkeypatch.setattr(torch, "tensor", counted)
    for token in range(40):
        req.append_token(token)
    assert [s[0].tolist() for s in seen][-1] == req.history() and len(seen) == 40
    assert all(s.shape == (1, 1000 + i + 1) for i, s in enumerate(seen))
    assert sum(built) < 1000 + 40 * 2  # the prompt once, then the new tokens only
