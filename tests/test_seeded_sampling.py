"""Seeds: a request's samples follow stock's distribution and do not depend on the other requests
sharing its batches, on the loop mode, or on preemption, whether the seed is its own
(SamplingParams.seed) or derived from the engine's (BatchingConfig.seed and the request's index)."""

import dataclasses

import pytest
import torch
from models import left_pad, random_prompts, tiny_model
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from hf_async_cb import BatchingConfig, Engine, SamplingParams
from hf_async_cb.sampling.sampler import SamplingTensors, derive_seed, hash_bits
from hf_async_cb.sampling.sampler import sample as sample_with_logprobs


def sample(*args, **kwargs):
    """The sampled tokens alone."""
    return sample_with_logprobs(*args, **kwargs)[0]


def test_hash_bits_are_uniform_and_deterministic():
    seed = torch.arange(200)
    bits = hash_bits(seed, torch.full_like(seed, 3), 500)
    assert bits.shape == (200, 500) and bits.min() >= 0 and bits.max() < 2**48
    assert torch.equal(bits, hash_bits(seed, torch.full_like(seed, 3), 500))
    high, low = (bits >> 24).double(), (bits & 0xFFFFFF).double()
    for part in (high, low):  # each half uniform
        u = (part + 0.5) / 2**24
        assert abs(u.mean().item() - 0.5) < 0.01 and abs(u.var().item() - 1 / 12) < 0.005
        hist = torch.histc(u.float(), bins=10, min=0, max=1) / u.numel()
        assert (hist - 0.1).abs().max() < 0.01
        # Neighbouring seeds, token indices and token ids are not correlated.
        assert abs(torch.corrcoef(torch.stack([u[:-1].flatten(), u[1:].flatten()]))[0, 1].item()) < 0.01
        assert abs(torch.corrcoef(torch.stack([u[:, :-1].flatten(), u[:, 1:].flatten()]))[0, 1].item()) < 0.01
    assert abs(torch.corrcoef(torch.stack([high.flatten(), low.flatten()]))[0, 1].item()) < 0.01
    # The low half of the tokens whose high half is smallest: still uniform (what the far tail draws).
    tail = low[high < 2**24 / 8] / 2**24
    assert tail.numel() > 10000 and abs(tail.mean().item() - 0.5) < 0.02
    assert not torch.equal(bits, hash_bits(seed, torch.full_like(seed, 4), 500))


def test_gumbel_noise_has_the_gumbel_distribution_into_the_far_tail():
    """The noise is monotone in the 48 hashed bits, so P(noise > t) over uniform bits is exactly the
    share of bit patterns above the first one whose noise exceeds t (a bisection finds it). With
    24 bits the noise stopped at 16.6: a token 17 or more nats below the top was never drawn, and
    those 12-17 below too rarely (13% too rarely at 16 below)."""
    import math

    from hf_async_cb.sampling.sampler import _gumbel

    sample_bits = torch.randint(0, 2**48, (100000,)).sort().values
    assert (_gumbel(sample_bits).diff() >= 0).all()
    for t in (-2.0, 0.0, 2.0, 5.0, 10.0, 14.0, 16.0, 18.0, 20.0, 25.0, 30.0):
        lo, hi = 0, 2**48  # the first bits whose noise exceeds t is in [lo, hi]
        while lo < hi:
            mid = (lo + hi) // 2
            if _gumbel(torch.tensor([mid])).item() > t:
                hi = mid
            else:
                lo = mid + 1
        above = (2**48 - lo) / 2**48
        exact = -math.expm1(-math.exp(-t))
        # to 1e-4, or to one bit pattern where the tail holds only a few dozen (t = 30: 26)
        assert abs(above - exact) * 2**48 < max(1.0, 1e-4 * exact * 2**48), (t, above, exact)
    assert _gumbel(torch.tensor([2**48 - 1])).item() > 33.9


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8)])
def test_seeded_draws_follow_the_stock_distribution(temperature, top_k, top_p):
    torch.manual_seed(0)
    vocab, n = 40, 20000
    logits = torch.randn(1, vocab) * 2
    target = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        target = TopKLogitsWarper(top_k)(None, target)
    if top_p < 1.0:
        target = TopPLogitsWarper(top_p)(None, target)
    target = target.softmax(-1)[0]
    params = [SamplingParams(do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p, seed=s)
              for s in range(n)]
    tokens = sample(logits.expand(n, vocab).clone(), SamplingTensors.build(params, torch.device("cpu")))
    empirical = torch.bincount(tokens, minlength=vocab).double() / n
    assert (empirical[target == 0] == 0).all()
    # Total variation: E <= 0.5 * sqrt(K / n) ~ 0.022 for K = 40 tokens, n = 20000; 0.04 leaves room.
    assert 0.5 * (empirical - target.double()).abs().sum() < 0.04


# (seed, token index, token id, vocab) whose high 24 hashed bits are all ones: its noise, 16.91, is
# above what 24 bits could give (16.64).
ALL_ONES = (8544, 0, 1533, 4096)


def test_gumbel_noise_is_finite_for_every_hash_value():
    """(2**24 - 1 + 0.5) rounds to 2**24 in float32: the uniform was 1.0 and the noise +inf, so that
    token won the draw whatever its score (about vocab / 2**24 of the unfiltered draws, 0.8% at 128K)."""
    from hf_async_cb.sampling.sampler import _gumbel

    every = torch.arange(2**24)
    for bits in (every, every | (2**24 - 1) << 24, every << 24, (every << 24) | (2**24 - 1)):
        noise = _gumbel(bits)  # every low half at the extreme high halves, and every high half
        assert noise.isfinite().all()
        assert (noise[1:] >= noise[:-1]).all()  # monotone in the bits: a quantised Gumbel
    seed, index, token, vocab = ALL_ONES
    assert hash_bits(torch.tensor([seed]), torch.tensor([index]), vocab)[0, token] >> 24 == 2**24 - 1
    logits = torch.full((1, vocab), -60.0)
    logits[0, 0] = 0.0  # stock draws token 0 but with probability ~1e-26 * vocab
    params = SamplingTensors.build([SamplingParams(do_sample=True, seed=seed)], torch.device("cpu"),
                                   token_index=[index])
    assert sample(logits, params).item() == 0

def _seeded_outputs(engine, prompts, params):
    return [o.output_token_ids for o in engine.generate(prompts, params)]


def test_seeded_request_ignores_its_batch_mates_mode_and_preemption():
    model = tiny_model("llama")
    target_prompt = random_prompts(1, 12, 12, seed=51)[0]
    target = SamplingParams(max_new_tokens=16, do_sample=True, temperature=1.2, top_k=50, seed=1234, eos_token_ids=())
    alone = _seeded_outputs(Engine(model, BatchingConfig(mode="sync")), [target_prompt], [target])[0]
    assert len(set(alone)) > 3, "the request should really sample"

    others = random_prompts(7, 1, 40, seed=52)
    mates = [SamplingParams(max_new_tokens=n, do_sample=i % 2 == 0, seed=i if i % 3 else None, temperature=0.8)
             for i, n in enumerate([3, 20, 7, 16, 1, 12, 9])]
    for mode in ("sync", "async"):
        for config in (BatchingConfig(mode=mode), BatchingConfig(mode=mode, page_size=4, num_pages=30,
                                                                  max_batch_tokens=16, seed=9)):
            engine = Engine(model, config)
            for position in (0, 4):
                prompts = others[:position] + [target_prompt] + others[position:]
                params = mates[:position] + [target] + mates[position:]
                assert _seeded_outputs(engine, prompts, params)[position] == alone


def test_different_seeds_differ_and_unseeded_rows_still_sample():
    model = tiny_model("llama")
    prompt = random_prompts(1, 8, 8, seed=53)[0]
    engine = Engine(model, BatchingConfig(mode="async"))
    params = [SamplingParams(max_new_tokens=12, do_sample=True, temperature=1.5, seed=s) for s in (1, 2)]
    a, b = _seeded_outputs(engine, [prompt, prompt], params)
    assert a != b


def test_seed_must_be_a_non_negative_integer():
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=-1)
    with pytest.raises(ValueError, match="2\\*\\*63"):
        SamplingParams(do_sample=True, seed=2**63)
    assert SamplingParams(do_sample=True, seed=2**63 - 1, top_k=2**70).sampler_ints  # the largest seed; top_k off


def test_logprobs_are_those_of_the_drawing_distribution():
    torch.manual_seed(1)
    logits = torch.randn(3, 30)
    params = [SamplingParams(), SamplingParams(do_sample=True, temperature=0.5, top_k=4, seed=3),
              SamplingParams(do_sample=True, top_p=0.5, seed=4)]
    tokens, logprobs = sample_with_logprobs(logits, SamplingTensors.build(params, torch.device("cpu")))
    assert logprobs[0] == pytest.approx(logits[0].log_softmax(-1)[tokens[0]].item(), abs=1e-6)
    warped = TopKLogitsWarper(4)(None, TemperatureLogitsWarper(0.5)(None, logits[1:2].clone()))
    assert logprobs[1] == pytest.approx(warped.log_softmax(-1)[0, tokens[1]].item(), abs=1e-5)
    nucleus = TopPLogitsWarper(0.5)(None, logits[2:3].clone())
    assert logprobs[2] == pytest.approx(nucleus.log_softmax(-1)[0, tokens[2]].item(), abs=1e-5)


def test_engine_outputs_carry_logprobs_in_both_modes():
    model = tiny_model("qwen2")
    prompts = random_prompts(5, 2, 20, seed=54)
    results = []
    for mode in ("sync", "async"):
        outs = Engine(model, BatchingConfig(mode=mode)).generate(prompts, max_new_tokens=8)
        for o in outs:
            assert len(o.logprobs) == len(o.output_token_ids)
            assert all(lp <= 0 for lp in o.logprobs)
        results.append([o.logprobs for o in outs])
    # Greedy logprobs are the model's own: recompute the first one with a plain forward.
    with torch.no_grad():
        first = model(torch.tensor([prompts[0]])).logits[0, -1].log_softmax(-1).max().item()
    assert results[0][0][0] == pytest.approx(first, abs=1e-4)
    for sync_row, async_row in zip(*results):
        assert sync_row == pytest.approx(async_row, abs=1e-5)


TARGET = SamplingParams(max_new_tokens=16, do_sample=True, temperature=1.3, top_k=60)


def _mates(n: int, seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    prompts = random_prompts(n, 1, 40, seed=seed)
    params = [SamplingParams(max_new_tokens=m, do_sample=i % 3 != 0, temperature=0.8,
                             repetition_penalty=1.1 if i % 2 else 1.0)
              for i, m in enumerate([3, 20, 7, 16, 1, 12, 9][:n])]
    return prompts, params


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_engine_seed_makes_each_request_batch_independent(mode):
    """BatchingConfig(seed=...) gives request i of a call the seed derive_seed(seed, i): the first
    request alone, or first among different companions, with different token budgets and a pool
    that preempts, samples the same tokens."""
    model = tiny_model("llama")
    prompt = random_prompts(1, 12, 12, seed=55)[0]
    alone = Engine(model, BatchingConfig(mode="sync", seed=7)).generate([prompt], [TARGET])[0].output_token_ids
    assert len(set(alone)) > 3, "the request should really sample"
    mixes = [(_mates(7, 56), dict()), (_mates(5, 57), dict(page_size=4, num_pages=18, max_batch_tokens=16)),
             (_mates(6, 58), dict(max_batch_tokens=5, cuda_graphs=True))]
    preempted = 0
    for (prompts, params), config in mixes:
        engine = Engine(model, BatchingConfig(mode=mode, seed=7, **config))
        outs = engine.generate([prompt] + prompts, [TARGET] + params)
        assert outs[0].output_token_ids == alone, config
        preempted += sum(o.num_preemptions for o in outs)
    assert preempted > 0
    other = Engine(model, BatchingConfig(mode=mode, seed=8)).generate([prompt], [TARGET])[0].output_token_ids
    assert other != alone, "another engine seed should give other tokens"


def test_engine_seed_derives_from_the_index_in_the_call():
    """Request i gets derive_seed(engine seed, i); its own seed, if it has one, wins."""
    model = tiny_model("llama")
    prompt = random_prompts(1, 12, 12, seed=55)[0]
    engine = Engine(model, BatchingConfig(seed=7))
    second = engine.generate([[5, 6], prompt], [TARGET, TARGET])[1].output_token_ids
    explicit = dataclasses.replace(TARGET, seed=derive_seed(7, 1))
    assert Engine(model, BatchingConfig(seed=123)).generate([prompt], [explicit])[0].output_token_ids == second
    assert engine.generate([prompt], [TARGET])[0].output_token_ids != second  # index 0: another seed
    assert len({derive_seed(7, i) for i in range(1000)} | {derive_seed(8, i) for i in range(1000)}) == 2000


def test_generate_rows_are_batch_independent_under_the_engine_seed():
    """model.generate(do_sample=True, batching=...): row i samples from derive_seed(seed, i), so a
    row's tokens do not depend on the rows after it, nor on the token budget or the loop."""
    model = tiny_model("qwen2")
    prompts = random_prompts(5, 4, 30, seed=59)
    kwargs = dict(max_new_tokens=12, do_sample=True, temperature=1.2, eos_token_id=None, pad_token_id=0)
    first_alone = model.generate(torch.tensor([prompts[0]]), batching="sync", batching_config=BatchingConfig(seed=3),
                                 **kwargs)[0, len(prompts[0]):]
    ids, mask = left_pad(prompts)
    for mode, config in (("sync", BatchingConfig(seed=3)), ("async", BatchingConfig(seed=3, max_batch_tokens=6))):
        rows = model.generate(ids, attention_mask=mask, batching=mode, batching_config=config, **kwargs)
        assert torch.equal(rows[0, ids.shape[1]:], first_alone), mode


def test_without_an_engine_seed_torch_manual_seed_reproduces_a_run():
    """No BatchingConfig.seed: the engine seed is drawn from torch's global generator, so, as with
    stock generate, torch.manual_seed makes a run reproducible (and successive runs differ)."""
    model = tiny_model("llama")
    ids, mask = left_pad(random_prompts(4, 3, 20, seed=60))
    kwargs = dict(attention_mask=mask, max_new_tokens=12, do_sample=True, temperature=1.5, batching="async")
    torch.manual_seed(11)
    a, b = model.generate(ids, **kwargs), model.generate(ids, **kwargs)
    torch.manual_seed(11)
    assert torch.equal(model.generate(ids, **kwargs), a)
    assert not torch.equal(a, b)
    state = torch.get_rng_state()
    model.generate(ids, attention_mask=mask, max_new_tokens=4, batching="async")  # greedy: draws nothing
    assert torch.equal(torch.get_rng_state(), state)


def test_online_requests_derive_their_seed_from_their_submission_order():
    """add_request: the n-th submission gets derive_seed(engine seed, n), as request n of a
    generate call would: the first one samples what it samples alone in generate()."""
    model = tiny_model("llama")
    prompt = random_prompts(1, 12, 12, seed=55)[0]
    alone = Engine(model, BatchingConfig(seed=7)).generate([prompt], [TARGET])[0].output_token_ids
    engine = Engine(model, BatchingConfig(mode="async", seed=7))
    engine.start()
    try:
        first = engine.add_request(prompt, TARGET)
        others = [engine.add_request(p, q) for p, q in zip(*_mates(4, 61))]
        assert first.result(timeout=60).output_token_ids == alone
        for handle in others:
            handle.result(timeout=60)
    finally:
        engine.shutdown()
