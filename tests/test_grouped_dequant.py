"""Grouped weights rebuilt whole for steps above the skinny GEMM's rows (kernels/grouped_dequant.py): the
weight equals the library's own dequantize bit for bit (HQQ at every packing, quanto's plain 4 and 2 bits,
the tinygemm reading of quanto's bf16 int4 through its copy), a routed projection's step of more than
MAX_M rows multiplies it with cuBLAS (the library's own dequantize-then-matmul result), the engine's
prefill steps take it with stock's tokens, and its variant is listed for compiling ahead. On the CPU the
kernel runs in Triton's interpreter (fp32 and fp16)."""

import copy

import pytest
import torch
from models import hqq_in_place, left_pad, random_prompts, stock_generate, tiny_model
from quantized_checks import engine_launches_and_listing, hqq_linear, quanto_linear

import hf_async_cb.model.decode_gemm as decode_gemm
from hf_async_cb import BatchingConfig
from hf_async_cb.kernels import grouped_dequant
from hf_async_cb.kernels.skinny_gemm import MAX_M
from hf_async_cb.model.decode_gemm import DecodeGemms, hqq_grouped

quantize = pytest.importorskip("hqq.core.quantize")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HALF = torch.float16 if DEVICE == "cpu" else torch.bfloat16  # (the rounding steps show in 16 bits)


def _hqq_linear(n: int, k: int, *, dtype=HALF, **options):
    return hqq_linear(n, k, dtype=dtype, round_zero=False, **options)


def _whole(found) -> torch.Tensor:
    return grouped_dequant.dequantize_grouped(found.packed, found.scale, found.zero, found.group_size, bits=found.bits,
                                              shape=found.shape, dequant=found.dequant)


@pytest.mark.parametrize("nbits, n, k", [(4, 96, 192), (4, 64, 512), (8, 96, 192), (3, 96, 192), (3, 33, 320),
                                         (2, 96, 192), (1.58, 64, 192), (1, 96, 192)])
def test_hqq_weights_rebuilt_whole_bit_for_bit(nbits, n, k):
    """Masked rows (N 96 or 33 at BLOCK_N 64), K not a multiple of BLOCK_K (192, 320), every packing."""
    module = _hqq_linear(n, k, nbits=nbits, seed=int(nbits * 10) + n)
    found = hqq_grouped(module)
    got = _whole(found)
    assert got.dtype == HALF and got.shape == (n, k) and torch.equal(got, module.dequantize())


@pytest.mark.parametrize("weights", ["qint4", "qint2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_quantos_plain_weights_rebuilt_whole_bit_for_bit(weights, dtype):
    quanto = pytest.importorskip("optimum.quanto")
    from hf_async_cb.model.quanto_grouped import quanto_grouped

    module = quanto_linear(96, 256, getattr(quanto, weights), dtype=dtype, seed=2)
    found = quanto_grouped(module)
    assert found is not None and found.dequant == "scale_shift"
    assert torch.equal(_whole(found), module.weight.dequantize())


def test_the_tinygemm_copy_rebuilt_whole_is_tinygemms_reading():
    """quanto's bf16 int4 through its copy: the weights the int4 matmul reads (its product with an
    identity), rebuilt in fp32 on the CPU (the interpreter has no bf16) and rounded to bf16."""
    quanto = pytest.importorskip("optimum.quanto")
    from hf_async_cb.model.quanto_grouped import QuantoCopy, copied_weight

    module = quanto_linear(96, 512, quanto.qint4, dtype=torch.bfloat16, seed=4)
    made = QuantoCopy(module, copied_weight(module))
    made.refresh(made.version(), (0,))
    found = made.grouped
    with torch.no_grad():
        theirs = module(torch.eye(512, dtype=torch.bfloat16, device=DEVICE)).t()
    if DEVICE == "cpu":
        found = found._replace(scale=found.scale.float(), zero=found.zero.float())
    assert torch.equal(_whole(found).to(torch.bfloat16), theirs)


@pytest.fixture
def dense_calls(monkeypatch):
    calls = []
    real = decode_gemm.dequantize_grouped

    def counted(packed, *args, **kwargs):
        calls.append(tuple(packed.shape))
        return real(packed, *args, **kwargs)

    monkeypatch.setattr(decode_gemm, "dequantize_grouped", counted)
    return calls


@pytest.mark.parametrize("bias", [False, True])
def test_a_routed_step_above_max_m_rows_is_the_librarys_own_product(bias, dense_calls):
    """HQQ's own forward: matmul(x, dequantize().t()), the bias added after; routed, a step of 300 rows
    rebuilds the weight once and gives that product (the same weights and GEMM); 200 rows take the
    skinny GEMM."""
    module = _hqq_linear(64, 128, bias=bias, dtype=torch.float32, seed=5)
    model = torch.nn.Sequential(module)
    x = torch.randn(3, 100, 128, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    with torch.no_grad():
        expected = module(x)
        gemms = DecodeGemms(model, None)
        gemms.attach()
        try:
            got = module(x)
            small = module(x[:2])
        finally:
            gemms.detach()
    assert dense_calls == [(32, 128)] and 300 > MAX_M >= 200
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    assert small.shape == (2, 100, 64)


def test_off_the_switch_the_librarys_forward_runs(dense_calls, monkeypatch):
    monkeypatch.setattr(decode_gemm, "GROUPED_DENSE_ABOVE_MAX_M", False)
    module = _hqq_linear(64, 128, dtype=torch.float32)
    gemms = DecodeGemms(torch.nn.Sequential(module), None)
    gemms.attach()
    try:
        with torch.no_grad():
            module(torch.randn(300, 128, device=DEVICE))
    finally:
        gemms.detach()
    assert dense_calls == []


def _quantized_model(kind: str) -> torch.nn.Module:
    model = copy.deepcopy(tiny_model("llama")).to(DEVICE, torch.float32)
    if kind.startswith("hqq"):
        return hqq_in_place(model, quantize, nbits=int(kind[3:]))
    quanto = pytest.importorskip("optimum.quanto")
    quanto.quantize(model, weights=getattr(quanto, kind))
    quanto.freeze(model)
    return model


@pytest.mark.parametrize("kind, mode", [("hqq4", "sync"), ("hqq4", "async"), ("hqq3", "async"), ("qint4", "sync"),
                                        ("qint2", "async")])
def test_prefill_steps_above_max_m_rows_give_stocks_tokens(kind, mode, dense_calls):
    """HQQ at 4 bits, and at 3 through its 4-bit copies; quanto's plain 4- and 2-bit tensors."""
    model = _quantized_model(kind)
    prompts = random_prompts(4, 100, 160, seed=7)  # one prefill step of ~500 tokens
    expected = stock_generate(model, prompts, max_new_tokens=5)
    ids, mask = (t.to(DEVICE) for t in left_pad(prompts))
    config = BatchingConfig(page_size=16, max_batch_tokens=1024, skinny_gemm=True)
    got = model.generate(ids, attention_mask=mask, batching=mode, batching_config=config, max_new_tokens=5)
    assert torch.equal(got.cpu(), expected.cpu())
    assert dense_calls  # (the prefill step went through the whole weights)


def test_an_engine_lists_the_whole_weight_variants(monkeypatch):
    """Every launch of the rebuild in an engine's prefill steps above MAX_M rows is a listed variant."""
    from hf_async_cb import Engine
    from hf_async_cb.engine import engine as engine_module
    from hf_async_cb.kernels.model_variants import facts_of, model_variants
    from hf_async_cb.kernels.variant import jit_key, variant_key

    model = hqq_in_place(copy.deepcopy(tiny_model("llama")).to(DEVICE, torch.float32), quantize)
    if DEVICE != "cpu":
        pytest.skip("records the interpreter's launches")
    seen, _, _ = engine_launches_and_listing(monkeypatch, model, kernels=(grouped_dequant._dequantize_grouped_kernel,))
    assert seen == []  # (those steps are small: nothing rebuilt whole)
    listed = set()
    monkeypatch.setattr(engine_module, "precompile",
                        lambda engine, model, ahead=None: listed.update(variant_key(v) for v in
                                                                       model_variants(facts_of(engine, model))))
    from quantized_checks import interpreter_launches

    launches = interpreter_launches(monkeypatch)
    with Engine(model, BatchingConfig(page_size=16, max_batch_tokens=1024, skinny_gemm=True, mode="sync")) as engine:
        engine.generate(random_prompts(3, 120, 140, seed=3), max_new_tokens=2)
    keys = {jit_key(k, a, kw) for k, a, kw in launches if k is grouped_dequant._dequantize_grouped_kernel}
    assert keys and keys <= listed


def test_the_whole_weight_rebuild_compiles_for_sm90():
    """In bf16 for an H200, without a GPU: every rule at 4 bits, 3 and 2 bits, even and masked tiles."""
    from sm90 import assert_compiles_for_sm90

    from hf_async_cb.kernels.skinny_gemm_forms import GROUPED_DEQUANTS

    kernels = []
    for bits, dequant, n, k in [(4, rule, 4096, 4096) for rule in GROUPED_DEQUANTS] + [(3, "hqq", 4096, 14336),
                                                                                      (2, "scale_shift", 96, 320)]:
        constexprs = grouped_dequant._constexprs(n, k, 64, bits, dequant)
        sig = {"w_ptr": "*i32" if bits == 3 else "*u8", "s_ptr": "*bf16", "z_ptr": "*bf16", "out_ptr": "*bf16",
               "N": "i32", "K": "i32", "row0": "i32"}
        kernels.append(("hf_async_cb.kernels.grouped_dequant", "_dequantize_grouped_kernel", sig, constexprs,
                        dict(num_warps=4, divisible_by_16=["w_ptr", "s_ptr", "z_ptr", "out_ptr", "N", "K"])))
    assert_compiles_for_sm90(kernels)


def test_rows_of_the_weight_rebuilt_alone():
    module = _hqq_linear(160, 192, nbits=4, seed=8)
    found, whole = hqq_grouped(module), module.dequantize()
    for rows in [(0, 64), (64, 160), (128, 160)]:
        got = grouped_dequant.dequantize_grouped(found.packed, found.scale, found.zero, 64, bits=4, shape=found.shape,
                                                 dequant="hqq", rows=rows)
        assert torch.equal(got, whole[rows[0]:rows[1]])
    for rows in [(32, 64), (0, 100), (64, 64), (0, 192)]:
        with pytest.raises(ValueError, match="rows"):
            grouped_dequant.dequantize_grouped(found.packed, found.scale, found.zero, 64, bits=4, shape=found.shape,
                                               dequant="hqq", rows=rows)


def test_a_large_weight_is_rebuilt_in_slices(dense_calls, monkeypatch):
    """Above REBUILT_ELEMENTS weights (a quantized lm_head) the rebuild goes slice by slice of rows, with
    the same product."""
    monkeypatch.setattr(decode_gemm, "REBUILT_ELEMENTS", 64 * 128)
    module = _hqq_linear(160, 128, dtype=torch.float32, bias=True, seed=6)
    x = torch.randn(300, 128, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    gemms = DecodeGemms(torch.nn.Sequential(module), None)
    with torch.no_grad():
        expected = module(x)
        gemms.attach()
        try:
            got = module(x)
        finally:
            gemms.detach()
    assert dense_calls == [(80, 128)] * 3  # rows 0-64, 64-128, 128-160
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
