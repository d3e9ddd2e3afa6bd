"""torchao's float8 weight-only projections (Float8WeightOnlyConfig: float8_e4m3fn data and one float32
scale per output row) through the skinny GEMM's pre-scaled form with float32 scales: the kernel rebuilds
every weight as torchao's dequantize does (`data.float() * scale`, rounded to the compute dtype, before
the matmul; the bias added to the rounded product), its compiled variants are the ones listed for
compiling ahead, and a float8 model routed through it gives stock's logits and greedy tokens (on the CPU
the kernel runs in Triton's interpreter: fp32, and fp16 for the rounding of the scaled weights)."""

import copy

import pytest
import torch
from models import tiny_model
from quantized_checks import (assert_engine_greedy_matches_stock, engine_launches_and_listing, interpreter_launches,
                              routed_logits)

import hf_async_cb.kernels.skinny_gemm as skinny
import hf_async_cb.model.decode_gemm as decode_gemm
from hf_async_cb.kernels.skinny_gemm_forms import WeightForm
from hf_async_cb.model.decode_gemm import DecodeGemms, torchao_float8

ao = pytest.importorskip("torchao.quantization")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32
SIXTEEN = torch.float16 if DEVICE == "cpu" else torch.bfloat16  # (the interpreter has no bf16)
SMALL = dict(BLOCK_N=16, BLOCK_K=32, num_warps=4, num_stages=2, SWAP_AB=False)
WIDE = WeightForm(torch.float8_e4m3fn, prescaled=True, scale_dtype=torch.float32)


def _float8(module: torch.nn.Module, granularity=None) -> torch.nn.Module:
    """Float8WeightOnlyConfig's weights (one scale per row); another granularity is built by
    Float8Tensor itself, as torchao 0.17's config has no `granularity` to ask for it."""
    if granularity is None:
        # set_inductor_config=False: torchao's default turns TF32 on for the whole process
        ao.quantize_(module, ao.Float8WeightOnlyConfig(set_inductor_config=False))
        return module
    from torchao.quantization.quantize_.workflows import Float8Tensor

    for linear in module.modules():
        if isinstance(linear, torch.nn.Linear):
            weight = Float8Tensor.from_hp(linear.weight.detach(), granularity=granularity)
            linear.weight = torch.nn.Parameter(weight, requires_grad=False)
    return module


def _linear(n: int, k: int, *, bias=False, dtype=DTYPE, seed=0, granularity=None) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return _float8(torch.nn.Sequential(torch.nn.Linear(k, n, bias=bias)).to(DEVICE, dtype), granularity)[0]


def _full_scales(module: torch.nn.Linear, seed: int) -> torch.nn.Linear:
    """Scales with every fp32 mantissa bit in use (torchao's own, amax / 448 of 16-bit weights, round
    alike in 16 bits almost always), so that rounding them first would change many weights."""
    w = module.weight
    g = torch.Generator().manual_seed(seed)
    w.scale.copy_(((1 + torch.rand(w.scale.shape, generator=g)) / 256).to(DEVICE))
    return module


def _model(family: str = "llama") -> torch.nn.Module:
    return _float8(copy.deepcopy(tiny_model(family)).to(DEVICE, DTYPE))


@pytest.mark.parametrize("split", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, SIXTEEN])
def test_kernel_rebuilds_torchaos_weights_exactly(dtype, split):
    """x = the identity: every output is one rebuilt weight times 1 (plus exact zeros), so the kernel's
    weights come out as they are and must equal torchao's dequantize() bit for bit. N = 40, K = 48:
    masked columns, a masked K tail, split-K."""
    module = _full_scales(_linear(40, 48, dtype=dtype, seed=split), seed=split)
    found = torchao_float8(module)
    assert found is not None and found.scale.dtype == torch.float32
    eye = torch.eye(48, dtype=dtype, device=DEVICE)
    got = skinny.skinny_linear(eye, found.data, row_scale=found.scale, config=dict(SMALL, SPLIT_K=split))
    assert got.dtype == dtype and torch.equal(got.t(), module.weight.dequantize())


def test_the_float32_scales_matter():
    """Scales rounded to 16 bits first (the pre-scaled form's quanto rounding) give other weights than
    torchao's on the test above's modules, so it tells the two apart."""
    module = _full_scales(_linear(40, 48, dtype=SIXTEEN, seed=1), seed=1)
    w = module.weight
    narrow = w.qdata.to(SIXTEEN) * w.scale.to(SIXTEEN)
    assert (narrow != w.dequantize()).any()


def test_kernel_takes_float32_scales_and_no_others():
    x = torch.randn(2, 32, device=DEVICE, dtype=SIXTEEN)
    w = torch.zeros(16, 32, dtype=torch.float8_e4m3fn, device=DEVICE)
    assert skinny.skinny_linear(x, w, row_scale=torch.ones(16, device=DEVICE)).dtype == SIXTEEN
    with pytest.raises(ValueError, match="row_scale"):
        skinny.skinny_linear(x, w, row_scale=torch.ones(16, device=DEVICE, dtype=torch.float64))
    with pytest.raises(ValueError, match="no skinny GEMM weight form"):
        WeightForm(torch.int8, scale_dtype=torch.float32)  # the scaled int8 form takes x's dtype alone


def test_which_float8_modules_are_taken():
    taken = torchao_float8(_linear(32, 64))
    assert taken is not None and taken.data.dtype == torch.float8_e4m3fn and taken.dtype == DTYPE
    assert torchao_float8(_linear(32, 64, bias=True)).bias is not None  # added to the rounded product
    assert torchao_float8(_linear(32, 64, granularity=ao.PerTensor())) is None  # one scale for the whole weight
    module = _linear(32, 64)
    module.weight.act_quant_kwargs = object()  # (dynamic activation quantization: CUDA sm_89+ only)
    assert torchao_float8(module) is None
    assert torchao_float8(torch.nn.Linear(64, 32)) is None
    model = _model()
    found = [m for m in model.modules() if torchao_float8(m) is not None]
    count = model.config.num_hidden_layers * 7 + 1  # (and lm_head)
    assert len(found) == count
    assert f"{count} torchao float8 projections read as float8" in DecodeGemms(model, None).summary()


@pytest.fixture
def prescaled_calls(monkeypatch):
    calls = []
    real = skinny.skinny_linear

    def counted(x, weight, bias=None, *, config=None, scale=None, row_scale=None):
        if row_scale is not None:
            calls.append((x.numel() // x.shape[-1], tuple(weight.shape)))
        return real(x, weight, bias, config=config, scale=scale, row_scale=row_scale)

    monkeypatch.setattr(decode_gemm, "skinny_linear", counted)
    return calls


def test_routed_forward_matches_the_float8_model(prescaled_calls):
    model = _model()
    expected, got = routed_logits(model, prescaled_calls)
    assert len(prescaled_calls) == model.config.num_hidden_layers * 7 + 1
    assert {rows for rows, _ in prescaled_calls} == {18}
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_routed_forward_with_bias(prescaled_calls):
    module = _linear(64, 128, bias=True, dtype=SIXTEEN)
    with torch.no_grad():
        module.bias.uniform_(-1, 1)
    x = torch.randint(-1, 2, (2, 3, 128), generator=torch.Generator().manual_seed(3)).to(DEVICE, SIXTEEN)
    with torch.no_grad():
        expected = module(x)
        gemms = DecodeGemms(torch.nn.Sequential(module), None)
        gemms.attach()
        try:
            got = module(x)
        finally:
            gemms.detach()
    assert prescaled_calls == [(6, (64, 128))]
    torch.testing.assert_close(got, expected, rtol=2e-3, atol=2e-3)  # fp16 sums in another order


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_engine_greedy_matches_stock(mode, prescaled_calls):
    assert_engine_greedy_matches_stock(_model("llama"), mode, prescaled_calls)


def test_the_listed_variants_are_the_launched_ones(monkeypatch):
    """The form with float32 scales under 16-bit activations (what the build compiles ahead for a bf16
    model) has the keys its launches look up, split-K (K = 512 at 1 and 5 rows) and not (40 rows)."""
    from hf_async_cb.kernels.variant import jit_key, variant_key

    seen = interpreter_launches(monkeypatch)
    n, k = 64, 512
    for rows in (1, 5, 40):
        x = torch.randn(rows, k, dtype=SIXTEEN)
        skinny.skinny_linear(x, torch.ones(n, k).to(torch.float8_e4m3fn), row_scale=torch.ones(n))
    launched = {jit_key(kernel, args, kwargs) for kernel, args, kwargs in seen}
    listed = {variant_key(v) for bucket in (1, 8, 64) for v in skinny.variants(n, k, SIXTEEN, False, bucket, {}, WIDE)}
    narrow = {variant_key(v) for bucket in (1, 8, 64) for v in skinny.variants(
        n, k, SIXTEEN, False, bucket, {}, WeightForm(torch.float8_e4m3fn, prescaled=True))}
    gemm = {jit_key(kernel, args, kwargs) for kernel, args, kwargs in seen if kernel is skinny._skinny_gemm_kernel}
    assert launched and launched <= listed and gemm and not gemm & narrow  # (the split-K reduction is shared)
    assert any(kernel is skinny._splitk_reduce_kernel for kernel, _, _ in seen)


def test_a_16_bit_model_lists_the_float32_scaled_form():
    from types import SimpleNamespace

    from hf_async_cb.kernels import model_variants

    model = _float8(copy.deepcopy(tiny_model("llama")).to(DEVICE, SIXTEEN))
    gemms = DecodeGemms(model, None)
    engine = SimpleNamespace(prepared_model=SimpleNamespace(decode_gemms=gemms, elementwise=None),
                             config=SimpleNamespace(page_size=16), _model_config=model.config, attention_backend="sdpa",
                             device=torch.device(DEVICE), dtype=SIXTEEN, vocab_size=256)
    forms = {g.form for g in model_variants.facts_of(engine, model).gemms}
    assert forms == {WIDE}


def test_an_engine_lists_every_float8_launch(monkeypatch):
    seen, launched, listed = engine_launches_and_listing(monkeypatch, _model())
    assert any(kwargs.get("PRESCALED") for _, _, kwargs in seen)
    assert launched and launched <= listed


def test_float32_scaled_form_compiles_for_sm90():
    """The form with bf16 activations, float8 weights and float32 scales (plain, split-K with a masked K
    tail) builds for an H200 without a GPU."""
    from sm90 import assert_compiles_for_sm90

    sig = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "out_ptr": "*bf16", "s_ptr": "*fp32",
           "z_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32", "k_per_split": "i32", "stride_xm": "i32"}
    aligned = ["x_ptr", "w_ptr", "b_ptr", "out_ptr", "s_ptr", "z_ptr", "N", "K", "k_per_split", "stride_xm"]
    kernels = []
    for split, even_k in ((1, True), (4, False)):
        c = skinny._config(32, 4096, 4096, torch.bfloat16, torch.float8_e4m3fn, 132, dict(SPLIT_K=split), 0)
        kernels.append(("hf_async_cb.kernels.skinny_gemm", "_skinny_gemm_kernel",
                        dict(sig, out_ptr="*fp32") if split > 1 else sig,
                        dict(BLOCK_M=32, BLOCK_N=c["BLOCK_N"], BLOCK_K=c["BLOCK_K"], SPLIT_K=split, EVEN_K=even_k,
                             EVEN_N=True, HAS_BIAS=False, SWAP_AB=False, IEEE=False, SCALED=False, GROUP=0,
                             PRESCALED=True, CODEBOOK=0, BITS=4, DEQUANT=0),
                        dict(num_warps=c["num_warps"], num_stages=c["num_stages"], divisible_by_16=aligned)))
    assert max(assert_compiles_for_sm90(kernels)) <= 227 * 1024
