"""The threshold search of kernels/draw_sampled.py on rows built to break it: runs of ties at the
edges, all-equal rows, top-p keeping one token or nearly all, top-k of 1 or past the vocabulary, a
vocabulary that is no multiple of the blocks, many rows of mixed parameters; the kept set must be
exactly sampling.keep_threshold's (top-p nearer 1 than 0.9999 decides at the level of float32 sums),
the tokens those of sampling.sample, and two runs the same bits.
Small gather / sort sizes send rows down every path: searched among the gathered scores, the top
score as the edge, and the search over the whole row."""

import pytest
import torch
import triton
import triton.language as tl

from hf_async_cb.engine.requests import SamplingParams
from hf_async_cb.kernels import draw_sampled
from hf_async_cb.kernels.draw_sampled import _sampled_packed, _x_floor
from hf_async_cb.sampling.sampler import SamplingTensors, keep_threshold, sample
from tests.test_sampled import DEVICE, _kept_at


def _build(options: list[dict], index: int = 0) -> SamplingTensors:
    params = [SamplingParams(max_new_tokens=4, do_sample=o.get("do_sample", True), seed=7 + i,
                             **{k: v for k, v in o.items() if k != "do_sample"}) for i, o in enumerate(options)]
    return SamplingTensors.build(params, DEVICE, token_index=[index + i for i in range(len(options))])


def _sampled_and_cut(logits: torch.Tensor, params: SamplingTensors, gather: int, cap: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """_sampled_packed's [2, S] output and the threshold keys its search found for it: one run of the
    kernels (in the interpreter the search is nearly all the time; running it again on its own for
    the keys doubled these tests)."""
    search, cuts = draw_sampled._cut, []

    def recording(*args, **kwargs):
        found = search(*args, **kwargs)
        cuts.append(found[0].clone())
        return found

    draw_sampled._cut = recording
    try:
        out = _sampled_packed(logits, params, gather, cap)
    finally:
        draw_sampled._cut = search
    [cut] = cuts
    return out, cut


def _check(logits: torch.Tensor, params: SamplingTensors, cap: int, gather: int) -> torch.Tensor:
    scores = logits / params.temperature[:, None]
    expected = scores >= keep_threshold(scores, params)[:, None]
    out, cut = _sampled_and_cut(logits, params, gather, cap)
    got = _kept_at(logits, params, cut)
    assert torch.equal(got, expected), [r for r in range(len(got)) if not torch.equal(got[r], expected[r])]
    tokens, logprobs = sample(logits, params)
    assert torch.equal(out[0], tokens), (out[0], tokens)
    torch.testing.assert_close(out[1].view(torch.float64), logprobs.double(), rtol=1e-5, atol=1e-5, equal_nan=True)
    return out


def _tied_rows(vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(11)
    rows = [torch.full((vocab,), 1.5),  # all equal
            torch.randn(vocab, generator=g).round(),  # few distinct values, long runs
            (torch.randn(vocab, generator=g) * 4).round() / 2,
            torch.where(torch.arange(vocab) % 3 == 0, 4.0, -1.0),  # two values
            torch.cat([torch.full((5,), 9.0), torch.full((vocab - 5,), 2.0)]),  # a short run on top
            torch.cat([torch.full((vocab - 3,), 0.0), torch.tensor([-0.0, 0.0, 7.0])]),  # signed zeros
            torch.randn(vocab, generator=g) * 30]  # wide: the edges far below the top
    return torch.stack(rows)


OPTIONS = [dict(top_k=1), dict(top_k=2), dict(top_k=5), dict(top_k=100), dict(top_k=10_000),  # > vocab: off
           dict(top_p=1e-7), dict(top_p=0.5), dict(top_p=0.9), dict(top_p=0.9999), dict(top_k=40, top_p=0.6),
           dict(temperature=0.7, top_k=3, top_p=0.99), dict(temperature=1.7, top_p=0.8, min_p=0.05),
           dict(top_k=50, min_p=0.3)]


@pytest.mark.parametrize("cap, gather", [(8, 16), (16, 1024)])
def test_ties_and_extremes_keep_the_reference_set(cap, gather):
    vocab = 613  # no multiple of any block
    base = _tied_rows(vocab)
    logits = base.repeat(len(OPTIONS), 1).to(DEVICE)
    options = [o for o in OPTIONS for _ in range(len(base))]
    _check(logits, _build(options), cap, gather)


def test_top_p_keeps_one_token_or_nearly_all():
    vocab = 500
    g = torch.Generator().manual_seed(3)
    peaked = torch.randn(vocab, generator=g)
    peaked[17] = 40.0  # all the mass on one token
    flat = torch.randn(vocab, generator=g) * 1e-3  # nearly uniform: top-p 0.99 keeps ~495
    logits = torch.stack([peaked, peaked, flat, flat, flat]).to(DEVICE)
    params = _build([dict(top_p=0.9), dict(top_p=0.999), dict(top_p=0.99), dict(top_p=0.5), dict(top_k=499)])
    for cap, gather in [(16, 64), (16, 512)]:
        _check(logits, params, cap, gather)
    scores = logits / params.temperature[:, None]
    kept = (scores >= keep_threshold(scores, params)[:, None]).sum(dim=1).tolist()
    assert kept[0] == 1 and kept[2] > 480 and kept[4] == 499


def test_many_rows_of_mixed_parameters_and_two_runs_give_the_same_bits():
    rows, vocab = 48, 1500
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(rows, vocab, generator=g) * 3
    logits[::4, :300] = logits[::4, :1].round()  # runs of ties
    logits[1::7, 9:] = float("-inf")
    options = [dict(do_sample=False)] + [OPTIONS[i % len(OPTIONS)] for i in range(rows - 1)]
    params = _build(options, index=100)
    logits = logits.to(DEVICE)
    first = _check(logits, params, 32, 256)
    again = _sampled_packed(logits, params, 256, 32)
    assert torch.equal(first, again)


def test_nan_and_infinite_rows_are_flagged_as_before():
    vocab = 300
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(2)) * 3
    logits[0, 7] = float("nan")
    logits[1, 9] = float("inf")
    logits[2] = float("-inf")
    params = _build([dict(top_p=0.9), dict(top_k=5), dict(top_k=5, top_p=0.5), dict(top_p=0.9)])
    out = _sampled_packed(logits.to(DEVICE), params, 64, 16)
    assert out[0, :3].tolist() == [-1, -1, -1]
    assert torch.isnan(out[1, :3].view(torch.float64)).all()
    assert out[0, 3] == sample(logits.to(DEVICE), params)[0][3]


def test_unscaled_floors_are_exact():
    """x >= _x_floor(score, t) exactly when div_rn(x, t) >= score: the passes compare unscaled logits."""
    @triton.jit
    def floors(score_ptr, t_ptr, out_ptr, N: tl.constexpr):
        at = tl.arange(0, N)
        tl.store(out_ptr + at, _x_floor(tl.load(score_ptr + at), tl.load(t_ptr + at)))

    g = torch.Generator().manual_seed(9)
    n = 256
    score = torch.randn(n, generator=g) * torch.tensor([1e-3, 1.0, 30.0, 1e4]).repeat(n // 4)
    score[:4] = torch.tensor([0.0, -0.0, float("-inf"), 1e-30])
    t = torch.tensor([0.3, 0.7, 1.0, 1.3, 2.9, 0.05, 0.999, 10.0]).repeat(n // 8)
    out = torch.empty(n, device=DEVICE)
    floors[(1,)](score.to(DEVICE), t.to(DEVICE), out, N=n)
    out = out.cpu()
    finite = out.isfinite()
    for step in (-1, 0, 1):
        x = out[finite]
        bits = x.view(torch.int32)
        key = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits) + step
        neighbour = torch.where(key < 0, key ^ 0x7FFFFFFF, key).view(torch.float32)
        assert torch.equal(neighbour >= x, neighbour / t[finite] >= score[finite])
