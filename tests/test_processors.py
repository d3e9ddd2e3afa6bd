"""Logits processors and stopping criteria: every option behaves as in stock generate (greedy: the
same tokens), in sync and async, with the carried-over token in the history; those the engine runs
on the device (repetition_penalty, no_repeat_ngram_size, bad_words_ids, sequence_bias,
min_new_tokens / min_length, suppress_tokens, begin_suppress_tokens) without the slow path, also
under chunked prefill and preemption; the others on the slow path (stock's own objects)."""

import pytest
import torch
from models import left_pad, random_prompts, stock_generate, tiny_model
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

from hf_async_cb import BatchingConfig, Engine, SamplingParams

MODES = ("sync", "async")
# Roomy, and tight: prompts prefilled in chunks of 8 tokens by requests that preempt each other.
CONFIGS = (dict(page_size=4, max_batch_tokens=32), dict(page_size=4, max_batch_tokens=8, num_pages=16))


def both(model, prompts, mode, **kwargs):
    ids, mask = left_pad(prompts)
    expected = model.generate(ids, attention_mask=mask, batching="off", **kwargs)
    got = model.generate(ids, attention_mask=mask, batching=mode,
                         batching_config=BatchingConfig(page_size=4, max_batch_tokens=32), **kwargs)
    return got, expected


def on_the_device(monkeypatch, prompts, model=None, **kwargs):
    """generate() in every mode and CONFIGS against stock, none of them on the slow path (the
    options run on the device); returns stock's output. Graph buckets are on (their CPU
    stand-in); the tight configuration must really preempt."""
    from hf_async_cb.generate import stock_options

    slow, preempted = [], []
    monkeypatch.setattr(stock_options, "_warn_once", lambda message: slow.append(message))
    run = Engine.run

    def counting_run(self, requests, mode=None, **kwargs):
        run(self, requests, mode, **kwargs)
        preempted.append(sum(r.num_preemptions for r in requests))

    monkeypatch.setattr(Engine, "run", counting_run)
    model = model or tiny_model("llama")
    ids, mask = left_pad(prompts)
    expected = model.generate(ids, attention_mask=mask, batching="off", **kwargs)
    for mode in MODES:
        for config in CONFIGS:
            got = model.generate(ids, attention_mask=mask, batching=mode, **kwargs,
                                 batching_config=BatchingConfig(**config, cuda_graphs=True))
            assert torch.equal(got, expected), (mode, config)
            if "num_pages" in config:
                assert preempted[-1] > 0, "the tight pool should have preempted"
    assert not slow, slow
    return expected


@pytest.fixture(scope="module")
def eos_candidates():
    """Tokens the tiny Llama generates early, to make min_new_tokens and EOS matter."""
    model = tiny_model("llama")
    prompts = random_prompts(6, 2, 30, seed=31)
    rows = stock_generate(model, prompts, max_new_tokens=12, eos_token_id=None)[:, max(map(len, prompts)):]
    return rows[0, 1].item(), rows[2, 3].item()


# Options stock turns into processors the engine does not run natively: they take the slow path.
SLOW_OPTIONS = {
    "forced_eos_token_id": dict(forced_eos_token_id=3, max_new_tokens=6),
    "exponential_decay": dict(exponential_decay_length_penalty=(3, 1.5), eos_token_id=4),
    "typical_p": dict(do_sample=True, typical_p=0.9, top_k=1),  # top_k=1 leaves no choice: stock's tokens
    "with_device_options": dict(forced_eos_token_id=3, repetition_penalty=1.3, no_repeat_ngram_size=2,
                                bad_words_ids=[[5], [7, 8]], sequence_bias={(9,): 5.0}),
    # Read each row's padded prompt (stock hands a decoder-only model's prompts to them as the "encoder" ids).
    "encoder_repetition_penalty": dict(encoder_repetition_penalty=3.0),
    "encoder_hallucination_penalty": dict(encoder_repetition_penalty=0.2),
    "encoder_no_repeat_ngram_size": dict(encoder_no_repeat_ngram_size=1),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("option", list(SLOW_OPTIONS))
def test_slow_path_options_match_stock(option, mode):
    model = tiny_model("llama")
    prompts = random_prompts(6, 2, 30, seed=31)
    kwargs = {"max_new_tokens": 12, **SLOW_OPTIONS[option]}
    got, expected = both(model, prompts, mode, **kwargs)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("mode", MODES)
def test_prompt_reading_processors_of_the_callers_own_read_each_rows_prompt(mode):
    # Built by the caller for the whole batch (one prompt row each), as stock builds them: each request
    # reads its own row's prompt, greedy as stock; sampled copies read their prompt's row.
    from transformers.generation.logits_process import (
        EncoderNoRepeatNGramLogitsProcessor,
        EncoderRepetitionPenaltyLogitsProcessor,
    )

    model = tiny_model("llama")
    prompts = random_prompts(5, 3, 20, seed=37)
    ids, mask = left_pad(prompts)

    def processors():
        return LogitsProcessorList([EncoderRepetitionPenaltyLogitsProcessor(2.5, ids),
                                    EncoderNoRepeatNGramLogitsProcessor(2, ids)])

    expected = model.generate(ids, attention_mask=mask, max_new_tokens=10, logits_processor=processors())
    got = model.generate(ids, attention_mask=mask, max_new_tokens=10, logits_processor=processors(), batching=mode)
    assert torch.equal(got, expected)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=True, num_return_sequences=2,
                         encoder_no_repeat_ngram_size=1, batching=mode)
    width = ids.shape[1]
    for row in range(out.shape[0]):  # no generated token appears in the row's own prompt
        prompt = set(ids[row // 2][mask[row // 2].bool()].tolist())
        assert not prompt & set(out[row, width:].tolist()), row


@pytest.mark.parametrize("mode", MODES)
def test_min_new_tokens_holds_eos_back(mode, eos_candidates):
    model = tiny_model("llama")
    prompts = random_prompts(6, 2, 30, seed=31)
    eos = list(eos_candidates)
    got, expected = both(model, prompts, mode, max_new_tokens=12, eos_token_id=eos, pad_token_id=0, min_new_tokens=5)
    assert torch.equal(got, expected)
    plain, _ = both(model, prompts, mode, max_new_tokens=12, eos_token_id=eos, pad_token_id=0)
    assert not torch.equal(plain, got), "min_new_tokens should have changed where rows stop"


@pytest.mark.parametrize("form", ["tensor", "array", "one-element tensor of id 0"])
def test_suppressed_tokens_given_as_tensors_or_arrays_are_suppressed(form, monkeypatch):
    """suppress_tokens / begin_suppress_tokens as a tensor or a numpy array, as stock takes them: a
    tensor's truth value crashed on several ids and read tensor([0]) as no ids at all (token 0 then
    not suppressed: other tokens than stock's). Token 0 is made the greedy pick for the last case."""
    import copy

    import numpy as np

    model = copy.deepcopy(tiny_model("llama"))
    prompts = random_prompts(6, 2, 30, seed=11)  # (long enough for the tight pool to preempt)
    ids, mask = left_pad(prompts)
    first = model.generate(ids, attention_mask=mask, max_new_tokens=1, do_sample=False, batching="off")[:, -1]
    with torch.no_grad():  # token 0's logit just above each row's first pick
        model.lm_head.weight[0] = model.lm_head.weight[first[0]] * 1.05
    tokens = {"tensor": torch.tensor([int(first[1]), 0]), "array": np.array([int(first[2]), 0]),
              "one-element tensor of id 0": torch.tensor([0])}[form]
    for option in ("suppress_tokens", "begin_suppress_tokens"):
        plain = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, batching="off")
        expected = on_the_device(monkeypatch, prompts, model=model, max_new_tokens=12, do_sample=False,
                                 **{option: tokens})
        assert not torch.equal(plain, expected)  # the option matters here


def test_an_empty_bad_word_bans_nothing_as_in_stock(monkeypatch):
    """bad_words_ids=[[5], [7, 8], []]: stock runs it (the empty entry bans nothing); it was refused.
    (transformers 5.17's own processor raises IndexError on the empty entry: there the engine's tokens
    are those of the entries without it, as newer versions give.)"""
    prompts = random_prompts(6, 2, 30, seed=31)
    without = on_the_device(monkeypatch, prompts, max_new_tokens=12, bad_words_ids=[[5], [7, 8]])
    ids, mask = left_pad(prompts)
    try:
        tiny_model("llama").generate(ids, attention_mask=mask, batching="off", max_new_tokens=12,
                                     bad_words_ids=[[5], [7, 8], []])
    except IndexError:
        for mode in MODES:
            got = tiny_model("llama").generate(ids, attention_mask=mask, batching=mode, max_new_tokens=12,
                                               bad_words_ids=[[5], [7, 8], []])
            assert torch.equal(got, without), mode
        return
    with_empty = on_the_device(monkeypatch, prompts, max_new_tokens=12, bad_words_ids=[[5], [7, 8], []])
    assert torch.equal(with_empty, without)


class EvenOnly(LogitsProcessor):
    """A user processor that depends on the history: after an odd token, only even tokens."""

    def __call__(self, input_ids, scores):
        odd_last = (input_ids[:, -1] % 2 == 1)[:, None]
        odd_vocab = (torch.arange(scores.shape[-1], device=scores.device) % 2 == 1)[None]
        return scores.masked_fill(odd_last & odd_vocab, float("-inf"))


@pytest.mark.parametrize("mode", MODES)
def test_user_logits_processor_sees_the_full_history(mode):
    model = tiny_model("qwen3")
    prompts = random_prompts(5, 3, 20, seed=32)
    got, expected = both(model, prompts, mode, max_new_tokens=10, logits_processor=LogitsProcessorList([EvenOnly()]))
    assert torch.equal(got, expected)


@pytest.mark.parametrize("mode", MODES)
def test_sampling_with_processors_runs_and_respects_them(mode):
    model = tiny_model("llama")
    prompts = random_prompts(4, 3, 10, seed=33)
    ids, mask = left_pad(prompts)
    out = model.generate(ids, attention_mask=mask, batching=mode, max_new_tokens=10, do_sample=True, top_k=20,
                         min_p=0.05, suppress_tokens=list(range(0, 128)), batching_config=BatchingConfig(seed=0))
    assert (out[:, ids.shape[1]:] >= 128).all()


class StopAfterToken(StoppingCriteria):
    def __init__(self, token):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


@pytest.mark.parametrize("mode", MODES)
def test_user_stopping_criteria_stop_where_stock_does(mode, eos_candidates):
    model = tiny_model("llama")
    prompts = random_prompts(6, 2, 30, seed=31)
    criteria = StoppingCriteriaList([StopAfterToken(eos_candidates[0])])
    got, expected = both(model, prompts, mode, max_new_tokens=12, pad_token_id=0, stopping_criteria=criteria)
    assert torch.equal(got, expected)


class LongerThan(MaxLengthCriteria):
    """A subclass: stock keeps its own MaxLengthCriteria beside it and applies both."""


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", ["shorter", "longer", "subclass", "eos", "eos and min_new_tokens"])
def test_callers_length_and_eos_criteria_replace_stocks_as_in_stock(case, mode, eos_candidates):
    """The caller's own MaxLengthCriteria / EosTokenCriteria take the place of stock's (shorter or
    longer than max_new_tokens, other EOS ids, beside min_new_tokens); a subclass runs beside them.
    None is dropped: the rows stop where stock's do."""
    model = tiny_model("llama")
    prompts = random_prompts(6, 2, 30, seed=31)  # (eos_candidates' prompts)
    width = max(map(len, prompts))
    eos = eos_candidates[0]
    options = dict(pad_token_id=0, max_new_tokens=8, eos_token_id=eos_candidates[1])
    if case == "shorter":
        criteria = [MaxLengthCriteria(max_length=width + 3)]
    elif case == "longer":  # stock's own max_length is dropped: the caller's is the only bound
        criteria = [MaxLengthCriteria(max_length=width + 14)]
    elif case == "subclass":
        criteria = [LongerThan(max_length=width + 5)]
    else:
        criteria = [EosTokenCriteria(eos_token_id=eos)]
        if case == "eos and min_new_tokens":
            options["min_new_tokens"] = 4
    got, expected = both(model, prompts, mode, stopping_criteria=StoppingCriteriaList(criteria), **options)
    assert torch.equal(got, expected)
    if case in ("shorter", "longer", "subclass"):
        assert expected.shape[1] == width + {"shorter": 3, "longer": 14, "subclass": 5}[case]
    else:  # some row stopped on the caller's EOS, which is not the GenerationConfig's
        assert (expected[:, width:] == eos).any()


class PerRow(LogitsProcessor):
    """Forces token 10 + i on row i of the batch: stock's rows differ by their index."""

    def __call__(self, input_ids, scores):
        out = torch.full_like(scores, -float("inf"))
        out[torch.arange(len(scores)), 10 + torch.arange(len(scores))] = 0
        return out


class ForBatchOfThree(LogitsProcessor):
    """A per-row bias built for the caller's batch size (a batch of one broadcasts it)."""

    def __init__(self):
        self.bias = torch.randn(3, 256, generator=torch.Generator().manual_seed(0))

    def __call__(self, input_ids, scores):
        return scores + self.bias


class Noise(LogitsProcessor):
    """Row-independent, with noise drawn from torch's generator: rows differ by the draws only."""

    def __call__(self, input_ids, scores):
        return scores + torch.randn_like(scores)


class NaNsAndInfs(LogitsProcessor):
    """Row-independent, with NaN and -inf in every row: not a row-index processor."""

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        scores[:, :5] = float("nan")
        scores[:, 5:10] = -float("inf")
        return scores


@pytest.mark.parametrize("mode", MODES)
def test_processors_that_treat_rows_by_index_are_refused_before_any_work(mode):
    """The engine calls processors one row at a time: one that treats rows by their index, or was
    built for one batch size, would give other tokens than stock, so it is refused up front (probed
    once on copies of one row); row-independent ones, NaN and -inf included, run."""
    model = tiny_model("llama")
    prompts = random_prompts(3, 2, 9, seed=17)
    for processor in (PerRow(), ForBatchOfThree()):
        with pytest.raises(ValueError, match=f"{type(processor).__name__} treats the rows of a batch differently"):
            both(model, prompts, mode, max_new_tokens=3, logits_processor=LogitsProcessorList([processor]))
    ids, mask = left_pad(prompts[:1])  # a batch of one: nothing to tell apart, and stock's tokens
    one = LogitsProcessorList([PerRow()])
    assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=3, logits_processor=one, batching=mode),
                       model.generate(ids, attention_mask=mask, max_new_tokens=3, logits_processor=one, batching="off"))
    got, expected = both(model, prompts, mode, max_new_tokens=3, logits_processor=LogitsProcessorList([NaNsAndInfs()]))
    assert torch.equal(got, expected)
    # Random noise is sampling, not indexing: it runs (its tokens cannot be stock's draws), and the
    # probe leaves the caller's random stream where it was.
    ids, mask = left_pad(prompts)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=3, logits_processor=LogitsProcessorList([Noise()]),
                         batching=mode)
    assert out.shape == (3, ids.shape[1] + 3)
    from hf_async_cb.generate.row_checks import check_rows_alike

    state = torch.random.get_rng_state()
    assert check_rows_alike([Noise()], [], ids, 3, 256) == set()  # (random: not checked per call either)
    assert torch.equal(torch.random.get_rng_state(), state)


class StepCounter(LogitsProcessor):
    """Keeps a step count: stock calls it once per step for the batch."""

    def __init__(self):
        self.step = 0

    def __call__(self, input_ids, scores):
        self.step += 1
        scores = scores.clone()
        scores[:, 10 + self.step % 5] += 1000.0
        return scores


class RowZeroLater(LogitsProcessor):
    """Treats row 0 apart only once rows are longer than `length` (after the probe on the prompt)."""

    def __init__(self, length):
        self.length = length

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        if input_ids.shape[1] > self.length:
            scores[0, 9] += 1000.0
        return scores


class LazyBias(LogitsProcessor):
    """Sets itself up on its first call (as stock's SequenceBiasLogitsProcessor does): not state kept
    from call to call."""

    def __call__(self, input_ids, scores):
        if not hasattr(self, "bias"):
            self.bias = torch.zeros(scores.shape[-1])
            self.bias[7] = 3.0
        return scores + self.bias


class StopRowZeroLater(StoppingCriteria):
    def __init__(self, length):
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool)
        done[0] = input_ids.shape[1] > self.length
        return done


class StopForBatchOfThree(StoppingCriteria):
    def __call__(self, input_ids, scores, **kwargs):
        return torch.tensor([False, True, False]) & (input_ids.shape[1] > 0)


class StopAfterCalls(StoppingCriteria):
    def __init__(self, calls):
        self.calls, self.seen = calls, 0

    def __call__(self, input_ids, scores, **kwargs):
        self.seen += 1
        return torch.full((input_ids.shape[0],), self.seen >= self.calls)


class ReturnsNothing(LogitsProcessor):
    def __call__(self, input_ids, scores):
        scores[:, 3] = 0.0


class AnyRowHit(StoppingCriteria):  # the pre-4.39 form: one verdict for the whole batch
    def __init__(self, token: int, as_tensor: bool) -> None:
        self.token, self.as_tensor = token, as_tensor

    def __call__(self, input_ids, scores, **kwargs):
        hit = (input_ids[:, -1] == self.token).any()
        return hit if self.as_tensor else bool(hit)


@pytest.mark.parametrize("as_tensor", [False, True], ids=["bool", "0-d tensor"])
@pytest.mark.parametrize("mode", MODES)
def test_a_criterion_with_one_verdict_for_the_batch_is_refused_and_runs_for_one_row(mode, as_tensor):
    """Stock applies a criterion's single bool (or 0-d tensor) to every row: the whole batch stops at
    once. The engine checks each row on its own, so with several rows it would stop only the row
    that met it (other tokens, silently): refused before any work. With one row it is that row's
    verdict, and runs as in stock."""
    model = tiny_model("llama")
    prompts = random_prompts(3, 4, 9, seed=21)
    ids, mask = left_pad(prompts)
    stock = model.generate(ids, attention_mask=mask, max_new_tokens=12, batching="off", pad_token_id=0,
                           eos_token_id=1)
    token = int(stock[0, ids.shape[1] + 3])  # a token row 0 takes: stock then stops all rows
    criteria = StoppingCriteriaList([AnyRowHit(token, as_tensor)])
    with pytest.raises(ValueError, match="one value for a batch of 3 rows"):
        model.generate(ids, attention_mask=mask, max_new_tokens=12, batching=mode, pad_token_id=0, eos_token_id=1,
                       stopping_criteria=criteria)
    one, one_mask = left_pad(prompts[:1])
    expected = model.generate(one, attention_mask=one_mask, max_new_tokens=12, batching="off", pad_token_id=0,
                              eos_token_id=1, stopping_criteria=criteria)
    got = model.generate(one, attention_mask=one_mask, max_new_tokens=12, batching=mode, pad_token_id=0,
                         eos_token_id=1, stopping_criteria=criteria)
    assert torch.equal(got, expected) and got.shape[1] < one.shape[1] + 12


@pytest.mark.parametrize("mode", MODES)
def test_processors_and_criteria_with_state_or_late_row_logic_fail_clearly(mode):
    """The engine calls the caller's processors and criteria one row at a time (generate/row_checks.py):
    one that keeps state from call to call, is built for a batch size, or treats rows by their index
    from some length on, would silently give other tokens or stop other rows than stock; each is
    refused before any work (the probe leaving its state as it was) or, where the row logic starts
    later, fails the call with the reason. One that sets itself up once runs, exact; with one row,
    all of them run as in stock."""
    model = tiny_model("llama")
    prompts = random_prompts(3, 4, 9, seed=17)
    width = max(map(len, prompts))
    refused_up_front = [(dict(logits_processor=LogitsProcessorList([StepCounter()])), "keeps state"),
                        (dict(stopping_criteria=StoppingCriteriaList([StopAfterCalls(4)])), "keeps state"),
                        (dict(stopping_criteria=StoppingCriteriaList([StopForBatchOfThree()])), "treats the rows"),
                        (dict(logits_processor=LogitsProcessorList([ReturnsNothing()])), "returned None")]
    ids, mask = left_pad(prompts)

    def ours(**options):
        return model.generate(ids, attention_mask=mask, max_new_tokens=5, batching=mode, pad_token_id=0,
                              eos_token_id=1, **options)

    for options, message in refused_up_front:
        with pytest.raises(ValueError, match=message):
            ours(**options)
    counter = StepCounter()
    with pytest.raises(ValueError, match="keeps state"):
        ours(logits_processor=LogitsProcessorList([counter]))
    assert counter.step == 0 and vars(counter) == {"step": 0}  # the probe left it as it was
    later = [dict(logits_processor=LogitsProcessorList([RowZeroLater(width + 1)])),
             dict(stopping_criteria=StoppingCriteriaList([StopRowZeroLater(width + 1)]))]
    for options in later:
        with pytest.raises(ValueError, match="treated two copies of one row differently"):
            ours(**options)
    got, expected = both(model, prompts, mode, max_new_tokens=5, logits_processor=LogitsProcessorList([LazyBias()]))
    assert torch.equal(got, expected)
    ids, mask = left_pad(prompts[:1])
    for make in (lambda: dict(logits_processor=LogitsProcessorList([StepCounter()])),
                 lambda: dict(logits_processor=LogitsProcessorList([RowZeroLater(len(prompts[0]) + 1)])),
                 lambda: dict(stopping_criteria=StoppingCriteriaList([StopAfterCalls(3)]), pad_token_id=0)):
        expected = model.generate(ids, attention_mask=mask, max_new_tokens=5, batching="off", **make())
        got = model.generate(ids, attention_mask=mask, max_new_tokens=5, batching=mode, **make())
        assert torch.equal(got, expected)


_CALLS = 0  # a module global a processor below counts its calls in


def _counts_in_a_global(input_ids, scores):
    global _CALLS
    _CALLS += 1
    return scores if _CALLS <= 3 else scores.index_fill(1, torch.tensor([5, 7]), float("-inf"))


class _Holder:
    def __init__(self):
        self.calls = 0

    def ban_later(self, input_ids, scores):
        self.calls += 1
        return scores if self.calls <= 3 else scores.index_fill(1, torch.tensor([5, 7]), float("-inf"))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("where", ["closure", "global", "bound method's object"])
def test_processors_keeping_state_outside_their_attributes_are_refused_and_left_as_they_were(where, mode):
    """A plain function counting its calls in a closure or a module global, or a bound method counting
    in its object: stock calls it once per step, the engine once per row per step (its bans then fall
    on other steps: other tokens, silently). Refused before any work, its state left as it was; with
    one row it runs as in stock."""
    global _CALLS
    model = tiny_model("llama")
    ids, mask = left_pad(random_prompts(3, 4, 9, seed=17))

    def closure():
        step = [0]

        def ban_later(input_ids, scores):
            step[0] += 1
            return scores if step[0] <= 3 else scores.index_fill(1, torch.tensor([5, 7]), float("-inf"))

        return ban_later, lambda: step[0]

    holder = _Holder()
    processor, count = {"closure": closure(), "global": (_counts_in_a_global, lambda: _CALLS),
                        "bound method's object": (holder.ban_later, lambda: holder.calls)}[where]
    _CALLS = 0
    with pytest.raises(ValueError, match="keeps state from call to call"):
        model.generate(ids, attention_mask=mask, max_new_tokens=5, batching=mode,
                       logits_processor=LogitsProcessorList([processor]))
    assert count() == 0
    one, one_mask = ids[:1], mask[:1]
    expected = model.generate(one, attention_mask=one_mask, max_new_tokens=6, batching="off",
                              logits_processor=LogitsProcessorList([processor]))
    calls = count()
    _CALLS, holder.calls = 0, 0
    if where == "closure":
        processor, count = closure()
    got = model.generate(one, attention_mask=one_mask, max_new_tokens=6, batching=mode,
                         logits_processor=LogitsProcessorList([processor]))
    assert torch.equal(got, expected) and count() == calls


def test_engine_api_takes_processors_and_criteria():
    model = tiny_model("gpt2")
    prompts = random_prompts(3, 2, 8, seed=34)
    engine = Engine(model, BatchingConfig(mode="async"))
    outs = engine.generate(prompts, max_new_tokens=8, logits_processor=LogitsProcessorList([EvenOnly()]),
                           stopping_criteria=StoppingCriteriaList([StopAfterToken(40)]))
    for o in outs:
        history = o.prompt_token_ids + o.output_token_ids
        for prev, tok in zip(history[len(o.prompt_token_ids) - 1:], o.output_token_ids):
            assert not (prev % 2 == 1 and tok % 2 == 1)
        assert 40 not in o.output_token_ids[:-1]
        if o.output_token_ids[-1] == 40 and len(o.output_token_ids) < 8:
            assert o.finish_reason.value == "stop"


@pytest.mark.parametrize("mode", MODES)
def test_max_time_zero_stops_after_one_token_like_stock(mode):
    model = tiny_model("llama")
    prompts = random_prompts(4, 2, 10, seed=35)
    got, expected = both(model, prompts, mode, max_new_tokens=12, max_time=0.0, pad_token_id=0)
    assert expected.shape[1] == max(map(len, prompts)) + 1
    assert torch.equal(got, expected)


@pytest.fixture(scope="module")
def plain_rows():
    """Stock's greedy tokens for the device-option tests' prompts, without any option: keys and
    bad words are cut from them, so that the options really change the tokens."""
    prompts = random_prompts(6, 2, 30, seed=33)
    rows = stock_generate(tiny_model("llama"), prompts, max_new_tokens=16)[:, max(map(len, prompts)):]
    return prompts, rows


def _history_options(rows):
    a, b, c, d = rows[0, 3].item(), rows[0, 4].item(), rows[1, 2].item(), rows[2, 6].item()
    e, f = rows[3, 1].item(), rows[3, 2].item()
    return {
        "penalty_0.7": dict(repetition_penalty=0.7),
        "penalty_1.3": dict(repetition_penalty=1.3),
        "penalty_3.0": dict(repetition_penalty=3.0),
        "ngram_1": dict(no_repeat_ngram_size=1),
        "ngram_2": dict(no_repeat_ngram_size=2),
        "ngram_3": dict(no_repeat_ngram_size=3),
        "bad_words": dict(bad_words_ids=[[c], [a, b], [e, f, 100]]),
        "bias_single": dict(sequence_bias={(c,): -20.0, (d,): 2.5}),
        "bias_multi": dict(sequence_bias={(a, b): -30.0, (e, f): -30.0, (e, 77): 40.0, (d, c, a): 3.0}),
        "everything": dict(repetition_penalty=1.2, no_repeat_ngram_size=3, bad_words_ids=[[a, b], [d]],
                           sequence_bias={(e, f): -30.0, (c,): 1.5}, suppress_tokens=[7, 8], min_new_tokens=4),
    }


@pytest.mark.parametrize("name", list(_history_options(torch.zeros(4, 16, dtype=torch.long))))
def test_history_options_run_on_the_device(name, plain_rows, monkeypatch):
    """Each option on the device for all requests at once (no slow path), on each row's history as
    stock holds it (left padding included where the installed transformers reads it), the
    carried-over token too, through chunked prefill and preemption: stock's tokens."""
    prompts, rows = plain_rows
    option = _history_options(rows)[name]
    expected = on_the_device(monkeypatch, prompts, max_new_tokens=16, eos_token_id=2, pad_token_id=0, **option)
    assert not torch.equal(expected[:, -rows.shape[1]:], rows), "the option should change the tokens"


def test_left_padding_is_part_of_the_row_for_ngrams_and_keys(monkeypatch):
    """Stock's n-grams and keys run over the padded row: with the pad token pushed by a bias, a row
    that generated it may not continue with what followed its padding. The engine reads the
    padding too (on the device), so it gets stock's tokens, which differ from each prompt alone."""
    prompts = random_prompts(5, 3, 12, seed=36)
    options = dict(max_new_tokens=10, pad_token_id=0, eos_token_id=None, no_repeat_ngram_size=2,
                   sequence_bias={(0,): 60.0, (0, 0): -5.0})
    expected = on_the_device(monkeypatch, prompts, **options)
    width = max(map(len, prompts))
    alone = [stock_generate(tiny_model("llama"), [p], **options)[0, len(p):] for p in prompts]
    assert any(not torch.equal(expected[i, width:], alone[i]) for i in range(len(prompts)) if len(prompts[i]) < width)


def test_user_processors_of_native_kinds_run_as_given():
    """A processor object passed in logits_processor= is run as given (slow path), even of a kind
    the engine runs natively from the config."""
    from transformers.generation.logits_process import NoRepeatNGramLogitsProcessor, RepetitionPenaltyLogitsProcessor

    model = tiny_model("llama")
    prompts = random_prompts(6, 2, 30, seed=33)
    processors = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(2.0), NoRepeatNGramLogitsProcessor(2)])
    for mode in MODES:
        got, expected = both(model, prompts, mode, max_new_tokens=12, logits_processor=processors)
        assert torch.equal(got, expected)
    plain = stock_generate(model, prompts, max_new_tokens=12)
    assert not torch.equal(expected, plain)


@pytest.mark.parametrize("mode", MODES)
def test_per_request_history_options_in_one_batch(mode, plain_rows):
    """Requests with different options (and none) share steps, in a pool small enough to preempt and
    with prompts prefilled in chunks; each gets stock's tokens for its prompt alone."""
    model = tiny_model("qwen3")
    prompts = random_prompts(8, 2, 40, seed=34)
    options = list(_history_options(plain_rows[1]).values())[:7] + [{}]
    engine = Engine(model, BatchingConfig(mode=mode, page_size=4, num_pages=40, max_batch_tokens=24))
    params = []
    for option in options:
        option = dict(option)
        option.pop("suppress_tokens", None), option.pop("min_new_tokens", None)
        params.append(SamplingParams(max_new_tokens=12, eos_token_ids=(), **option))
    outs = engine.generate(prompts, params)
    for prompt, param, out in zip(prompts, params, outs):
        stock = model.generate(torch.tensor([prompt]), max_new_tokens=12, eos_token_id=None, batching="off",
                               repetition_penalty=param.repetition_penalty,
                               no_repeat_ngram_size=param.no_repeat_ngram_size,
                               bad_words_ids=[list(w) for w in param.bad_words_ids] or None,
                               sequence_bias=dict(param.sequence_bias) or None)
        assert out.output_token_ids == stock[0, len(prompt):].tolist()
    assert sum(o.num_preemptions for o in outs) > 0
    assert engine.allocator.num_free == engine.allocator.num_pages


def test_copies_sharing_prompt_pages_read_their_own_history(monkeypatch):
    """num_return_sequences: the copies read the first copy's prompt pages from the token pool.
    top_k=1 sampling leaves no choice, so stock's tokens are the oracle."""
    prompts = random_prompts(3, 9, 30, seed=37)
    on_the_device(monkeypatch, prompts, max_new_tokens=12, do_sample=True, top_k=1, num_return_sequences=2,
                  repetition_penalty=1.5, no_repeat_ngram_size=2)


def test_history_option_ids_outside_the_vocabulary_are_a_clear_error():
    engine = Engine(tiny_model("llama"), BatchingConfig())
    for option in (dict(bad_words_ids=[[3, 10_000]]), dict(sequence_bias={(10_000,): 1.0})):
        name = next(iter(option))
        with pytest.raises(ValueError, match=name):
            engine.generate([[3, 4]], SamplingParams(**option))
    assert engine.allocator.num_free == engine.allocator.num_pages


@pytest.mark.parametrize("option", [dict(min_new_tokens=5), dict(min_length=38), dict(min_new_tokens=3, min_length=40)])
def test_min_length_options_run_on_the_device(option, eos_candidates, monkeypatch):
    """min_new_tokens / min_length with several EOS ids, on the device (no slow path), in graph
    buckets too: stock's tokens, and they do change where rows stop."""
    common = dict(max_new_tokens=12, eos_token_id=list(eos_candidates), pad_token_id=0)
    prompts = random_prompts(6, 2, 30, seed=31)
    expected = on_the_device(monkeypatch, prompts, **common, **option)
    plain = on_the_device(monkeypatch, prompts, **common)
    assert not torch.equal(plain, expected), "the option should change where rows stop"


def test_per_request_min_new_tokens_in_one_batch(eos_candidates):
    from hf_async_cb import SamplingParams

    model = tiny_model("llama")
    prompts = random_prompts(6, 2, 30, seed=31)
    mins = [0, 3, 7, 0, 11, 5]
    eos = tuple(eos_candidates)
    engine = Engine(model, BatchingConfig(mode="async", page_size=4, max_batch_tokens=32, cuda_graphs=True))
    outs = engine.generate(prompts, [SamplingParams(max_new_tokens=12, min_new_tokens=m, eos_token_ids=eos)
                                     for m in mins])
    for prompt, m, out in zip(prompts, mins, outs):
        stock = model.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=m or None,
                               eos_token_id=list(eos), pad_token_id=0, batching="off")[0, len(prompt):].tolist()
        if eos[0] in stock or eos[1] in stock:
            stock = stock[: min(stock.index(t) for t in eos if t in stock) + 1]
        assert out.output_token_ids == stock
        assert not any(t in eos for t in out.output_token_ids[:m])


@pytest.mark.parametrize("option", [
    dict(suppress_tokens=list(range(10, 60)) + [100_000]),  # an id outside the vocabulary is ignored, as stock
    dict(begin_suppress_tokens=list(range(0, 200))),
    dict(suppress_tokens=[7, 8, 9], begin_suppress_tokens=list(range(100, 250)), min_new_tokens=4),
])
def test_suppressed_tokens_run_on_the_device(option, eos_candidates, monkeypatch):
    common = dict(max_new_tokens=10, eos_token_id=list(eos_candidates), pad_token_id=0)
    prompts = random_prompts(6, 2, 30, seed=35)
    expected = on_the_device(monkeypatch, prompts, **common, **option)
    plain = on_the_device(monkeypatch, prompts, **common)
    assert not torch.equal(plain, expected), "the option should change the tokens"


def test_suppress_tokens_outside_the_vocabulary_are_ignored_on_the_engine_as_in_generate():
    """As stock and generate() do (docs/api.md); the engine once refused them."""
    from hf_async_cb import SamplingParams

    engine = Engine(tiny_model("llama"), BatchingConfig())
    got = engine.generate([[3, 4]], SamplingParams(suppress_tokens=(5, 10_000), max_new_tokens=6, eos_token_ids=()))
    expected = engine.generate([[3, 4]], SamplingParams(suppress_tokens=(5,), max_new_tokens=6, eos_token_ids=()))
    assert got[0].output_token_ids == expected[0].output_token_ids
    assert engine.allocator.num_free == engine.allocator.num_pages


@pytest.mark.parametrize("mode", MODES)
def test_top_p_edges_run_as_stock_runs_them(mode):
    """top_p=0 (stock's warper keeps the top token) and top_p above 1 (stock adds no warper) run as
    in stock; a negative one is an error in both."""
    model = tiny_model("llama")
    prompts = random_prompts(3, 2, 9, seed=17)
    for options in (dict(do_sample=True, top_p=0.0), dict(do_sample=True, top_p=1.5, top_k=1),
                    dict(do_sample=False, top_p=1.5)):
        got, expected = both(model, prompts, mode, max_new_tokens=4, **options)
        assert torch.equal(got, expected), options
    ids, mask = left_pad(prompts)
    for batching in ("off", mode):
        with pytest.raises(ValueError, match="top_p"):
            model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=True, top_p=-0.5, batching=batching)


def test_ngram_sizes_past_the_history_ban_nothing_as_stock(plain_rows, monkeypatch):
    """no_repeat_ngram_size longer than any row's history (here past the step's history width, 64
    and more) bans nothing, as stock; and in the online loop it fails no one, the option's request
    nor the one sharing its steps."""
    prompts, _ = plain_rows
    unbanned = stock_generate(tiny_model("llama"), prompts, max_new_tokens=16, eos_token_id=2, pad_token_id=0)
    for n in (40, 70, 200):
        expected = on_the_device(monkeypatch, prompts, max_new_tokens=16, eos_token_id=2, pad_token_id=0,
                                 no_repeat_ngram_size=n)
        assert torch.equal(expected, unbanned)
    engine = Engine(tiny_model("llama"), BatchingConfig(mode="async"))
    engine.start()
    plain = engine.add_request(prompts[0], max_new_tokens=12)
    long_ngram = engine.add_request(prompts[1], max_new_tokens=12, no_repeat_ngram_size=100)
    assert plain.result(timeout=60).finish_reason is not None and long_ngram.result(timeout=60).finish_reason is not None
    engine.shutdown()
