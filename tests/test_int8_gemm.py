"""Weight-only int8 projections (torchao's Int8WeightOnlyConfig: an int8 weight and one scale per
output row) through the skinny GEMM's scaled form: the kernel rounds as the module's own path does
((x @ w.to(dtype).T) rounded, times the scale, rounded), its compiled variants are the ones listed
for compiling ahead, and a quantized model routed through it gives stock's logits and greedy tokens
(on the CPU the kernel runs in Triton's interpreter, in fp32: the interpreter has no bf16)."""

import copy

import pytest
import torch
from models import tiny_model
from quantized_checks import assert_engine_greedy_matches_stock, interpreter_launches, routed_logits

import hf_async_cb.kernels.skinny_gemm as skinny
import hf_async_cb.model.decode_gemm as decode_gemm
from hf_async_cb.kernels.skinny_gemm_forms import SCALED_INT8
from hf_async_cb.model.decode_gemm import scaled_int8

torchao_quantization = pytest.importorskip("torchao.quantization")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32
SMALL = dict(BLOCK_N=16, BLOCK_K=32, num_warps=4, num_stages=2, SWAP_AB=False)


def _int8_model(family: str = "llama") -> torch.nn.Module:
    model = copy.deepcopy(tiny_model(family)).to(DEVICE, DTYPE)
    # (set_inductor_config=False: torchao would otherwise turn TF32 on for the whole process)
    torchao_quantization.quantize_(model, torchao_quantization.Int8WeightOnlyConfig(set_inductor_config=False))
    return model


@pytest.mark.parametrize("split", [1, 2])
@pytest.mark.parametrize("rows", [1, 3, 17])
def test_scaled_kernel_rounds_as_the_module_does(split, rows):
    g = torch.Generator().manual_seed(rows)
    n, k = 48, 96  # N not a multiple of the tile: masked columns
    x = torch.randn(rows, k, generator=g).to(DEVICE, DTYPE)
    w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8).to(DEVICE)
    scale = (torch.rand(n, generator=g) / 50).to(DEVICE, DTYPE)
    expected = torch.mm(x, w.t().to(DTYPE)) * scale
    got = skinny.skinny_linear(x, w, config=dict(SMALL, SPLIT_K=split), scale=scale)
    assert got.dtype == DTYPE and got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)  # (summation order only)


def test_scaled_kernel_refuses_what_it_does_not_take():
    x = torch.randn(2, 32, device=DEVICE, dtype=DTYPE)
    w = torch.zeros(16, 32, dtype=torch.int8, device=DEVICE)
    with pytest.raises(ValueError, match="int8 weight"):
        skinny.skinny_linear(x, w, torch.zeros(16, device=DEVICE, dtype=DTYPE), scale=torch.ones(16, device=DEVICE,
                                                                                                 dtype=DTYPE))
    with pytest.raises(ValueError, match="int8 weight"):
        skinny.skinny_linear(x, w, scale=torch.ones(8, device=DEVICE, dtype=DTYPE))
    with pytest.raises(ValueError, match="one dtype"):
        skinny.skinny_linear(x, w)  # an int8 weight needs its scale


def test_only_per_row_weight_only_int8_is_taken():
    model = _int8_model()
    found = [m for m in model.modules() if scaled_int8(m) is not None]
    assert len(found) == sum(isinstance(m, torch.nn.Linear) for m in model.modules()) > 0
    dynamic = copy.deepcopy(tiny_model("llama")).to(DEVICE, DTYPE)
    torchao_quantization.quantize_(dynamic, torchao_quantization.Int8DynamicActivationInt8WeightConfig())
    assert not any(scaled_int8(m) for m in dynamic.modules())  # its activations are quantized too: its own path
    assert not any(scaled_int8(m) for m in tiny_model("llama").modules())  # plain weights: the usual kernel


@pytest.fixture
def scaled_calls(monkeypatch):
    calls = []
    real = skinny.skinny_linear

    def counted(x, weight, bias=None, *, config=None, scale=None):
        if scale is not None:
            calls.append((x.numel() // x.shape[-1], tuple(weight.shape)))
        return real(x, weight, bias, config=config, scale=scale)

    monkeypatch.setattr(decode_gemm, "skinny_linear", counted)
    return calls


def test_routed_forward_matches_the_quantized_model(scaled_calls):
    model = _int8_model()
    expected, got = routed_logits(model, scaled_calls)
    layers = model.config.num_hidden_layers
    assert len(scaled_calls) == layers * 7 + 1 and {rows for rows, _ in scaled_calls} == {18}
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_engine_greedy_matches_stock(mode, scaled_calls):
    assert_engine_greedy_matches_stock(_int8_model("qwen3"), mode, scaled_calls)


def test_the_listed_variants_are_the_launched_ones(monkeypatch):
    """The scaled form's variants (what the build compiles ahead) have the keys its launches look up."""
    from hf_async_cb.kernels.variant import jit_key, variant_key

    seen = interpreter_launches(monkeypatch)
    n, k = 64, 128
    for rows in (1, 5, 40):
        x = torch.randn(rows, k, dtype=DTYPE)
        skinny.skinny_linear(x, torch.ones(n, k, dtype=torch.int8), scale=torch.ones(n, dtype=DTYPE))
    launched = {jit_key(kernel, args, kwargs) for kernel, args, kwargs in seen}
    listed = {variant_key(v) for bucket in (1, 8, 64) for v in
              skinny.variants(n, k, DTYPE, False, bucket, {}, SCALED_INT8)}
    assert launched and launched <= listed
