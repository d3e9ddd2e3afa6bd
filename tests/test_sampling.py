"""Tests for hf_async_cb.sampling.sampler: greedy rows are exact argmax, sampled rows follow stock transformers.

The reference for a sampled row is stock transformers' warper chain, applied in the order that
``generate`` applies it (TemperatureLogitsWarper -> TopKLogitsWarper -> TopPLogitsWarper), followed by a
softmax.  ``sample`` is checked against that exact distribution statistically (total-variation distance
of many seeded draws), and on its support (no token outside it is ever drawn; every token that carries
non-negligible mass is drawn).
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from hf_async_cb.engine.requests import SamplingParams
from hf_async_cb.sampling.sampler import SamplingTensors
from hf_async_cb.sampling.sampler import sample as sample_with_logprobs


def sample(*args, **kwargs):
    """The sampled tokens alone."""
    return sample_with_logprobs(*args, **kwargs)[0]

CPU = torch.device("cpu")
VOCAB = 50
N_DRAWS = 30_000
# Failure probability allowed for one TV check (the draws are seeded, so the outcome is fixed; this only
# says how unlikely it is that a correct sampler would land above the bound for an arbitrary seed).
DELTA = 1e-6


# --------------------------------------------------------------------------------------------- helpers


def _tensors(params: list[SamplingParams]) -> SamplingTensors:
    tensors = SamplingTensors.build(params, CPU)
    assert tensors is not None
    return tensors


def _fixed_logits(seed: int, vocab: int = VOCAB) -> torch.Tensor:
    """A reproducible logits vector with a realistic spread (std 2: neither flat nor one-hot)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(vocab, generator=g, dtype=torch.float32) * 2.0


def _stock_target(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Exact next-token distribution of stock transformers for one logits row, float64 [V].

    top_k=0 / top_p=1.0 mean "off": generate() does not add those warpers then (and TopKLogitsWarper
    rejects 0), so neither do we.
    """
    scores = logits[None, :].clone()
    input_ids = torch.zeros((1, 1), dtype=torch.long)  # the warpers ignore it
    scores = TemperatureLogitsWarper(temperature)(input_ids, scores)
    if top_k > 0:
        scores = TopKLogitsWarper(top_k)(input_ids, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(input_ids, scores)
    return scores[0].double().softmax(dim=-1)


def _empirical(draws: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(draws, minlength=vocab).double() / draws.numel()


def _tv_bound(target: torch.Tensor, n: int, delta: float = DELTA) -> float:
    """Upper bound on TV(empirical of n i.i.d. draws, target) that holds with probability >= 1 - delta.

    TV = 1/2 * sum_i |p̂_i - p_i|.  Mean: E|p̂_i - p_i| <= sd(p̂_i) = sqrt(p_i (1 - p_i) / n) (Jensen), so
    E[TV] <= 1/2 * sum_i sqrt(p_i (1 - p_i) / n)  (<= 1/2 * sqrt(K / n) for K tokens in the support:
    0.020 for K = 50, n = 30000; much less for the peaked / truncated targets).
    Deviation: TV = sup_A |P̂(A) - P(A)| changes by at most 1/n when one draw changes, so McDiarmid gives
    P(TV >= E[TV] + t) <= exp(-2 n t^2), i.e. t = sqrt(ln(1/delta) / (2 n)) = 0.0152 for n = 30000.
    So the bound is at most ~0.036 (flat 50-token target) and typically ~0.025; a sampler that misplaces
    a few percent of the mass (a wrong warper order, a top-p cut one token off, a skipped temperature)
    lands well above it, see the sizes printed in the assertion messages.
    """
    mean = 0.5 * torch.sqrt(target * (1.0 - target) / n).sum().item()
    return mean + math.sqrt(math.log(1.0 / delta) / (2.0 * n))


def _check_distribution(draws: torch.Tensor, target: torch.Tensor, label: str) -> None:
    n = draws.numel()
    vocab = target.numel()
    assert draws.dtype == torch.long
    assert int(draws.min()) >= 0 and int(draws.max()) < vocab, label
    emp = _empirical(draws, vocab)

    # Support: nothing outside the stock support, ever.
    outside = ((emp > 0) & (target == 0)).nonzero().flatten().tolist()
    assert not outside, f"{label}: drew tokens {outside} that stock transformers filters out"

    # Every token with expected count >= 25 must show up: P(missed) <= exp(-25) ~ 1e-11 per token.  This
    # catches a filter that cuts one token too many even when that token's mass is below the TV bound.
    must_see = (target * n >= 25).nonzero().flatten()
    missing = [int(i) for i in must_see if emp[i] == 0]
    assert not missing, f"{label}: never drew tokens {missing} (target probs {target[missing].tolist()})"

    tv = 0.5 * (emp - target).abs().sum().item()
    bound = _tv_bound(target, n)
    assert tv < bound, f"{label}: total-variation distance {tv:.4f} >= bound {bound:.4f} (n={n})"


# Parameter grid of the brief: temperature x top_k x top_p, all combinations.
TEMPERATURES = (0.7, 1.3)
TOP_KS = (0, 5)
TOP_PS = (1.0, 0.8, 0.3)
GRID = list(itertools.product(TEMPERATURES, TOP_KS, TOP_PS))
LOGIT_SEEDS = (0, 1, 2)


# ---------------------------------------------------------------------------------------- greedy rows


def test_build_returns_none_without_sampled_rows_and_sample_is_argmax():
    assert SamplingTensors.build([], CPU) is None
    params = [SamplingParams(), SamplingParams(do_sample=False, temperature=0.5, top_k=3, top_p=0.5)]
    assert SamplingTensors.build(params, CPU) is None
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(3))
    out = sample(logits, None, torch.Generator().manual_seed(0))
    assert torch.equal(out, logits.argmax(dim=-1))
    assert out.dtype == torch.long


def test_build_tensors_shapes_and_values():
    params = [
        SamplingParams(do_sample=True, temperature=0.7, top_k=5, top_p=0.8),
        SamplingParams(),
    ]
    t = _tensors(params)
    assert (t.do_sample != 0).tolist() == [True, False]
    assert t.temperature.dtype == torch.float32 and t.temperature.tolist() == pytest.approx([0.7, 1.0])
    assert t.top_k.dtype == torch.long and t.top_k.tolist() == [5, 0]
    assert t.top_p.dtype == torch.float32 and t.top_p.tolist() == pytest.approx([0.8, 1.0])


def _valid_params(do_sample: bool):
    return st.builds(
        SamplingParams,
        do_sample=st.just(do_sample),
        temperature=st.sampled_from([0.3, 0.7, 1.0, 1.3, 5.0]),
        top_k=st.sampled_from([0, 1, 2, 5, 1000]),
        top_p=st.sampled_from([1.0, 0.95, 0.8, 0.3, 1e-4]),
    )


@settings(max_examples=30, deadline=None)
@given(
    rows=st.lists(
        st.booleans().flatmap(_valid_params), min_size=1, max_size=12
    ).filter(lambda ps: any(p.do_sample for p in ps) and not all(p.do_sample for p in ps)),
    vocab=st.integers(min_value=2, max_value=64),
    logit_seed=st.integers(min_value=0, max_value=2**31 - 1),
    gen_seed=st.integers(min_value=0, max_value=2**31 - 1),
)
def test_greedy_rows_are_exact_argmax_in_mixed_batch(rows, vocab, logit_seed, gen_seed):
    """Greedy rows give exactly logits.argmax, whatever the sampled rows next to them do (and whatever
    sampling parameters the greedy rows themselves carry: they must be ignored)."""
    g = torch.Generator().manual_seed(logit_seed)
    # Scale 0.1: near-flat logits, so a sampled value in place of the argmax would almost surely differ.
    logits = torch.randn(len(rows), vocab, generator=g) * 0.1
    out = sample(logits, _tensors(rows), torch.Generator().manual_seed(gen_seed))
    assert out.shape == (len(rows),) and out.dtype == torch.long
    greedy = torch.tensor([not p.do_sample for p in rows])
    assert torch.equal(out[greedy], logits.argmax(dim=-1)[greedy])
    assert bool(((out >= 0) & (out < vocab)).all())


def test_greedy_rows_argmax_many_rows_flat_logits():
    """A deterministic, larger version: 2000 greedy rows interleaved with 2000 unrestricted sampled rows
    on near-flat logits (the sampled rows pick the argmax only ~1/V of the time)."""
    g = torch.Generator().manual_seed(11)
    s = 4000
    logits = torch.randn(s, VOCAB, generator=g) * 0.05
    params = [SamplingParams(do_sample=bool(i % 2), temperature=1.0) for i in range(s)]
    out = sample(logits, _tensors(params), torch.Generator().manual_seed(5))
    greedy_rows = torch.arange(s) % 2 == 0
    assert torch.equal(out[greedy_rows], logits.argmax(dim=-1)[greedy_rows])
    # And the sampled rows really sampled (otherwise the test above proves nothing about mixing).
    agree = (out[~greedy_rows] == logits.argmax(dim=-1)[~greedy_rows]).double().mean().item()
    assert agree < 0.2


def test_greedy_row_with_zero_temperature_next_to_sampled_row():
    """SamplingParams accepts temperature=0.0 when do_sample=False (it only validates sampled rows), and
    temperature=0 is a common way to say "greedy".  Such a row must still give its argmax, and must not
    break the sampled rows in the same batch."""
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(do_sample=False, temperature=0.0), SamplingParams(do_sample=True)]
    out = sample(logits, _tensors(params), torch.Generator().manual_seed(0))
    assert int(out[0]) == int(logits[0].argmax())


# ------------------------------------------------------------------------- statistical equivalence


@pytest.mark.parametrize("case", range(len(GRID)), ids=[f"T{t}-k{k}-p{p}" for t, k, p in GRID])
def test_sampled_row_matches_stock_warpers(case):
    """Each parameter set on its own, N_DRAWS draws in one call.  The logits vectors rotate over the
    cases here; the mixed-batch test below runs every (logits, parameters) pair."""
    temperature, top_k, top_p = GRID[case]
    logit_seed = LOGIT_SEEDS[case % len(LOGIT_SEEDS)]
    logits = _fixed_logits(logit_seed)
    target = _stock_target(logits, temperature, top_k, top_p)
    params = SamplingParams(do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p)
    # One call, N_DRAWS copies of the same row: every row is an independent draw.
    tensors = _tensors([params] * N_DRAWS)
    gen = torch.Generator().manual_seed(1000 + logit_seed)
    draws = sample(logits.expand(N_DRAWS, VOCAB).contiguous(), tensors, gen)
    _check_distribution(draws, target, f"T={temperature} k={top_k} p={top_p} logits#{logit_seed}")


def test_all_parameter_sets_in_one_batch_follow_their_own_distribution():
    """The whole grid interleaved row by row in a single call (and each with its own logits vector):
    per-row parameters must not leak between rows."""
    combos = [(seed, *c) for seed in LOGIT_SEEDS for c in GRID]
    reps = 6000
    logits_rows = torch.stack([_fixed_logits(seed) for seed, *_ in combos])
    params = [SamplingParams(do_sample=True, temperature=t, top_k=k, top_p=p) for _, t, k, p in combos]
    # Row r of the batch is combo r % len(combos).
    logits = logits_rows.repeat(reps, 1)
    tensors = _tensors(params * reps)
    draws = sample(logits, tensors, torch.Generator().manual_seed(77)).view(reps, len(combos))
    for j, (seed, t, k, p) in enumerate(combos):
        target = _stock_target(logits_rows[j], t, k, p)
        _check_distribution(draws[:, j], target, f"[mixed batch] T={t} k={k} p={p} logits#{seed}")


def test_top_k_keeps_ties_like_stock():
    """Stock TopKLogitsWarper keeps every token tied with the k-th largest score."""
    logits = torch.full((VOCAB,), -3.0)
    logits[[4, 17, 30]] = 2.0  # three-way tie at the top
    logits[8] = 1.0
    n = 10_000
    for top_k in (1, 2, 3):
        target = _stock_target(logits, 1.0, top_k, 1.0)
        assert set(target.nonzero().flatten().tolist()) == {4, 17, 30}
        params = SamplingParams(do_sample=True, top_k=top_k)
        draws = sample(logits.expand(n, VOCAB).contiguous(), _tensors([params] * n),
                       torch.Generator().manual_seed(top_k))
        _check_distribution(draws, target, f"ties top_k={top_k}")


# --------------------------------------------------------------------------- per-row parameters


def test_rows_with_different_parameters_in_one_batch():
    logits_row = torch.randn(VOCAB, generator=torch.Generator().manual_seed(21)) * 0.5  # fairly flat
    argmax = int(logits_row.argmax())
    top3 = set(logits_row.topk(3).indices.tolist())
    kinds = [
        SamplingParams(do_sample=True, temperature=1.3, top_k=1),  # -> always argmax
        SamplingParams(do_sample=True, temperature=1.3, top_p=1e-6),  # -> always argmax
        SamplingParams(do_sample=True, temperature=1.0),  # unrestricted -> many tokens
        SamplingParams(do_sample=True, temperature=1.0, top_k=3),  # -> exactly the top 3
        SamplingParams(do_sample=False, temperature=1.3, top_k=40, top_p=0.9),  # greedy
    ]
    reps = 2000
    logits = logits_row.expand(reps * len(kinds), VOCAB).contiguous()
    out = sample(logits, _tensors(kinds * reps), torch.Generator().manual_seed(3)).view(reps, len(kinds))
    assert (out[:, 0] == argmax).all()
    assert (out[:, 1] == argmax).all()
    assert len(set(out[:, 2].tolist())) >= 20
    assert set(out[:, 3].tolist()) == top3
    assert (out[:, 4] == argmax).all()


# ------------------------------------------------------------------------------- reproducibility


def _repro_batch():
    logits = torch.randn(512, VOCAB, generator=torch.Generator().manual_seed(9))
    params = [
        SamplingParams(do_sample=True, temperature=t, top_k=k, top_p=p)
        for t, k, p in GRID
    ] * 40 + [SamplingParams()] * 32
    return logits, _tensors(params[:512])


def test_same_seed_same_tokens():
    logits, tensors = _repro_batch()
    a = sample(logits, tensors, torch.Generator().manual_seed(1234))
    torch.manual_seed(999)  # the global RNG must not matter
    b = sample(logits, tensors, torch.Generator().manual_seed(1234))
    assert torch.equal(a, b)
    c = sample(logits, tensors, torch.Generator().manual_seed(4321))
    assert not torch.equal(a, c), "different seeds gave identical draws: is the generator used at all?"


def test_generator_state_advances():
    """Two consecutive calls on one generator continue its stream (decode steps don't repeat tokens)."""
    logits, tensors = _repro_batch()
    gen = torch.Generator().manual_seed(1234)
    first = sample(logits, tensors, gen)
    second = sample(logits, tensors, gen)
    assert not torch.equal(first, second)
    gen2 = torch.Generator().manual_seed(1234)
    assert torch.equal(sample(logits, tensors, gen2), first)
    assert torch.equal(sample(logits, tensors, gen2), second)


@pytest.mark.parametrize("temperature, top_k, top_p, min_p", [
    (1.0, 0, 1.0, 0.05), (0.7, 0, 1.0, 0.2), (1.3, 20, 0.9, 0.1), (1.0, 0, 0.95, 0.5), (1.0, 0, 1.0, 1.0),
])
def test_min_p_matches_stock(temperature, top_k, top_p, min_p):
    """min-p after temperature, top-k and top-p, as stock orders its warpers (MinPLogitsWarper)."""
    from transformers.generation.logits_process import MinPLogitsWarper

    logits = _fixed_logits(7)
    input_ids = torch.zeros((1, 1), dtype=torch.long)
    scores = TemperatureLogitsWarper(temperature)(input_ids, logits[None].clone())
    if top_k:
        scores = TopKLogitsWarper(top_k)(input_ids, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(input_ids, scores)
    target = MinPLogitsWarper(min_p)(input_ids, scores)[0].double().softmax(dim=-1)
    params = SamplingParams(do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    draws = sample(logits.expand(N_DRAWS, VOCAB).contiguous(), _tensors([params] * N_DRAWS),
                   torch.Generator().manual_seed(5))
    _check_distribution(draws, target, f"T={temperature} k={top_k} p={top_p} min_p={min_p}")
