"""model/decode_gemm.py: projections routed through the skinny GEMM kernel where a choice says so
(here a stand-in GemmChoice that picks the kernel for every shape; off CUDA the kernel runs in
Triton's interpreter) give the logits and the greedy tokens of the stock model, fall back to
F.linear above 256 rows, and leave nothing behind on detach."""

import copy

import pytest
import torch
from models import left_pad, random_prompts, stock_generate, tiny_model

import hf_async_cb.kernels.skinny_gemm as skinny
import hf_async_cb.model.decode_gemm as decode_gemm
from hf_async_cb import BatchingConfig
from hf_async_cb.model.decode_gemm import DecodeGemms
from hf_async_cb.model.fusion import fuse_projections

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # on the CPU the kernel runs in Triton's interpreter
SMALL = dict(BLOCK_N=32, BLOCK_K=32, SPLIT_K=2, num_warps=4, num_stages=2, SWAP_AB=False)


class EveryShape:
    """A GemmChoice stand-in: the kernel for every shape and rows bucket (a split-K config)."""

    def choose(self, M, N, K, dtype, device):
        return dict(SMALL)

    def known(self, *args):
        return True


@pytest.fixture
def kernel_calls(monkeypatch):
    calls = []
    real = skinny.skinny_linear

    def counted(x, weight, bias=None, *, config=None):
        calls.append((x.numel() // x.shape[-1], tuple(weight.shape)))
        return real(x, weight, bias, config=config)

    monkeypatch.setattr(decode_gemm, "skinny_linear", counted)
    return calls


def _logits(model, ids):
    with torch.no_grad():
        return model(ids.to(DEVICE)).logits


@pytest.mark.parametrize("fused", [False, True])
def test_routed_forward_matches_stock(fused, kernel_calls):
    model = copy.deepcopy(tiny_model("llama")).to(DEVICE)
    ids = torch.randint(3, 256, (2, 9), generator=torch.Generator().manual_seed(1))
    expected = _logits(model, ids)
    fusion = fuse_projections(model) if fused else None
    gemms = DecodeGemms(model, fusion, EveryShape())
    shapes = {(n, k) for n, k, _, _ in gemms.shapes()}
    # q 64, k/v 32 each, o 64, gate/up 128 each, down 64 from 128, lm_head 256
    assert shapes == ({(128, 64), (64, 64), (256, 64), (64, 128)} if fused else
                      {(64, 64), (32, 64), (128, 64), (64, 128), (256, 64)})
    if fusion is not None:
        fusion.attach()
    gemms.attach()
    got = _logits(model, ids)
    # Every projection of every layer, and the lm_head, went through the kernel with 18 rows.
    layers = model.config.num_hidden_layers
    assert len(kernel_calls) == layers * (2 + 2 if fused else 4 + 3) + 1
    assert {rows for rows, _ in kernel_calls} == {18}
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    gemms.detach()
    if fusion is not None:
        fusion.detach()
        assert all(g.linear is None for g in fusion.groups())
    assert not any("forward" in vars(m) for m in model.modules())
    kernel_calls.clear()
    torch.testing.assert_close(_logits(model, ids), expected, rtol=1e-5, atol=1e-5)
    assert kernel_calls == []


def _routed_logits(model, ids):
    """The model's logits with every projection routed (EveryShape), then the model given back."""
    gemms = DecodeGemms(model, None, EveryShape())
    gemms.attach()
    try:
        return _logits(model, ids)
    finally:
        gemms.detach()


def test_more_than_256_rows_use_linear(kernel_calls):
    model = copy.deepcopy(tiny_model("llama")).to(DEVICE)
    ids = torch.randint(3, 256, (1, 300), generator=torch.Generator().manual_seed(2))
    expected = _logits(model, ids)
    got = _routed_logits(model, ids)
    assert kernel_calls == []
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_autocast_multiplies_as_stock_does(kernel_calls):
    """Under autocast F.linear multiplies in the autocast dtype; the kernel would in the weight's: a
    routed projection steps aside there, so the logits are stock's under the same autocast."""
    model = copy.deepcopy(tiny_model("llama")).to(DEVICE)
    ids = torch.randint(3, 256, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        expected = _logits(model, ids)
        got = _routed_logits(model, ids)
    assert kernel_calls == [] and got.dtype == expected.dtype == torch.bfloat16
    assert torch.equal(got, expected)


def test_nothing_recorded_attaches_nothing():
    class Nothing(EveryShape):
        def choose(self, *args):
            return None

    model = copy.deepcopy(tiny_model("llama"))
    gemms = DecodeGemms(model, None, Nothing())
    gemms.attach()
    assert gemms.wins() == 0 and not any("forward" in vars(m) for m in model.modules())
    assert gemms.tune(64) == 0  # off CUDA nothing is measured (the model is on the CPU)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_engine_greedy_matches_stock(mode, monkeypatch, kernel_calls):
    monkeypatch.setattr(decode_gemm, "GemmChoice", EveryShape)
    model = copy.deepcopy(tiny_model("qwen3"))
    prompts = random_prompts(6, 1, 40, seed=5)
    expected = stock_generate(model, prompts, max_new_tokens=6)
    model = model.to(DEVICE)
    ids, mask = (t.to(DEVICE) for t in left_pad(prompts))
    config = BatchingConfig(page_size=16, max_batch_tokens=64, skinny_gemm=True, fuse_projections=True)
    got = model.generate(ids, attention_mask=mask, batching=mode, batching_config=config, max_new_tokens=6)
    assert torch.equal(got.cpu(), expected)
    rows = {rows for rows, _ in kernel_calls}
    # decode steps (6 rows; 8 in a CUDA graph's bucket) went through the kernel; a prefill graph's
    # padded bucket may exceed max_batch_tokens, never the kernel's MAX_M (F.linear above)
    assert rows and min(rows) <= 8 and max(rows) <= skinny.MAX_M
    assert not any("forward" in vars(m) for m in model.modules())  # detached after the call


def test_config_field():
    assert BatchingConfig(skinny_gemm=False).skinny_gemm is False
    with pytest.raises(ValueError, match="skinny_gemm"):
        BatchingConfig(skinny_gemm="yes")


def test_a_config_that_does_not_build_falls_back_to_linear(monkeypatch):
    """A recorded config this machine cannot build (here a shared-memory overflow) warns once and
    leaves that shape to F.linear, with the right result."""
    from triton.runtime.errors import OutOfResources

    def fails(*args, **kwargs):
        raise OutOfResources(300000, 232448, "shared memory")

    monkeypatch.setattr(decode_gemm, "skinny_linear", fails)
    model = copy.deepcopy(tiny_model("llama")).to(DEVICE)
    ids = torch.randint(3, 256, (2, 5), generator=torch.Generator().manual_seed(3))
    expected = _logits(model, ids)
    gemms = DecodeGemms(model, None, EveryShape())
    gemms.attach()
    try:
        with pytest.warns(UserWarning, match="does not build here"):
            got = _logits(model, ids)
        again = _logits(model, ids)  # the failed config is dropped: no second warning, no retry
    finally:
        gemms.detach()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(again, expected, rtol=1e-5, atol=1e-5)
