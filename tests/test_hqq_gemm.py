"""HQQ projections (hqq's HQQLinear: 8, 6, 5, 4, 3, 2, 1.58 or 1 bits packed as "8bit_u8", "4bit_u8",
"3bit_32", "2bit_u8" or "1bit_u8", groups along the input dimension, plain scales and zeros) through the skinny
GEMM's grouped form: the kernel rebuilds
every weight as HQQ's dequantize rounds it ((q - zero) rounded, times scale, rounded, in the compute
dtype), its compiled variants are the ones listed for compiling ahead, and an HQQ model routed
through it gives stock's logits and greedy tokens (on the CPU the kernel runs in Triton's
interpreter: fp32, and fp16 for the rounding of the rebuilt weights)."""

import copy

import pytest
import torch
from models import hqq_in_place, tiny_model
from quantized_checks import (assert_engine_greedy_matches_stock, engine_launches_and_listing, hqq_linear,
                              interpreter_launches, routed_logits)

import hf_async_cb.kernels.skinny_gemm as skinny
import hf_async_cb.model.decode_gemm as decode_gemm
from hf_async_cb.kernels.skinny_gemm_forms import WeightForm, grouped_word
from hf_async_cb.model.decode_gemm import DecodeGemms, hqq_grouped

quantize = pytest.importorskip("hqq.core.quantize")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32


def _hqq_linear(n: int, k: int, **options):
    return hqq_linear(n, k, **{"dtype": DTYPE, **options})


def _hqq_model(family: str = "llama") -> torch.nn.Module:
    return hqq_in_place(copy.deepcopy(tiny_model(family)).to(DEVICE, DTYPE), quantize)


# (N, K, group size, config): masked columns (N not a multiple of BLOCK_N), K not a multiple of
# BLOCK_K (the masked tail, its groups masked too), several groups per K tile, split-K.
SHAPES = [(32, 64, 64, {}), (96, 192, 64, dict(BLOCK_N=64, BLOCK_K=128)), (48, 128, 32, dict(BLOCK_N=32)),
          (64, 512, 128, {})]


@pytest.mark.parametrize("split", [1, 2])
@pytest.mark.parametrize("n, k, group, config", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16] if DEVICE == "cpu" else [torch.bfloat16])
def test_kernel_rebuilds_hqq_weights_exactly(dtype, n, k, group, config, split):
    """x = the identity: every output is one rebuilt weight times 1 (plus exact zeros), so the kernel's
    weights come out as they are, and must equal HQQ's dequantized ones bit for bit. With fractional
    zeros, fp16 rounds (q - zero) before the scale: a single rounding would differ on many weights."""
    module = _hqq_linear(n, k, dtype=dtype, group_size=group, round_zero=False, seed=n + k)
    found = hqq_grouped(module)
    assert found is not None
    expected = module.dequantize()
    eye = torch.eye(k, dtype=dtype, device=DEVICE)
    got = torch.cat([skinny.skinny_linear_grouped(rows, found.packed, found.scale, found.zero, group,
                                               config=dict(config, SPLIT_K=split)) for rows in eye.split(256)])
    assert got.dtype == dtype and torch.equal(got.t(), expected)


@pytest.mark.parametrize("split", [1, 2])
@pytest.mark.parametrize("nbits, n", [(8, 96), (6, 96), (3, 96), (3, 33), (2, 96), (1.58, 96), (1, 96)])
def test_kernel_rebuilds_every_width_exactly(nbits, n, split):
    """The other packings HQQ writes (8 // bits parts of the rows a byte, the first in the highest
    bits; at 3 bits ten parts of the flat groups a 32-bit word, a part starting anywhere in a row), on a
    tile with masked rows (N = 96 or 33 at BLOCK_N 64) and several groups: every weight bit for bit as
    HQQ dequantizes it, in fp16 (the rounding steps) on the CPU."""
    dtype = torch.float16 if DEVICE == "cpu" else torch.bfloat16
    module = _hqq_linear(n, 192, dtype=dtype, nbits=nbits, round_zero=False, seed=int(nbits * 10) + n)
    found = hqq_grouped(module)
    assert found is not None and found.bits == {8: 8, 6: 8, 3: 3, 2: 2, 1.58: 2, 1: 1}[nbits]
    assert found.shape == (n, 192)
    assert found.packed.shape == ((-(-n * 3 // 10), 64) if nbits == 3 else (n * found.bits // 8, 192))
    eye = torch.eye(192, dtype=dtype, device=DEVICE)
    got = skinny.skinny_linear_grouped(eye, found.packed, found.scale, found.zero, 64, bits=found.bits,
                                       shape=found.shape, config=dict(BLOCK_N=64, SPLIT_K=split))
    assert torch.equal(got.t(), module.dequantize())


def test_the_rounding_steps_matter():
    """In 16 bits, rounding the exact (q - zero) * scale once gives other weights than HQQ's two
    roundings on this module (so the test above tells them apart)."""
    dtype = torch.float16 if DEVICE == "cpu" else torch.bfloat16
    module = _hqq_linear(96, 192, dtype=dtype, round_zero=False, seed=96 + 192)
    found = hqq_grouped(module)
    q = torch.cat([found.packed >> 4, found.packed & 15]).float()
    groups = lambda t: t.float().reshape(96, -1).repeat_interleave(64, 1)  # noqa: E731
    once = ((q - groups(found.zero)) * groups(found.scale)).to(dtype)
    assert (once != module.dequantize()).any()


@pytest.mark.parametrize("split", [1, 2])
@pytest.mark.parametrize("rows, nbits", [(1, 4), (3, 4), (17, 4), (3, 8), (17, 2), (5, 1), (6, 3)])
def test_kernel_matches_hqq_matmul(split, rows, nbits):
    module = _hqq_linear(96, 256, seed=rows, nbits=nbits)
    found = hqq_grouped(module)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)).to(DEVICE, DTYPE)
    expected = torch.matmul(x, module.dequantize().t())
    got = skinny.skinny_linear_grouped(x, found.packed, found.scale, found.zero, 64, bits=found.bits,
                                       shape=found.shape, config=dict(SPLIT_K=split))
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)  # (summation order only)


def test_kernel_refuses_what_it_does_not_take():
    x = torch.randn(2, 128, device=DEVICE, dtype=DTYPE)
    packed = torch.zeros(16, 128, dtype=torch.uint8, device=DEVICE)
    ones = torch.ones(64, device=DEVICE, dtype=DTYPE)
    with pytest.raises(ValueError, match="group size"):
        skinny.skinny_linear_grouped(x, packed, ones[:32], ones[:32], 96)
    with pytest.raises(ValueError, match="scale must hold 64"):
        skinny.skinny_linear_grouped(x, packed, ones[:8], ones, 64)
    with pytest.raises(ValueError, match="zero must hold"):
        skinny.skinny_linear_grouped(x, packed, ones, ones.to(torch.float16), 64)
    with pytest.raises(ValueError, match="packed uint8"):
        skinny.skinny_linear_grouped(x, packed.to(torch.int8), ones, ones, 64)
    with pytest.raises(ValueError, match="multiple of the group"):
        skinny.skinny_linear_grouped(x, packed, ones, ones, 64, config=dict(BLOCK_K=32))
    with pytest.raises(ValueError, match="bits a weight"):
        skinny.skinny_linear_grouped(x, packed, ones, ones, 64, bits=5)
    with pytest.raises(ValueError, match="needs the weight's shape"):
        skinny.skinny_linear_grouped(x, packed.to(torch.int32), ones, ones, 64, bits=3)
    with pytest.raises(ValueError, match="int32 packing of 448 words"):
        skinny.skinny_linear_grouped(x, packed.to(torch.int32), ones, ones, 64, bits=3, shape=(32, 128))
    with pytest.raises(ValueError, match="is not the packing's"):
        skinny.skinny_linear_grouped(x, packed, ones, ones, 64, shape=(16, 128))
    with pytest.raises(ValueError, match="scale must hold 128"):  # at 2 bits, 16 packed rows are 64 weight rows
        skinny.skinny_linear_grouped(x, packed, ones, ones, 64, bits=2)
    with pytest.raises(ValueError, match="only the grouped form"):
        WeightForm(torch.int8, bits=8)


def test_which_hqq_modules_are_taken():
    taken = hqq_grouped(_hqq_linear(32, 128))
    assert taken is not None and taken.packed.shape == (16, 128) and taken.scale.numel() == 32 * 128 // 64
    assert hqq_grouped(_hqq_linear(32, 128, group_size=32)) is not None
    assert hqq_grouped(_hqq_linear(32, 128, bias=True)).bias is not None  # added to the rounded product
    assert hqq_grouped(_hqq_linear(32, 128, nbits=8)).bits == 8
    assert hqq_grouped(_hqq_linear(32, 128, nbits=5)).packed.shape == (32, 128)  # (5 and 6 bits pack as 8)
    assert hqq_grouped(_hqq_linear(32, 128, nbits=2)).packed.shape == (8, 128)
    assert hqq_grouped(_hqq_linear(32, 128, nbits=1)).packed.shape == (4, 128)
    taken = hqq_grouped(_hqq_linear(33, 128, nbits=3))  # ten 3-bit fields an int32, parts across rows
    assert taken.bits == 3 and taken.shape == (33, 128) and taken.packed.dtype == torch.int32
    assert hqq_grouped(_hqq_linear(36, 128, nbits=1)) is None  # its eighths are not whole rows
    assert hqq_grouped(_hqq_linear(34, 128, nbits=2)) is None  # its quarters are not whole rows
    assert hqq_grouped(_hqq_linear(32, 96, group_size=48)) is None  # not a power of two
    assert hqq_grouped(_hqq_linear(32, 128, axis=0)) is None  # groups along the output dimension
    assert hqq_grouped(_hqq_linear(33, 128)) is None  # an odd row count: its halves are not whole rows
    assert hqq_grouped(_hqq_linear(32, 128, view_as_float=True)) is None
    for key in ("quant_zero", "quant_scale"):  # quantized meta-data (loaded from an older checkpoint)
        module = _hqq_linear(32, 128)
        module.meta[key] = True
        assert hqq_grouped(module) is None
    module = _hqq_linear(32, 128)
    module.meta["zero"] = module.meta["zero"].double()  # HQQ would promote the dequantized weight
    assert hqq_grouped(module) is None
    backend = quantize.HQQLinear.backend
    try:
        quantize.HQQLinear.set_backend(quantize.HQQBackend.PYTORCH_COMPILE)  # inductor's own fusion of the steps
        assert hqq_grouped(_hqq_linear(32, 128)) is None
        quantize.HQQLinear.set_backend(quantize.HQQBackend.PYTORCH_FORWARD)
        assert hqq_grouped(_hqq_linear(32, 128)) is not None
    finally:
        quantize.HQQLinear.set_backend(backend)
    assert not any(hqq_grouped(m) for m in tiny_model("llama").modules())  # plain weights: the usual kernel
    model = _hqq_model()
    found = [m for m in model.modules() if hqq_grouped(m) is not None]
    assert len(found) == model.config.num_hidden_layers * 7
    assert "14 HQQ 4-bit projections read as 4-bit" in DecodeGemms(model, None).summary()


@pytest.fixture
def grouped_calls(monkeypatch):
    calls = []
    real = skinny.skinny_linear_grouped

    def counted(x, packed, scale, zero, group_size, *, bits=4, shape=None, dequant="hqq", config=None):
        calls.append((x.numel() // x.shape[-1], tuple(packed.shape)))
        return real(x, packed, scale, zero, group_size, bits=bits, shape=shape, dequant=dequant, config=config)

    monkeypatch.setattr(decode_gemm, "skinny_linear_grouped", counted)
    return calls


def test_routed_forward_matches_the_quantized_model(grouped_calls):
    model = _hqq_model()
    expected, got = routed_logits(model, grouped_calls)
    layers = model.config.num_hidden_layers
    assert len(grouped_calls) == layers * 7 and {rows for rows, _ in grouped_calls} == {18}
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_routed_forward_with_bias(grouped_calls):
    module = _hqq_linear(64, 128, bias=True)
    x = torch.randn(2, 3, 128, generator=torch.Generator().manual_seed(3)).to(DEVICE, DTYPE)
    model = torch.nn.Sequential(module)
    with torch.no_grad():
        expected = module(x)
        gemms = DecodeGemms(model, None)
        gemms.attach()
        try:
            got = module(x)
        finally:
            gemms.detach()
    assert grouped_calls == [(6, (32, 128))]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_engine_greedy_matches_stock(mode, grouped_calls):
    assert_engine_greedy_matches_stock(_hqq_model("llama"), mode, grouped_calls)


@pytest.mark.parametrize("nbits, mode", [(8, "sync"), (3, "async"), (2, "async")])
def test_engine_greedy_matches_stock_at_other_widths(nbits, mode, grouped_calls):
    model = hqq_in_place(copy.deepcopy(tiny_model("llama")).to(DEVICE, DTYPE), quantize, nbits=nbits)
    assert f"HQQ {nbits}-bit projections read as" in DecodeGemms(model, None).summary()
    assert_engine_greedy_matches_stock(model, mode, grouped_calls)


def test_the_listed_variants_are_the_launched_ones(monkeypatch):
    """The grouped form's variants (what the build compiles ahead) have the keys its launches look up,
    split-K (K = 512 at 1 and 5 rows) and not (40 rows) alike, at 4, 8 and 3 bits."""
    from hf_async_cb.kernels.variant import jit_key, variant_key

    seen = interpreter_launches(monkeypatch)
    n, k = 64, 512
    for bits in (4, 8, 3):
        packed = torch.ones(-(-n * k // 640), 64, dtype=torch.int32) if bits == 3 else \
            torch.ones(n * bits // 8, k, dtype=torch.uint8)
        for rows in (1, 5, 40):
            x = torch.randn(rows, k, dtype=DTYPE)
            ones = torch.ones(n * k // 64, dtype=DTYPE)
            skinny.skinny_linear_grouped(x, packed, ones, ones, 64, bits=bits, shape=(n, k))
    launched = {jit_key(kernel, args, kwargs) for kernel, args, kwargs in seen}
    listed = {variant_key(v) for bucket in (1, 8, 64) for bits in (4, 8, 3) for v in
              skinny.variants(n, k, DTYPE, False, bucket, {}, WeightForm(grouped_word(bits), 64, bits=bits))}
    assert launched and launched <= listed
    assert any(kernel is skinny._splitk_reduce_kernel for kernel, _, _ in seen)


def test_model_variants_list_the_hqq_projections():
    """facts_of lists every HQQ projection's grouped 4-bit variants at every rows bucket."""
    from types import SimpleNamespace

    from hf_async_cb.kernels import model_variants

    model = _hqq_model()
    gemms = DecodeGemms(model, None)
    shapes = {(p.n, p.k, p.form.group) for p in gemms.kernel_picks() if p.form.name == "grouped_4bit"}
    assert shapes == {(64, 64, 64), (32, 64, 64), (128, 64, 64), (64, 128, 64)}  # q/o, k/v, gate/up, down
    engine = SimpleNamespace(prepared_model=SimpleNamespace(decode_gemms=gemms, elementwise=None),
                             config=SimpleNamespace(page_size=16), _model_config=model.config, attention_backend="sdpa",
                             device=torch.device(DEVICE), dtype=DTYPE, vocab_size=256)
    facts = model_variants.facts_of(engine, model)
    grouped = [g for g in facts.gemms if g.form == WeightForm(torch.uint8, 64)]
    assert {(g.n, g.k) for g in grouped} == {(n, k) for n, k, _ in shapes}
    assert {g.bucket for g in grouped} == {1 << i for i in range(9)}
    listed = model_variants.model_variants(facts)
    gemm = [v for v in listed if v.name == "skinny_gemm._skinny_gemm_kernel" and v.constexprs.get("GROUP") == 64]
    assert {(v.args[7], v.args[8]) for v in gemm} == {(n, k) for n, k, _ in shapes}
    whole = [v for v in listed if v.name == "grouped_dequant._dequantize_grouped_kernel"]  # (prefill steps)
    assert {(v.args[4], v.args[5]) for v in whole} == {(n, k) for n, k, _ in shapes}


@pytest.mark.parametrize("nbits", [4, 3])
def test_an_engine_lists_every_grouped_launch(nbits, monkeypatch):
    """What an engine on an HQQ model hands the precompile (model_variants of its facts, at that point
    of its build) covers every skinny GEMM launch its decode steps make, at several batch sizes."""
    model = hqq_in_place(copy.deepcopy(tiny_model("llama")).to(DEVICE, DTYPE), quantize, nbits=nbits)
    seen, launched, listed = engine_launches_and_listing(monkeypatch, model)
    assert any(kwargs.get("GROUP") == 64 for _, _, kwargs in seen)
    assert launched and launched <= listed


def test_grouped_form_compiles_for_sm90():
    """The grouped form in bf16 (plain, SWAP_AB, split-K with a masked K tail; 4, 8, 3, 2 and 1 bits) builds
    for an H200 without a GPU."""
    from sm90 import assert_compiles_for_sm90

    sig = {"x_ptr": "*bf16", "w_ptr": "*u8", "b_ptr": "*u8", "out_ptr": "*bf16", "s_ptr": "*bf16", "z_ptr": "*bf16",
           "M": "i32", "N": "i32", "K": "i32", "k_per_split": "i32", "stride_xm": "i32"}
    aligned = ["x_ptr", "w_ptr", "b_ptr", "out_ptr", "s_ptr", "z_ptr", "N", "K", "k_per_split", "stride_xm"]
    kernels = []
    for split, swap, even_k, bits in ((1, False, True, 4), (1, True, True, 4), (4, False, False, 4), (1, False, True, 8),
                                      (4, False, True, 2), (1, True, False, 1), (4, False, True, 3), (1, True, False, 3)):
        c = skinny._config(32, 4096, 4096, torch.bfloat16, torch.uint8, 132, dict(SPLIT_K=split, SWAP_AB=swap), 64)
        kernels.append(("hf_async_cb.kernels.skinny_gemm", "_skinny_gemm_kernel",
                        dict(sig, out_ptr="*fp32" if split > 1 else "*bf16", w_ptr="*i32" if bits == 3 else "*u8"),
                        dict(BLOCK_M=32, BLOCK_N=c["BLOCK_N"], BLOCK_K=c["BLOCK_K"], SPLIT_K=split, EVEN_K=even_k,
                             EVEN_N=True, HAS_BIAS=False, SWAP_AB=swap, IEEE=False, SCALED=False, GROUP=64,
                             PRESCALED=False, CODEBOOK=0, BITS=bits, DEQUANT=0),
                        dict(num_warps=c["num_warps"], num_stages=c["num_stages"], divisible_by_16=aligned)))
    assert_compiles_for_sm90(kernels)


def test_every_default_launch_fits_an_h200s_shared_memory():
    """Compiled for sm_90 (Triton's own count of the shared memory), the quantized forms' default
    launches fit an H200's 227 KB per block: groups of 32 and 128, a masked K tail, and the int8
    and pre-scaled forms. On the H200 a group of 128 and a masked tail
    at 256 rows asked 296 KB (four stages of a bf16 x tile counted as 4-bit)."""
    from sm90 import assert_compiles_for_sm90

    sig = {"x_ptr": "*bf16", "w_ptr": "*u8", "b_ptr": "*u8", "out_ptr": "*bf16", "s_ptr": "*bf16", "z_ptr": "*bf16",
           "M": "i32", "N": "i32", "K": "i32", "k_per_split": "i32", "stride_xm": "i32"}
    aligned = ["x_ptr", "w_ptr", "b_ptr", "out_ptr", "s_ptr", "z_ptr", "N", "K", "k_per_split", "stride_xm"]
    forms = [(WeightForm(torch.uint8, g), 4096, 4096) for g in (32, 128)] + [(WeightForm(torch.uint8, 64), 96, 192)]
    forms += [(WeightForm(torch.uint8, 128, bits=8), 4096, 4096), (WeightForm(torch.int32, 64, bits=3), 4096, 4096)]
    forms += [(WeightForm(torch.int8), 4096, 4096), (WeightForm(torch.int8, prescaled=True), 4096, 4096)]
    kernels = {}
    for form, n, k in forms:
        for bucket in (16, 128, 256):  # the tiles grow with the rows bucket (1 to 16 share 16's)
            (variant, *_) = skinny.variants(n, k, torch.bfloat16, False, bucket, {}, form)
            w = {torch.uint8: "*u8", torch.int8: "*i8", torch.int32: "*i32"}[form.dtype]
            out = "*bf16" if not variant.constexprs["SPLIT_K"] > 1 else "*fp32"
            key = (w, out, tuple(sorted(variant.constexprs.items())), tuple(sorted(variant.options.items())))
            kernels[key] = ("hf_async_cb.kernels.skinny_gemm", "_skinny_gemm_kernel",
                            dict(sig, w_ptr=w, b_ptr=w, out_ptr=out), variant.constexprs,
                            dict(variant.options, divisible_by_16=aligned))
    shared = assert_compiles_for_sm90(list(kernels.values()))
    assert max(shared) <= 232448, max(zip(shared, kernels))
    assert any(s > 100 * 1024 for s in shared)  # the count is real: the deep pipelines take shared memory


def test_every_hqq_packing_is_read_by_the_grouped_form():
    """The grouped form reads every packing this hqq writes, so a new one (a later hqq) is seen here
    rather than left, silently, to HQQ's own forward (exact, at a fraction of the speed)."""
    from hf_async_cb.model.quantized_linears import _HQQ_PACKINGS

    assert set(_HQQ_PACKINGS) == set(quantize.Quantizer.unpack)
    from hf_async_cb.kernels.skinny_gemm_forms import GROUPED_BITS

    assert set(_HQQ_PACKINGS.values()) == set(GROUPED_BITS)


def test_the_next_call_reuses_the_prompts_pages():
    """HQQ's quantizer leaves some of its tensors as inference tensors (the zeros), which keep no version
    counter: their values, read once a call, tell the next call that the model is unchanged, and it
    reuses the prompts' pages."""
    import hf_async_cb
    from models import left_pad, random_prompts, stock_generate

    model = _hqq_model()
    q = model.model.layers[0].self_attn.q_proj
    assert q.meta["zero"].is_inference()
    prompts = random_prompts(3, 40, 60, seed=2)
    ids, mask = (t.to(DEVICE) for t in left_pad(prompts))
    stock = stock_generate(model, prompts, max_new_tokens=4)
    hits = []
    for _ in range(2):
        out = model.generate(ids, attention_mask=mask, max_new_tokens=4, batching="sync")
        assert torch.equal(out.cpu(), stock.cpu())
        hits.append(hf_async_cb.prefix_cache_stats(model)["hit_tokens"] - sum(hits))
    assert hits[0] == 0 and hits[1] >= 3 * 32  # (every prompt's whole pages)
    hf_async_cb.release(model)
