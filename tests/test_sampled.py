"""The sampling kernels (kernels/draw_sampled.py) against the torch sampler they implement (sampling.sample):
the same kept set, the same tokens, the same log-probabilities (on CUDA where there is one, else
in Triton's interpreter on the CPU)."""

import pytest
import torch

from hf_async_cb.engine.requests import SamplingParams
from hf_async_cb.kernels.draw_sampled import BLOCK, CAP, CUT_BLOCK, GATHER, GATHER_BLOCK, LADDER, LADDER_BLOCK, sampled_packed
from hf_async_cb.sampling.sampler import SamplingTensors, keep_threshold, pack, sample
from tests.sm90 import assert_compiles_for_sm90

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # the interpreter without CUDA
CASES = [
    dict(do_sample=False), dict(), dict(temperature=0.8, top_p=0.95), dict(temperature=0.8, top_k=50, top_p=0.95),
    dict(temperature=0.7, min_p=0.05), dict(top_k=1), dict(top_k=7), dict(top_p=0.3, min_p=0.2),
    dict(temperature=1.3, top_k=20, top_p=0.9, min_p=0.1), dict(top_p=1e-6), dict(min_p=1.0),
    dict(do_sample=False, top_k=3, temperature=0.5),  # a greedy row ignores its sampling fields
]


def _params(rows: int) -> SamplingTensors:
    options = [CASES[i % len(CASES)] for i in range(rows)]
    params = [SamplingParams(max_new_tokens=4, do_sample=o.get("do_sample", True), seed=100 + i,
                             **{k: v for k, v in o.items() if k != "do_sample"}) for i, o in enumerate(options)]
    return SamplingTensors.build(params, DEVICE, token_index=[3 * i for i in range(rows)])


def _logits(rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * 3
    logits[1::3, : vocab // 4] = 2.5  # long runs of ties, at the top-k / top-p edges for some rows
    logits[2::5, 5:] = float("-inf")  # rows with a few finite tokens (banned words, blocked tokens)
    return logits.to(DEVICE)


def _kept_by_kernels(logits: torch.Tensor, params: SamplingTensors, cap: int, gather: int | None = None
                     ) -> torch.Tensor:
    """What the kernels keep, read back through their threshold keys."""
    from hf_async_cb.kernels.draw_greedy import split_rows
    from hf_async_cb.kernels.draw_sampled import _cut

    rows, vocab = logits.shape
    parts, chunk = split_rows(rows, vocab, logits.device)
    return _kept_at(logits, params, _cut(logits, params, parts, chunk, gather, cap)[0])


def _kept_at(logits: torch.Tensor, params: SamplingTensors, cut: torch.Tensor) -> torch.Tensor:
    """The scores at or above each row's threshold key `cut` (as the kernels compare them)."""
    scores = logits.float() / params.temperature[:, None]
    bits = scores.view(torch.int32)
    key = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    key = torch.where(scores == 0, 0, key)
    return key >= cut[:, None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab, cap, gather", [(300, 16, 512), (300, 512, 16), (2 * BLOCK + 37, 64, None)])
def test_kernels_keep_the_reference_set(vocab, cap, gather, dtype):
    """Small caps make the searches narrow the bracket before they sort it; the default sorts at once.
    A small gather sends rows to the search over the whole row; a large one searches the gathered scores
    (kept in the logits' dtype: bf16 logits are searched among bf16 copies)."""
    rows = len(CASES) * 2
    logits, params = _logits(rows, vocab).to(dtype), _params(rows)
    scores = logits.float() / params.temperature[:, None]
    expected = scores >= keep_threshold(scores, params)[:, None]
    got = _kept_by_kernels(logits, params, cap, gather)
    assert torch.equal(got, expected), [r for r in range(rows) if not torch.equal(got[r], expected[r])]
    # The filters did filter, and kept whole runs of ties.
    assert not expected[3].all() and not expected[6].all() and expected[1, : vocab // 4].all() == expected[1, 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [300, 2 * BLOCK + 37])
def test_kernels_draw_the_reference_tokens_and_logprobs(vocab, dtype):
    rows = len(CASES) * 2
    logits, params = _logits(rows, vocab, seed=vocab).to(dtype), _params(rows)
    got = sampled_packed(logits, params)
    tokens, logprobs = sample(logits.float(), params)
    assert torch.equal(got[0], tokens)
    torch.testing.assert_close(got[1].view(torch.float64), logprobs.double(), rtol=1e-5, atol=1e-5)
    assert len(set(got[0].tolist())) > rows // 2  # not all the argmax


def test_kernels_read_strided_rows_and_advance_with_the_token_index():
    rows, vocab = 6, 500
    wide = _logits(rows, vocab + 40, seed=3)
    logits = wide[:, :vocab]  # a view with a row stride wider than the vocabulary
    params = _params(rows)
    got, expected = sampled_packed(logits, params), pack(*sample(logits.contiguous(), params))
    assert torch.equal(got[0], expected[0])
    torch.testing.assert_close(got[1].view(torch.float64), expected[1].view(torch.float64), rtol=1e-5, atol=1e-5)
    later = SamplingTensors.build([SamplingParams(do_sample=True, seed=1)] * 64, DEVICE, token_index=list(range(64)))
    flat = torch.zeros(64, vocab, device=DEVICE)
    drawn = sampled_packed(flat, later)[0]
    assert torch.equal(drawn, sample(flat, later)[0])
    assert len(set(drawn.tolist())) > 50  # a new token index is a new draw


def test_kernels_noise_is_finite_at_the_largest_hash_value():
    """The kernels' Gumbel noise at high hashed bits of all ones: finite, as the torch sampler's (it
    was +inf, and that token was drawn whatever its score)."""
    from tests.test_seeded_sampling import ALL_ONES

    seed, index, token, vocab = ALL_ONES
    logits = torch.full((2, vocab), -60.0, device=DEVICE)
    logits[:, 0] = 0.0
    params = SamplingTensors.build([SamplingParams(do_sample=True, seed=seed),
                                    SamplingParams(do_sample=True, seed=seed, top_k=2)], DEVICE,
                                   token_index=[index, index])
    got = sampled_packed(logits, params)
    assert got[0].tolist() == [0, 0] and torch.equal(got[0], sample(logits, params)[0])


def test_kernels_draw_from_the_far_tail_as_the_torch_sampler():
    """A token 16.8 nats below the top that its 48-bit noise (16.91, beyond 24 bits' 16.64) makes
    win: the kernels draw it, as the torch sampler, whether the row is filtered or not."""
    from hf_async_cb.sampling.sampler import gumbel_noise
    from tests.test_seeded_sampling import ALL_ONES

    seed, index, token, vocab = ALL_ONES
    noise = gumbel_noise(torch.tensor([seed]), torch.tensor([index]), vocab)[0]
    assert noise[token] > 16.8
    logits = torch.full((2, vocab), -60.0, device=DEVICE)
    logits[:, 0] = 0.0
    logits[:, token] = (noise[0] - noise[token] + 0.1).item()
    params = SamplingTensors.build([SamplingParams(do_sample=True, seed=seed),
                                    SamplingParams(do_sample=True, seed=seed, top_k=2)], DEVICE,
                                   token_index=[index, index])
    assert sample(logits, params)[0].tolist() == [token, token]
    assert sampled_packed(logits, params)[0].tolist() == [token, token]

def test_rows_without_a_seed_are_refused():
    params = SamplingTensors.build([SamplingParams(do_sample=True)], DEVICE)
    with pytest.raises(ValueError, match="seed"):
        sampled_packed(torch.zeros(1, 10, device=DEVICE), params)


def test_kernels_compile_for_sm90():
    ptr = {"logits_ptr": "*bf16"}
    rows = {"stride_row": "i32", "vocab": "i32", "num_parts": "i32"}
    params = {"temperature_ptr": "*fp32", "top_k_ptr": "*i64", "top_p_ptr": "*fp32", "do_sample_ptr": "*fp32"}
    ladder = {"top_ptr": "*fp32", "nan_ptr": "*i32", "cnt_ptr": "*i32", "mass_ptr": "*fp32"}
    module = "hf_async_cb.kernels.draw_sampled"
    assert_compiles_for_sm90([
        (module, "_top_kernel",
         {**ptr, **rows, "chunk": "i32", "top_k_ptr": "*i64", "top_p_ptr": "*fp32", "min_p_ptr": "*fp32",
          "do_sample_ptr": "*fp32", "top_ptr": "*fp32", "nan_ptr": "*i32"}, {"BLOCK": BLOCK}),
        (module, "_ladder_kernel", {**ptr, **rows, "chunk": "i32", **params, **ladder},
         {"L": LADDER, "BLOCK": LADDER_BLOCK}, {"num_warps": 8}),
        (module, "_gather_kernel", {**ptr, **rows, "chunk": "i32", **params, **ladder, "score_ptr": "*bf16",
                                    "col_ptr": "*i32"},
         {"L": LADDER, "GATHER": GATHER, "BLOCK": GATHER_BLOCK}),
        (module, "_resolve_kernel",
         {**ptr, **rows, **params, "min_p_ptr": "*fp32", "seed_ptr": "*i64", "index_ptr": "*i64", **ladder,
          "score_ptr": "*bf16", "col_ptr": "*i32", "cand_ptr": "*fp32", "cut_ptr": "*i32", "done_ptr": "*i32",
          "done_token_ptr": "*i32", "done_logprob_ptr": "*fp32"},
         {"L": LADDER, "GATHER": GATHER, "CAP": CAP, "BLOCK": CUT_BLOCK}, {"num_warps": 8}),
        (module, "_draw_parts_kernel",
         {**ptr, **rows, "chunk": "i32", "temperature_ptr": "*fp32", "do_sample_ptr": "*fp32", "seed_ptr": "*i64",
          "index_ptr": "*i64", "cut_ptr": "*i32", "done_ptr": "*i32", "value_ptr": "*fp32", "token_ptr": "*i32",
          "nan_ptr": "*i32", "score_ptr": "*fp32", "max_ptr": "*fp32", "sum_ptr": "*fp32"},
         {"BLOCK": BLOCK}),
        (module, "_draw_merge_kernel",
         {"value_ptr": "*fp32", "token_ptr": "*i32", "nan_ptr": "*i32", "score_ptr": "*fp32", "max_ptr": "*fp32",
          "sum_ptr": "*fp32", "do_sample_ptr": "*fp32", "done_ptr": "*i32", "done_token_ptr": "*i32",
          "done_logprob_ptr": "*fp32", "tokens_ptr": "*i64", "logprobs_ptr": "*fp64", "vocab": "i32",
          "num_parts": "i32"},
         {"INVALID": -1}),
    ], options={"num_warps": 4})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_kernels_match_the_torch_sampler_on_cuda():
    """A real vocabulary in bf16 on the GPU: the kernels and the torch sampler agree token for token
    (up to near-ties from exp/log rounding, of which there must be almost none)."""
    rows, vocab = 96, 128256
    logits = _logits(rows, vocab, seed=7).to(torch.bfloat16)
    params = _params(rows)
    got = sampled_packed(logits, params)
    tokens, logprobs = sample(logits.float(), params)
    assert int((got[0] != tokens).sum()) <= 1
    same = got[0] == tokens
    torch.testing.assert_close(got[1].view(torch.float64)[same], logprobs.double()[same], rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU run of the interpreted kernels (CUDA runs test_gpu.py)")
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_engine_with_triton_draws_the_tokens_of_the_torch_sampler(mode, monkeypatch):
    """The engine's Triton path draws with the kernels (graphs, processors and blocked tokens too)
    and gives the tokens of the reference path, which draws with the torch sampler."""
    import hf_async_cb.kernels.draw_sampled as sampled
    from hf_async_cb import BatchingConfig, Engine
    from tests.models import random_prompts, tiny_model

    calls = []
    monkeypatch.setattr(sampled, "sampled_packed", lambda *a: calls.append(1) or sampled_packed(*a))
    model = tiny_model("llama")
    prompts = random_prompts(6, 3, 20, seed=5)
    params = [SamplingParams(max_new_tokens=6, **CASES[i % len(CASES)], seed=i) for i in range(5)] + [
        SamplingParams(max_new_tokens=6, do_sample=True, temperature=0.9, top_k=30, repetition_penalty=1.3,
                       min_new_tokens=3, eos_token_ids=(2,), seed=9)]
    outputs = {}
    for attention in ("triton", "reference"):
        with Engine(model, BatchingConfig(mode=mode, attention=attention, cuda_graphs=True, page_size=8,
                                          seed=1)) as engine:
            outputs[attention] = [o.output_token_ids for o in engine.generate(prompts, params)]
    assert calls, "the Triton path did not draw with the kernels"
    assert outputs["triton"] == outputs["reference"]
    assert len({tuple(o) for o in outputs["triton"]}) == len(prompts)
