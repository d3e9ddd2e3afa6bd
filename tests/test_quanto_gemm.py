"""optimum-quanto 8-bit projections (a frozen QLinear of qint8, or qfloat8_e4m3fn, weights: 8-bit data and
one scale per output row) through the skinny GEMM's pre-scaled form: the kernel rounds every weight as
quanto's qbytes_mm does (`scale * weight.to(dtype)`, rounded to the dtype, before the matmul; the bias
added to the rounded product), its compiled variants are the ones listed for compiling ahead, and a
quanto model routed through it gives stock's logits and greedy tokens (on the CPU the kernel runs in
Triton's interpreter: fp32, and fp16 for the rounding of the scaled weights)."""

import copy

import pytest
import torch
from models import tiny_model
from quantized_checks import (assert_engine_greedy_matches_stock, engine_launches_and_listing, interpreter_launches,
                              quanto_linear, routed_logits)

import hf_async_cb.kernels.skinny_gemm as skinny
import hf_async_cb.model.decode_gemm as decode_gemm
from hf_async_cb.kernels.skinny_gemm_forms import WeightForm
from hf_async_cb.model.decode_gemm import DecodeGemms, quanto_bytes

quanto = pytest.importorskip("optimum.quanto")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32
SIXTEEN = torch.float16 if DEVICE == "cpu" else torch.bfloat16  # (the interpreter has no bf16)
SMALL = dict(BLOCK_N=16, BLOCK_K=32, num_warps=4, num_stages=2, SWAP_AB=False)
WEIGHTS = [torch.int8, torch.float8_e4m3fn]


def _weights(n: int, k: int, weight_dtype: torch.dtype, dtype: torch.dtype, seed: int):
    """Integer weights of at most 127 (int8) or 15 (exact in float8_e4m3fn) and scales in [2^-8, 2^-7):
    every scaled weight, rounded to 16 bits, is a multiple of 2^-18 under 1, so sums of up to 64 of
    them times -1, 0 or 1 are exact in fp32 in any order (the kernel's sums equal the formula's)."""
    g = torch.Generator().manual_seed(seed)
    top = 127 if weight_dtype == torch.int8 else 15
    w = torch.randint(-top, top + 1, (n, k), generator=g).to(weight_dtype)
    scale = ((1 + torch.rand(n, 1, generator=g)) / 256).to(dtype)
    x = lambda rows: torch.randint(-1, 2, (rows, k), generator=g).to(dtype)  # noqa: E731
    return w.to(DEVICE), scale.to(DEVICE), x


def _formula(x, w, scale, bias=None):
    """quanto's qbytes_mm (the CUDA path, and the CPU's in fp32): the weights scaled, rounded, then the matmul."""
    out = torch.matmul(x, (scale * w.to(scale.dtype)).t())
    return out if bias is None else out + bias


def _quanto_linear(n: int, k: int, *, weights=None, dtype=DTYPE, **options):
    return quanto_linear(n, k, weights or quanto.qint8, dtype=dtype, **options)


def _quanto_model(family: str = "llama", weights=None) -> torch.nn.Module:
    model = copy.deepcopy(tiny_model(family)).to(DEVICE, DTYPE)
    quanto.quantize(model, weights=weights or quanto.qint8)
    quanto.freeze(model)
    return model


@pytest.mark.parametrize("split", [1, 2])
@pytest.mark.parametrize("rows", [1, 17])
@pytest.mark.parametrize("weight_dtype", WEIGHTS)
@pytest.mark.parametrize("dtype", [torch.float32, SIXTEEN])
def test_prescaled_kernel_equals_quantos_formula(dtype, weight_dtype, rows, split):
    """N = 40 and K = 48 (masked columns, a masked K tail, split-K): bit for bit in 16 bits (the sums
    are exact there, see _weights), to fp32's summation order in fp32."""
    w, scale, x_of = _weights(40, 48, weight_dtype, dtype, seed=rows + split)
    x = x_of(rows).to(DEVICE)
    expected = _formula(x, w, scale)
    got = skinny.skinny_linear(x, w, row_scale=scale.reshape(-1), config=dict(SMALL, SPLIT_K=split))
    assert got.dtype == dtype and got.shape == expected.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    else:
        assert torch.equal(got, expected)


@pytest.mark.parametrize("weight_dtype", WEIGHTS)
def test_the_rounding_steps_matter(weight_dtype):
    """In 16 bits, the scale applied after the product (the scaled int8 form's rounding) gives other
    outputs than quanto's pre-scaled weights on these inputs (so the test above tells them apart)."""
    w, scale, x_of = _weights(40, 48, weight_dtype, SIXTEEN, seed=3)
    x = x_of(17).to(DEVICE)
    after = torch.matmul(x, w.to(SIXTEEN).t()) * scale.t()
    assert (after != _formula(x, w, scale)).any()


def test_kernel_refuses_what_it_does_not_take():
    x = torch.randn(2, 32, device=DEVICE, dtype=DTYPE)
    w = torch.zeros(16, 32, dtype=torch.int8, device=DEVICE)
    ones = torch.ones(16, device=DEVICE, dtype=DTYPE)
    with pytest.raises(ValueError, match="row_scale"):
        skinny.skinny_linear(x, w, ones, row_scale=ones)  # quanto adds the bias to the rounded product
    with pytest.raises(ValueError, match="row_scale"):
        skinny.skinny_linear(x, w, row_scale=ones[:8])
    with pytest.raises(ValueError, match="row_scale"):
        skinny.skinny_linear(x, w.to(DTYPE), row_scale=ones)
    with pytest.raises(ValueError, match="row_scale"):
        skinny.skinny_linear(x, w, row_scale=ones.to(torch.float16 if DTYPE != torch.float16 else torch.float32))


def test_which_quanto_modules_are_taken():
    taken = quanto_bytes(_quanto_linear(32, 64))
    assert taken is not None and taken.data.dtype == torch.int8 and taken.data.shape == (32, 64)
    assert taken.scale.shape == (32,) and taken.scale.dtype == DTYPE and taken.bias is None
    assert quanto_bytes(_quanto_linear(32, 64, bias=True)).bias is not None  # added to the rounded product
    fp8 = quanto_bytes(_quanto_linear(32, 64, weights=quanto.qfloat8))
    if DEVICE == "cpu":  # (on CUDA quanto may pick its Marlin fp8 tensor: its own kernel, not taken)
        assert fp8 is not None and fp8.data.dtype == torch.float8_e4m3fn
    assert quanto_bytes(_quanto_linear(32, 64, frozen=False)) is None  # quantizes its float weight every call
    assert quanto_bytes(_quanto_linear(32, 64, weights=quanto.qint4)) is None
    assert quanto_bytes(_quanto_linear(32, 64, weights=quanto.qint2)) is None
    assert quanto_bytes(_quanto_linear(32, 64, weights=quanto.qfloat8_e5m2)) is None
    assert quanto_bytes(_quanto_linear(32, 64, activations=quanto.qint8)) is None  # quantized activations
    module = _quanto_linear(32, 64)
    module.bias = torch.nn.Parameter(torch.zeros(32, dtype=torch.float64, device=DEVICE))  # quanto would promote
    assert quanto_bytes(module) is None
    assert quanto_bytes(torch.nn.Linear(64, 32)) is None
    assert not any(quanto_bytes(m) for m in tiny_model("llama").modules())  # plain weights: the usual kernel
    model = _quanto_model()
    found = [m for m in model.modules() if quanto_bytes(m) is not None]
    count = model.config.num_hidden_layers * 7 + 1  # (and lm_head)
    assert len(found) == count
    assert f"{count} quanto int8 projections read as int8" in DecodeGemms(model, None).summary()


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


@pytest.mark.parametrize("weights", ["qint8", "qfloat8"])
def test_routed_forward_matches_the_quantized_model(weights, prescaled_calls):
    model = _quanto_model(weights=getattr(quanto, weights))
    expected, got = routed_logits(model, prescaled_calls)
    layers = model.config.num_hidden_layers
    if weights == "qint8" or DEVICE == "cpu":
        assert len(prescaled_calls) == layers * 7 + 1 and {rows for rows, _ in prescaled_calls} == {18}
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_routed_forward_with_bias(prescaled_calls):
    module = _quanto_linear(64, 128, bias=True)
    with torch.no_grad():
        module.bias.uniform_(-1, 1)
    x = torch.randn(2, 3, 128, generator=torch.Generator().manual_seed(3)).to(DEVICE, DTYPE)
    with torch.no_grad():
        expected = module(x)
        gemms = DecodeGemms(torch.nn.Sequential(module), None)
        gemms.attach()
        try:
            got = module(x)
        finally:
            gemms.detach()
    assert prescaled_calls == [(6, (64, 128))]
    formula = _formula(x.reshape(-1, 128), module.weight._data, module.weight._scale, module.bias).reshape(2, 3, 64)
    torch.testing.assert_close(got, formula, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_engine_greedy_matches_stock(mode, prescaled_calls):
    assert_engine_greedy_matches_stock(_quanto_model("llama"), mode, prescaled_calls)


def test_the_listed_variants_are_the_launched_ones(monkeypatch):
    """The pre-scaled form's variants (what the build compiles ahead) have the keys its launches look
    up, int8 and float8, split-K (K = 512 at 1 and 5 rows) and not (40 rows) alike."""
    from hf_async_cb.kernels.variant import jit_key, variant_key

    seen = interpreter_launches(monkeypatch)
    n, k = 64, 512
    for weight_dtype in WEIGHTS:
        seen.clear()
        for rows in (1, 5, 40):
            x = torch.randn(rows, k, dtype=DTYPE)
            skinny.skinny_linear(x, torch.ones(n, k).to(weight_dtype), row_scale=torch.ones(n, dtype=DTYPE))
        launched = {jit_key(kernel, args, kwargs) for kernel, args, kwargs in seen}
        listed = {variant_key(v) for bucket in (1, 8, 64) for v in
                  skinny.variants(n, k, DTYPE, False, bucket, {}, WeightForm(weight_dtype, prescaled=True))}
        assert launched and launched <= listed
        assert any(kernel is skinny._splitk_reduce_kernel for kernel, _, _ in seen)
        assert all(kwargs["PRESCALED"] and not kwargs["SCALED"] for kernel, _, kwargs in seen
                   if kernel is skinny._skinny_gemm_kernel)
        assert not any(kwargs["SCALED"] for kernel, _, kwargs in seen if kernel is skinny._splitk_reduce_kernel)


def test_model_variants_list_the_quanto_projections():
    """facts_of lists every quanto projection's pre-scaled variants at every rows bucket."""
    from types import SimpleNamespace

    from hf_async_cb.kernels import model_variants

    model = _quanto_model()
    gemms = DecodeGemms(model, None)
    shapes = {(p.n, p.k) for p in gemms.kernel_picks() if p.form.prescaled}
    assert shapes == {(64, 64), (32, 64), (128, 64), (64, 128), (256, 64)}  # q/o, k/v, gate/up, down, lm_head
    engine = SimpleNamespace(prepared_model=SimpleNamespace(decode_gemms=gemms, elementwise=None),
                             config=SimpleNamespace(page_size=16), _model_config=model.config, attention_backend="sdpa",
                             device=torch.device(DEVICE), dtype=DTYPE, vocab_size=256)
    facts = model_variants.facts_of(engine, model)
    prescaled = [g for g in facts.gemms if g.form == WeightForm(torch.int8, prescaled=True)]
    assert {(g.n, g.k) for g in prescaled} == shapes
    assert {g.bucket for g in prescaled} == {1 << i for i in range(9)}
    listed = model_variants.model_variants(facts)
    assert {(v.args[7], v.args[8]) for v in listed if v.constexprs.get("PRESCALED")} == shapes


def test_an_engine_lists_every_prescaled_launch(monkeypatch):
    """What an engine on a quanto int8 model hands the precompile (model_variants of its facts, at that
    point of its build) covers every skinny GEMM launch its decode steps make, at several batch sizes."""
    seen, launched, listed = engine_launches_and_listing(monkeypatch, _quanto_model())
    assert any(kwargs.get("PRESCALED") for _, _, kwargs in seen)
    assert launched and launched <= listed


def test_prescaled_form_compiles_for_sm90():
    """The pre-scaled form in bf16, int8 and float8 weights (plain, SWAP_AB, split-K with a masked K
    tail and its unscaled reduction) builds for an H200 without a GPU."""
    from sm90 import assert_compiles_for_sm90

    kernels = []
    for w in ("*i8", "*fp8e4nv"):
        sig = {"x_ptr": "*bf16", "w_ptr": w, "b_ptr": w, "out_ptr": "*bf16", "s_ptr": "*bf16", "z_ptr": "*bf16",
               "M": "i32", "N": "i32", "K": "i32", "k_per_split": "i32", "stride_xm": "i32"}
        aligned = ["x_ptr", "w_ptr", "b_ptr", "out_ptr", "s_ptr", "z_ptr", "N", "K", "k_per_split", "stride_xm"]
        for split, swap, even_k in ((1, False, True), (1, True, True), (4, False, False)):
            c = skinny._config(32, 4096, 4096, torch.bfloat16, torch.int8, 132, dict(SPLIT_K=split, SWAP_AB=swap), 0)
            kernels.append(("hf_async_cb.kernels.skinny_gemm", "_skinny_gemm_kernel",
                            dict(sig, out_ptr="*fp32") if split > 1 else sig,
                            dict(BLOCK_M=32, BLOCK_N=c["BLOCK_N"], BLOCK_K=c["BLOCK_K"], SPLIT_K=split, EVEN_K=even_k,
                                 EVEN_N=True, HAS_BIAS=False, SWAP_AB=swap, IEEE=False, SCALED=False, GROUP=0,
                                 PRESCALED=True, CODEBOOK=0, BITS=4, DEQUANT=0),
                            dict(num_warps=c["num_warps"], num_stages=c["num_stages"], divisible_by_16=aligned)))
    reduce = {"part_ptr": "*fp32", "b_ptr": "*fp32", "out_ptr": "*bf16", "s_ptr": "*fp32", "total": "i32", "N": "i32"}
    kernels.append(("hf_async_cb.kernels.skinny_gemm", "_splitk_reduce_kernel", reduce,
                    dict(SPLIT_K=4, BLOCK=1024, HAS_BIAS=False, SCALED=False)))
    shared = assert_compiles_for_sm90(kernels)
    assert max(shared) <= 227 * 1024
