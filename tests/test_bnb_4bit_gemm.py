"""bitsandbytes' 4-bit projections (Linear4bit, nf4 or fp4: two 4-bit codes a byte along the input
dimension, a float32 absmax per block of weights, itself 8-bit quantized with compress_statistics)
through the skinny GEMM's codebook 4-bit form: the kernel rebuilds every weight as bitsandbytes'
dequantize_4bit rounds it (code[q] * absmax in fp32, rounded to the dtype the weight was quantized
from, then to x's), the picker takes what Linear4bit's forward computes and leaves the rest (hooks,
the CPU's repacked layout, blocks over 256) to that forward, a 4-bit model routed through it gives
its own forward's logits and stock's greedy tokens, and its compiled variants are the ones listed
for compiling ahead (on the CPU the kernel runs in Triton's interpreter: fp32, and fp16 for the
rounding of the rebuilt weights; the interpreter converts fp32 to bf16 by truncation, where the GPU
rounds to nearest, so bf16 is the GPU's).

On a CPU with AVX512-BF16, Linear4bit's first forward in eval mode repacks its weight into a layout
of its own (quant_state.packing_format_for_cpu) and computes in bf16 from then on; the picker leaves
such a module to its forward. Every module here but the one showing that is built or loaded with
support_avx512bf16_for_cpu off, so that its own forward (the oracle) keeps the canonical layout.

On CUDA the engine routes Linear4bit modules through the form only at the rows buckets in
decode_gemm.BNB_4BIT_CUDA_BUCKETS (where it beat bitsandbytes' own path): the tests route every
bucket, to check the form wherever it could run."""

import pytest
import torch
from models import tiny_model
from quantized_checks import (assert_engine_greedy_matches_stock, engine_launches_and_listing, interpreter_launches,
                              routed_logits)

import hf_async_cb.kernels.skinny_gemm as skinny
import hf_async_cb.model.decode_gemm as decode_gemm
from hf_async_cb.kernels.skinny_gemm_forms import WeightForm
from hf_async_cb.model.decode_gemm import DecodeGemms, bnb_4bit

bnb = pytest.importorskip("bitsandbytes")
import bitsandbytes.functional as bnb_functional  # noqa: E402
import transformers  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32
SIXTEEN = torch.float16 if DEVICE == "cpu" else torch.bfloat16  # (the interpreter has no bf16)


def _canonical(module: torch.nn.Module) -> torch.nn.Module:
    """`module` with every Linear4bit kept in bitsandbytes' canonical layout on the CPU (see above)."""
    for m in module.modules():
        if isinstance(m, bnb.nn.Linear4bit):
            m.support_avx512bf16_for_cpu = False
    return module


def _linear4bit(n: int, k: int, *, quant_type="nf4", nested=False, blocksize=64, source=torch.float32,
                compute_dtype=DTYPE, bias=False, seed=0, cls=None, storage=torch.uint8,
                canonical=True) -> torch.nn.Module:
    """A Linear4bit as bitsandbytes builds one: the module, a `source`-dtype weight put in as
    Params4bit, quantized when moved to its device (Params4bit.to), in eval mode."""
    torch.manual_seed(seed)
    if cls is None:
        module = bnb.nn.Linear4bit(k, n, bias=bias, compute_dtype=compute_dtype, quant_type=quant_type,
                                   compress_statistics=nested)
    else:
        module = cls(k, n, bias=bias, compute_dtype=compute_dtype, compress_statistics=nested)
        quant_type = module.weight.quant_type
    weight = torch.randn(n, k).to(source)
    module.weight = bnb.nn.Params4bit(weight, requires_grad=False, quant_type=quant_type, blocksize=blocksize,
                                      compress_statistics=nested, quant_storage=storage, module=module)
    if bias:
        module.bias = torch.nn.Parameter(torch.empty(n).uniform_(-1, 1).to(compute_dtype or torch.float32),
                                         requires_grad=False)
    module = module.to(DEVICE).eval()
    assert module.weight.dtype == storage and module.weight.quant_state.dtype == source
    return _canonical(module) if canonical else module


def _assert_close_up_to_rounding(got: torch.Tensor, expected: torch.Tensor) -> None:
    """A routed forward beside bitsandbytes' own: equal up to summation order and where the product is
    rounded to x's dtype. In bf16 on CUDA bitsandbytes rounds the product before adding the bias (its
    GEMV at one row) and cuBLAS may reduce in bf16, so an output that cancels to near zero can be a
    few bf16 ulps of the outputs' magnitude away (H200: up to 0.094 in the tests here): the
    tolerance counts 4 such ulps. A misread weight is off by far more, in most outputs."""
    if DTYPE == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
        return
    scale = expected.abs().max().item()
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=max(2e-2, 4 * 2 ** -8 * scale))


@pytest.fixture(autouse=True)
def routed_on_cuda(monkeypatch):
    monkeypatch.setattr(decode_gemm, "BNB_4BIT_CUDA_BUCKETS", frozenset(1 << i for i in range(9)))


@pytest.fixture(scope="module")
def saved_llama(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("llama")
    tiny_model("llama").save_pretrained(path)
    return str(path)


def _bnb_model(path: str, quant_type="nf4", nested=False, dtype=DTYPE, compute_dtype=DTYPE) -> torch.nn.Module:
    """The tiny Llama loaded in 4-bit through transformers' BitsAndBytesConfig (the lm_head stays plain)."""
    quantization = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant_type,
                                                   bnb_4bit_use_double_quant=nested,
                                                   bnb_4bit_compute_dtype=compute_dtype)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, quantization_config=quantization,
                                                              device_map=DEVICE, dtype=dtype)
    return _canonical(model.eval())


def _rebuilt(found, n: int, k: int) -> torch.Tensor:
    """code[q] * absmax in fp32 from what the picker read: the weights before any rounding."""
    q = torch.stack([found.packed >> 4, found.packed & 15], dim=-1).reshape(n, k).long()
    return found.code[q] * found.absmax.reshape(n, -1).repeat_interleave(found.blocksize, dim=1)


# (N, K, block size, config, quant type, nested absmax, bias, the dtype quantized from): masked
# columns (N not a multiple of BLOCK_N), a masked K tail (192 with BLOCK_K 128, its blocks masked
# too), several blocks per K tile, SWAP_AB, split-K (parametrized); weights quantized from fp16 round
# there first (under fp32 x: two roundings), from fp32 once.
SHAPES = [(32, 64, 64, {}, "nf4", True, False, torch.float16),
          (96, 192, 64, dict(BLOCK_N=64, BLOCK_K=128), "fp4", False, True, torch.float32),
          (48, 128, 32, dict(BLOCK_N=32, SWAP_AB=True), "nf4", False, True, SIXTEEN),
          (64, 512, 128, {}, "fp4", True, False, torch.float32)]


@pytest.mark.parametrize("split", [1, 2])
@pytest.mark.parametrize("n, k, blocksize, config, quant_type, nested, bias, source", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16] if DEVICE == "cpu" else [torch.bfloat16,
                                                                                             torch.float32])
def test_kernel_rebuilds_bnb_weights_exactly(dtype, n, k, blocksize, config, quant_type, nested, bias, source,
                                             split):
    """x = the identity: every output is one rebuilt weight times 1 (plus exact zeros, plus the bias),
    so the kernel's weights come out as they are and must equal bitsandbytes' dequantize_4bit (in the
    dtype quantized from) converted to x's dtype, bit for bit."""
    module = _linear4bit(n, k, quant_type=quant_type, nested=nested, blocksize=blocksize, source=source,
                         compute_dtype=dtype, bias=bias, seed=n + k)
    found = bnb_4bit(module)
    assert found is not None and found.blocksize == blocksize
    state = module.weight.quant_state
    expected = bnb_functional.dequantize_4bit(module.weight, state).to(dtype).t()
    b = None if not bias else module.bias.detach()
    if b is not None:
        expected = (expected.float() + b.float()).to(dtype)
    eye = torch.eye(k, dtype=dtype, device=DEVICE)
    got = torch.cat([skinny.skinny_linear_codebook_4bit(rows, found.packed, found.absmax, found.code, blocksize, b,
                                                        round_dtype=state.dtype, config=dict(config, SPLIT_K=split))
                     for rows in eye.split(256)])
    assert got.dtype == dtype and torch.equal(got, expected)


def test_the_rounding_steps_matter():
    """Weights quantized from fp16 and read in fp32: bitsandbytes' dequantize rounds code[q] * absmax to
    fp16 first, which changes many of them, so the test above tells round_dtype from none; without it
    the kernel gives the fp32 products themselves."""
    module = _linear4bit(32, 64, nested=True, source=torch.float16, compute_dtype=torch.float32, seed=32 + 64)
    found = bnb_4bit(module)
    exact = _rebuilt(found, 32, 64)
    dequantized = bnb_functional.dequantize_4bit(module.weight, module.weight.quant_state)
    assert dequantized.dtype == torch.float16 and (exact != dequantized.float()).float().mean() > 0.5
    eye = torch.eye(64, device=DEVICE)
    once = skinny.skinny_linear_codebook_4bit(eye, found.packed, found.absmax, found.code, 64)
    assert torch.equal(once.t(), exact)
    twice = skinny.skinny_linear_codebook_4bit(eye, found.packed, found.absmax, found.code, 64,
                                               round_dtype=torch.float16)
    assert torch.equal(twice.t(), dequantized.float())


@pytest.mark.parametrize("split", [1, 2])
@pytest.mark.parametrize("rows", [1, 3, 17])
def test_kernel_matches_bnb_matmul(split, rows):
    module = _linear4bit(96, 256, quant_type="fp4" if rows == 3 else "nf4", nested=rows == 17, bias=rows > 1,
                         seed=rows)
    found = bnb_4bit(module)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)).to(DEVICE, DTYPE)
    weight = bnb_functional.dequantize_4bit(module.weight, module.weight.quant_state).to(DTYPE)
    bias = None if module.bias is None else module.bias.detach()
    expected = torch.nn.functional.linear(x, weight, bias)
    got = skinny.skinny_linear_codebook_4bit(x, found.packed, found.absmax, found.code, 64, bias,
                                             config=dict(SPLIT_K=split))
    assert got.shape == expected.shape and got.dtype == DTYPE
    tol = 1e-4 if DTYPE == torch.float32 else 2e-2
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol)  # (summation order only)


def test_kernel_refuses_what_it_does_not_take():
    codebook = skinny.skinny_linear_codebook_4bit
    x = torch.randn(2, 128, device=DEVICE, dtype=DTYPE)
    packed = torch.zeros(16, 64, dtype=torch.uint8, device=DEVICE)  # N = 16, K = 128
    absmax = torch.ones(16 * 128 // 64, device=DEVICE)
    code = torch.linspace(-1, 1, 16, device=DEVICE)
    assert codebook(x, packed, absmax, code, 64).shape == (2, 16)
    with pytest.raises(ValueError, match="packed uint8"):
        codebook(x, packed.to(torch.int8), absmax, code, 64)
    for blocksize, k in ((96, 192), (8, 128), (512, 512), (64, 96)):  # not a power of two; under 16; over 256;
        with pytest.raises(ValueError, match="block size"):                # not dividing K
            codebook(torch.zeros(2, k, device=DEVICE, dtype=DTYPE), torch.zeros(16, k // 2, dtype=torch.uint8,
                     device=DEVICE), torch.ones(16 * k // blocksize, device=DEVICE), code, blocksize)
    with pytest.raises(ValueError, match="absmax must hold 32"):
        codebook(x, packed, absmax[:16], code, 64)
    with pytest.raises(ValueError, match="absmax must hold 32"):
        codebook(x, packed, absmax.to(torch.float16), code, 64)
    with pytest.raises(ValueError, match="code must hold 16"):
        codebook(x, packed, absmax, code[:8], 64)
    with pytest.raises(ValueError, match="code must hold 16"):
        codebook(x, packed, absmax, code.to(torch.float16), 64)
    with pytest.raises(ValueError, match="bias in x's dtype"):
        codebook(x, packed, absmax, code, 64, torch.zeros(16, device=DEVICE, dtype=torch.float64))
    small = torch.rand(16 * 128 // 16, device=DEVICE)  # a K tile of one block of 16 (the smallest dot) is taken
    weight = (code[torch.tensor([4, 11] * 64, device=DEVICE)][None, :] * small.reshape(16, 8).repeat_interleave(16, 1))
    torch.testing.assert_close(codebook(x, packed + 0x4B, small, code, 16, config=dict(BLOCK_K=16)),
                               torch.nn.functional.linear(x, weight.to(DTYPE)), rtol=2e-2, atol=2e-2)
    with pytest.raises(ValueError, match="multiple of the group"):
        codebook(x, packed, absmax, code, 64, config=dict(BLOCK_K=32))
    with pytest.raises(ValueError, match="at most 256 rows"):
        codebook(torch.zeros(257, 128, device=DEVICE, dtype=DTYPE), packed, absmax, code, 64)


def test_which_linear4bit_modules_are_taken(saved_llama):
    """What the picker reads rebuilds bitsandbytes' own dequantized weights (the nested absmax
    dequantized as its matmul does); what it cannot repeat is left alone."""
    for kwargs in (dict(quant_type="nf4"), dict(quant_type="fp4", nested=True), dict(cls=bnb.nn.LinearNF4),
                   dict(cls=bnb.nn.LinearFP4, nested=True, blocksize=128), dict(blocksize=32, bias=True)):
        module = _linear4bit(32, 128, **kwargs)
        found = bnb_4bit(module)
        state = module.weight.quant_state
        assert found is not None and found.state is state and found.blocksize == state.blocksize
        assert found.packed.shape == (32, 64) and found.packed.dtype == torch.uint8
        assert found.absmax.dtype == torch.float32 and found.absmax.numel() == 32 * 128 // state.blocksize
        assert torch.equal(found.code, state.code) and found.round_dtype in (None, torch.float32)
        assert torch.equal(_rebuilt(found, 32, 128), bnb_functional.dequantize_4bit(module.weight, state)), kwargs
    assert bnb_4bit(torch.nn.Linear(128, 32)) is None
    assert bnb_4bit(bnb.nn.Linear4bit(128, 32, compute_dtype=DTYPE)) is None  # not quantized yet (not moved)
    assert bnb_4bit(_linear4bit(32, 512, blocksize=512)) is None  # blocks over 256
    assert bnb_4bit(_linear4bit(32, 128, storage=torch.bfloat16)) is None  # codes stored as bf16 (FSDP's)
    nested = _linear4bit(32, 128, nested=True)
    assert bnb_4bit(nested) is not None
    nested.weight.quant_state.state2.blocksize = 128  # (bitsandbytes' own matmul refuses such nesting)
    assert bnb_4bit(nested) is None
    for hook in ("register_forward_hook", "register_forward_pre_hook"):
        module = _linear4bit(32, 128)
        getattr(module, hook)(lambda *args: None)
        assert bnb_4bit(module) is None
    assert not any(bnb_4bit(m) for m in tiny_model("llama").modules())  # plain weights: the usual kernel
    model = _bnb_model(saved_llama)
    found = [m for m in model.modules() if bnb_4bit(m) is not None]
    assert len(found) == model.config.num_hidden_layers * 7  # (the lm_head is not quantized)
    gemms = DecodeGemms(model, None)
    assert "14 bitsandbytes 4-bit projections read as 4-bit" in gemms.summary()
    picks = [p for p in gemms.kernel_picks() if p.form.name == "codebook_4bit"]
    assert len(picks) == 14 and {(p.n, p.k, p.bias, p.form.group, p.dtype) for p in picks} == {
        (64, 64, False, 64, DTYPE), (32, 64, False, 64, DTYPE), (128, 64, False, 64, DTYPE),
        (64, 128, False, 64, DTYPE)}  # q/o, k/v, gate/up, down
    module = _linear4bit(32, 128, bias=True)
    (pick,) = [p for p in DecodeGemms(torch.nn.Sequential(module), None).kernel_picks() if p.form.codebook]
    assert (pick.n, pick.k, pick.bias) == (32, 128, True)  # the kernel adds the bias


def test_a_module_repacked_for_the_cpu_is_left_to_its_forward(codebook_calls):
    """With AVX512-BF16, Linear4bit's first forward in eval mode repacks its weight for its CPU kernel
    (another layout, bf16 products): not taken, and a routed module repacked by its own forward (a
    prefill of more than 256 rows) runs that forward from then on."""
    if DEVICE != "cpu":
        pytest.skip("bitsandbytes repacks 4-bit weights on the CPU only")
    module = _linear4bit(32, 128, canonical=False)
    if not module.support_avx512bf16_for_cpu:
        pytest.skip("this CPU has no AVX512-BF16: bitsandbytes does not repack")
    assert bnb_4bit(module) is not None
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        module(x)
    assert module.weight.quant_state.packing_format_for_cpu and bnb_4bit(module) is None

    routed = _linear4bit(32, 128, canonical=False)
    gemms = DecodeGemms(torch.nn.Sequential(routed), None)
    gemms.attach()
    try:
        with torch.no_grad():
            routed(x)  # (through the kernel: the weight is not repacked)
            assert len(codebook_calls) == 1 and not getattr(routed.weight.quant_state, "packing_format_for_cpu", False)
            routed(torch.randn(300, 128))  # its own forward: repacked
            assert routed.weight.quant_state.packing_format_for_cpu
            got = routed(x)
    finally:
        gemms.detach()
    assert len(codebook_calls) == 1
    with torch.no_grad():
        assert torch.equal(got, routed(x))


@pytest.fixture
def codebook_calls(monkeypatch):
    calls = []
    real = skinny.skinny_linear_codebook_4bit

    def counted(x, packed, absmax, code, blocksize, bias=None, *, round_dtype=None, config=None):
        calls.append((x.numel() // x.shape[-1], tuple(packed.shape)))
        return real(x, packed, absmax, code, blocksize, bias, round_dtype=round_dtype, config=config)

    monkeypatch.setattr(decode_gemm, "skinny_linear_codebook_4bit", counted)
    return calls


def test_routed_forward_matches_the_quantized_model(saved_llama, codebook_calls):
    model = _bnb_model(saved_llama)
    expected, got = routed_logits(model, codebook_calls)
    layers = model.config.num_hidden_layers
    assert len(codebook_calls) == layers * 7 and {rows for rows, _ in codebook_calls} == {18}
    assert {shape for _, shape in codebook_calls} == {(64, 32), (32, 32), (128, 32), (64, 64)}
    _assert_close_up_to_rounding(got, expected)


@pytest.mark.parametrize("source", [torch.float32, torch.float16])
def test_routed_forward_with_bias(source, codebook_calls):
    """A Linear4bit with a bias (added before the product is rounded, as F.linear adds it), its weight
    quantized from fp32 or fp16: bitsandbytes' matmul dequantizes straight to the compute dtype, so
    the routed forward gives its own forward's output whatever the weight was quantized from."""
    module = _linear4bit(64, 128, source=source, bias=True, nested=True)
    x = torch.randn(2, 3, 128, generator=torch.Generator().manual_seed(3)).to(DEVICE, DTYPE)
    with torch.no_grad():
        expected = module(x)
        gemms = DecodeGemms(torch.nn.Sequential(module), None)
        gemms.attach()
        try:
            got = module(x)
        finally:
            gemms.detach()
    assert codebook_calls == [(6, (64, 64))]
    _assert_close_up_to_rounding(got, expected)


def test_only_the_routed_buckets_take_the_form(monkeypatch, codebook_calls):
    """On CUDA the form runs at the rows buckets where it beat bitsandbytes' own path
    (decode_gemm.BNB_4BIT_CUDA_BUCKETS): rows in other buckets run the module's own forward, and only
    the routed buckets' variants are listed to compile ahead."""
    monkeypatch.setattr(decode_gemm, "_codebook_buckets", lambda device: frozenset({4, 8}))
    module = _linear4bit(64, 128, bias=True)
    gemms = DecodeGemms(torch.nn.Sequential(module), None)
    assert [set(pick.configs) for pick in gemms.kernel_picks()] == [{4, 8}]
    assert "1 bitsandbytes 4-bit projections read as 4-bit (decode steps of 3-8 rows)" in gemms.summary()
    gemms.attach()
    try:
        with torch.no_grad():
            for rows in (1, 3, 9):
                x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows)).to(DEVICE, DTYPE)
                got = module(x)
                _assert_close_up_to_rounding(got, type(module).forward(module, x))
    finally:
        gemms.detach()
    assert codebook_calls == [(3, (64, 64))]


def test_routed_forward_waits_for_the_modules_own_first_forward(codebook_calls):
    """Without a compute dtype, Linear4bit's first forward sets it (from x's dtype): that call runs its
    own forward, the next ones the kernel; a weight quantized again (another quant_state) runs its
    own forward again, with the new weight."""
    module = _linear4bit(64, 128, compute_dtype=None, bias=True)
    assert not module.compute_type_is_set
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(5)).to(DEVICE, DTYPE)
    gemms = DecodeGemms(torch.nn.Sequential(module), None)
    gemms.attach()
    try:
        with torch.no_grad():
            first = module(x)
            assert codebook_calls == [] and module.compute_type_is_set and module.compute_dtype == DTYPE
            second = module(x)
            assert codebook_calls == [(3, (64, 64))]
            weight = (torch.randn(64, 128, generator=torch.Generator().manual_seed(6)) * 4).to(DEVICE)
            module.weight = bnb.nn.Params4bit(weight, requires_grad=False, quant_type="nf4", module=module).to(DEVICE)
            requantized = module(x)
            assert len(codebook_calls) == 1
    finally:
        gemms.detach()
    _assert_close_up_to_rounding(second, first)
    with torch.no_grad():
        assert torch.equal(requantized, module(x)) and not torch.allclose(requantized, first)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_engine_greedy_matches_stock(mode, saved_llama, codebook_calls):
    """In fp32 (the products' rounding differs from bitsandbytes' own CUDA path only by summation order:
    in bf16 a 1-ulp flip turns a near-tie of the tiny random model, and the routed-forward tests above
    bound those differences)."""
    model = _bnb_model(saved_llama, nested=mode == "async", dtype=torch.float32, compute_dtype=torch.float32)
    assert_engine_greedy_matches_stock(model, mode, codebook_calls)


@pytest.mark.skipif(DEVICE != "cuda", reason="bf16 on CUDA (the CPU's test above is fp32 and exact)")
def test_engine_in_bf16_leaves_stock_only_at_near_ties(saved_llama, codebook_calls):
    """In bf16 on CUDA, the form's products and bitsandbytes' own differ by rounding (summation order,
    where the bias is added): a row may leave stock's greedy tokens only where stock's two best
    logits were within a few bf16 ulps of each other."""
    from models import left_pad, random_prompts

    from hf_async_cb import BatchingConfig

    model = _bnb_model(saved_llama)
    ids, mask = (t.to(DEVICE) for t in left_pad(random_prompts(6, 1, 40, seed=5)))
    stock = model.generate(ids, attention_mask=mask, batching="off", max_new_tokens=6, output_logits=True,
                           return_dict_in_generate=True)
    got = model.generate(ids, attention_mask=mask, batching="sync", max_new_tokens=6,
                         batching_config=BatchingConfig(page_size=16, max_batch_tokens=64, skinny_gemm=True))
    assert codebook_calls
    width = ids.shape[1]
    for row in range(ids.shape[0]):
        differ = (got[row, width:] != stock.sequences[row, width:]).nonzero()
        if len(differ):
            step = differ[0].item()
            best, second = stock.logits[step][row].float().topk(2).values.tolist()
            assert best - second <= 4 * 2 ** -8 * abs(best), (row, step, best, second)


def test_the_listed_variants_are_the_launched_ones(monkeypatch):
    """The codebook form's variants (what the build compiles ahead) have the keys its launches look up:
    split-K (K = 512 at 1 and 5 rows) and not (40 rows), with a bias and without, its weights rounded
    to x's dtype alone or to fp16 first."""
    from hf_async_cb.kernels.variant import jit_key, variant_key

    seen = interpreter_launches(monkeypatch)
    n, k = 64, 512
    packed, absmax, code = torch.ones(n, k // 2, dtype=torch.uint8), torch.ones(n * k // 64), torch.ones(16)
    cases = [(rows, bias, round_dtype) for rows in (1, 5, 40) for bias, round_dtype in
             ((False, None), (True, None), (False, torch.float16))]
    for rows, bias, round_dtype in cases:
        x = torch.randn(rows, k, dtype=DTYPE)
        skinny.skinny_linear_codebook_4bit(x, packed, absmax, code, 64, torch.ones(n) if bias else None,
                                           round_dtype=round_dtype)
    launched = {jit_key(kernel, args, kwargs) for kernel, args, kwargs in seen}
    listed = {variant_key(v) for bucket in (1, 8, 64) for bias in (False, True) for round_dtype in (None, torch.float16)
              for v in skinny.variants(n, k, DTYPE, bias, bucket, {},
                                       WeightForm(torch.uint8, 64, codebook=True, round_dtype=round_dtype))}
    assert launched and launched <= listed
    assert {kwargs["CODEBOOK"] for kernel, _, kwargs in seen if kernel is skinny._skinny_gemm_kernel} == {1, 3}
    assert any(kernel is skinny._splitk_reduce_kernel for kernel, _, _ in seen)


@pytest.mark.parametrize("dtype, compute_dtype", [(DTYPE, DTYPE), (SIXTEEN, torch.float32)])
def test_an_engine_lists_every_codebook_launch(monkeypatch, saved_llama, dtype, compute_dtype):
    """What an engine on a 4-bit model hands the precompile (model_variants of its facts, at that point
    of its build) covers every skinny GEMM launch its decode steps make, at several batch sizes; also
    for a 16-bit model computing in fp32 (BitsAndBytesConfig's default compute dtype), whose
    projections launch the kernel in fp32."""
    model = _bnb_model(saved_llama, quant_type="fp4", dtype=dtype, compute_dtype=compute_dtype)
    seen, launched, listed = engine_launches_and_listing(monkeypatch, model)
    assert {args[0].dtype for _, args, kwargs in seen if kwargs.get("CODEBOOK")} == {compute_dtype}
    assert launched and launched <= listed


def test_codebook_form_compiles_for_sm90_and_fits_an_h200():
    """The codebook form's default launches in bf16 for Llama-3-8B's projections (blocks of 64, at the
    rows buckets 32 and 256; weights rounded to bf16 alone or to fp16 first; with a bias) build for an
    H200 without a GPU, and fit its 227 KB of shared memory per block (Triton's own count)."""
    from sm90 import assert_compiles_for_sm90

    sig = {"x_ptr": "*bf16", "w_ptr": "*u8", "b_ptr": "*u8", "out_ptr": "*bf16", "s_ptr": "*fp32", "z_ptr": "*fp32",
           "M": "i32", "N": "i32", "K": "i32", "k_per_split": "i32", "stride_xm": "i32"}
    aligned = ["x_ptr", "w_ptr", "b_ptr", "out_ptr", "s_ptr", "z_ptr", "N", "K", "k_per_split", "stride_xm"]
    kernels = {}
    for n, k in ((4096, 4096), (14336, 4096), (4096, 14336)):
        for bucket in (32, 256):
            for bias, round_dtype in ((False, None), (True, None), (False, torch.float16)):
                form = WeightForm(torch.uint8, 64, codebook=True, round_dtype=round_dtype)
                (variant, *_) = skinny.variants(n, k, torch.bfloat16, bias, bucket, {}, form)
                assert variant.constexprs["CODEBOOK"] == (1 if round_dtype is None else 3)
                out = "*bf16" if variant.constexprs["SPLIT_K"] == 1 else "*fp32"
                b = "*bf16" if bias else "*u8"
                key = (b, out, tuple(sorted(variant.constexprs.items())), tuple(sorted(variant.options.items())))
                kernels[key] = ("hf_async_cb.kernels.skinny_gemm", "_skinny_gemm_kernel",
                                dict(sig, b_ptr=b, out_ptr=out), variant.constexprs,
                                dict(variant.options, divisible_by_16=aligned))
    assert {dict(key[2])["SPLIT_K"] > 1 for key in kernels} == {False, True}  # (split-K among them, and not)
    shared = assert_compiles_for_sm90(list(kernels.values()))
    assert max(shared) <= 232448, max(zip(shared, kernels))
    assert max(shared) >= 32 * 1024  # the count is real: the pipelined tiles of 256 rows take shared memory
