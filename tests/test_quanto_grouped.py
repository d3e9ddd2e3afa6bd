"""optimum-quanto's 4- and 2-bit weights through the skinny GEMM's grouped form (model/quanto_grouped.py):
the kernel's rules rebuild each weight as quanto's forwards do (its plain dequantize: `scale * q` rounded,
minus the shift, rounded; the tinygemm kernel's (q - 8) * scale + zero, rounded once), the plain
tensors are read as they are and the tinygemm ones through a copy that holds quanto's own codes and
follows every write, decode steps go through the kernel, and a quanto model routed through it gives
stock's greedy tokens. On the CPU the kernel runs in Triton's interpreter (fp32 and fp16: it has no
bf16, so the tinygemm copy's products are checked on CUDA)."""

import copy

import pytest
import torch
import transformers
from models import COMMON, tiny_model
from quantized_checks import (assert_engine_greedy_matches_stock, engine_launches_and_listing, quanto_linear,
                              routed_logits)

import hf_async_cb.kernels.skinny_gemm as skinny
import hf_async_cb.model.decode_gemm as decode_gemm
import hf_async_cb.model.quanto_grouped as quanto_grouped_module
from hf_async_cb.kernels.skinny_gemm_forms import WeightForm
from hf_async_cb.model.decode_gemm import DecodeGemms
from hf_async_cb.model.quanto_grouped import QuantoCopy, copied_weight, packing_order, quanto_grouped, tinygemm_codes

quanto = pytest.importorskip("optimum.quanto")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _linear(n: int, k: int, *, weights=None, dtype=torch.float32, **options):
    return quanto_linear(n, k, weights or quanto.qint4, dtype=dtype, **options)


def _model(weights=None, dtype=torch.float32, wide=False) -> torch.nn.Module:
    """The tiny Llama quantized by quanto; `wide`: its widths doubled and quadrupled, so that every
    projection's K is at least 256, where quanto's bf16 int4 on CUDA takes tinygemm's layout (below it
    keeps its plain tensor), and its lm_head left in `dtype` (stock generate slices the hidden states
    before the head, and quanto's tinygemm matmul refuses a strided input)."""
    if wide:
        torch.manual_seed(0)
        config = transformers.LlamaConfig(**{**COMMON, "hidden_size": 256, "intermediate_size": 512})
        model = transformers.LlamaForCausalLM(config).eval().to(DEVICE, dtype)
    else:
        model = copy.deepcopy(tiny_model("llama")).to(DEVICE, dtype)
    quanto.quantize(model, weights=weights or quanto.qint4, exclude="lm_head" if wide else None)
    quanto.freeze(model)
    return model


def _rebuilt(found, dtype) -> torch.Tensor:
    """Every weight the kernel rebuilds from `found`: x = the identity (each output one weight, exactly)."""
    n, k = found.shape
    eye = torch.eye(k, dtype=dtype, device=DEVICE)
    rows = []
    for first in range(0, k, skinny.MAX_M):  # (at most MAX_M rows a call)
        rows.append(skinny.skinny_linear_grouped(eye[first:first + skinny.MAX_M], found.packed, found.scale.to(dtype),
                                                 found.zero.to(dtype), found.group_size, bits=found.bits,
                                                 shape=found.shape, dequant=found.dequant))
    return torch.cat(rows).t()


@pytest.mark.parametrize("weights", ["qint4", "qint2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_kernel_rebuilds_quantos_plain_weights_exactly(weights, dtype):
    """N = 96 (not a multiple of the 64-row tile at BLOCK_N 64), K = 256: bit for bit quanto's dequantize,
    whose two rounding steps show in 16 bits. (fp16: quanto's plain tensor on CUDA too, where bf16 int4
    takes its tinygemm tensor and fp16 from 128 rows its AWQ one.)"""
    module = _linear(96, 256, weights=getattr(quanto, weights), dtype=dtype, seed=1)
    found = quanto_grouped(module)
    assert found is not None and found.dequant == "scale_shift" and found.bits == int(weights[-1])
    assert torch.equal(_rebuilt(found, dtype), module.weight.dequantize())


def test_the_rounding_steps_tell_the_rules_apart():
    """In fp16 the rules differ on the same codes (so the tests above and below tell a wrong rule)."""
    module = _linear(96, 256, dtype=torch.float16, seed=2)
    found = quanto_grouped(module)
    theirs = _rebuilt(found, torch.float16)
    once = _rebuilt(found._replace(zero=-found.zero, dequant="fma"), torch.float16)
    assert (once != theirs).any()
    hqq = _rebuilt(found._replace(dequant="hqq"), torch.float16)
    assert (hqq != theirs).any()


@pytest.mark.parametrize("bits", [4, 2])
def test_the_fused_rules_equal_their_formulas(bits):
    """"fma" and "fma_centered": q * scale + zero (q less 2**(bits-1) first) in fp32, rounded once to
    x's dtype, for codes in quanto's packing (part p of the rows in bits BITS * p)."""
    g = torch.Generator().manual_seed(bits)
    n, k, group = 64, 128, 32
    codes = torch.randint(0, 1 << bits, (n, k), generator=g, dtype=torch.uint8)
    parts = 8 // bits
    rows = n // parts
    packed = torch.zeros(rows, k, dtype=torch.uint8)
    for p in range(parts):
        packed |= codes[p * rows:(p + 1) * rows] << (bits * p)
    scale = (torch.rand(n * k // group, generator=g) / 8 + 0.01).to(torch.float16)
    zero = (torch.randn(n * k // group, generator=g) / 4).to(torch.float16)
    for dequant, centre in (("fma", 0), ("fma_centered", 1 << (bits - 1))):
        found = quanto_grouped_module.GroupedWeight(packed.to(DEVICE), scale.to(DEVICE), zero.to(DEVICE), group, bits,
                                                    None, (n, k), dequant)
        expected = ((codes.float() - centre).reshape(n, k // group, group) * scale.float().reshape(n, -1, 1)
                    + zero.float().reshape(n, -1, 1)).reshape(n, k)
        assert torch.equal(_rebuilt(found, torch.float16).cpu(), expected.to(torch.float16))
        assert torch.equal(_rebuilt(found, torch.float32).cpu(), expected)


def test_which_quanto_modules_are_taken():
    taken = quanto_grouped(_linear(32, 128))
    assert taken is not None and taken.packed.shape == (16, 128) and taken.scale.shape == (32,)
    assert quanto_grouped(_linear(32, 128, weights=quanto.qint2)).packed.shape == (8, 128)
    assert quanto_grouped(_linear(32, 128, bias=True)).bias is not None  # added to the rounded product
    assert quanto_grouped(_linear(32, 128, weights=quanto.qint8)) is None  # (the pre-scaled form's)
    assert quanto_grouped(_linear(32, 128, frozen=False)) is None  # quantizes its float weight every call
    assert quanto_grouped(_linear(32, 128, activations=quanto.qint8)) is None  # quantized activations
    module = _linear(32, 128)
    module.bias = torch.nn.Parameter(torch.zeros(32, dtype=torch.float64, device=DEVICE))  # quanto would promote
    assert quanto_grouped(module) is None
    assert quanto_grouped(torch.nn.Linear(128, 32)) is None and copied_weight(torch.nn.Linear(128, 32)) is None
    bf16 = _linear(32, 256, dtype=torch.bfloat16)  # groups of 128 in bf16: quanto's tinygemm tensor
    assert type(bf16.weight).__name__ == "TinyGemmWeightQBitsTensor"
    assert quanto_grouped(bf16) is None and copied_weight(bf16) is bf16.weight
    model = _model()
    layers = model.config.num_hidden_layers
    found = [m for m in model.modules() if quanto_grouped(m) is not None]
    assert len(found) == layers * 7 + 1  # (and lm_head)
    assert f"{layers * 7 + 1} quanto int4 projections read as 4-bit" in DecodeGemms(model, None).summary()


@pytest.mark.parametrize("n, k", [(96, 256), (32, 512), (256, 384)])
def test_tinygemm_codes_are_quantos(n, k):
    """The codes read back through the packing's order are those quanto's own unpacking (the int4
    matmul times an identity) gives, and the copy holds them in quanto's plain layout with the
    tinygemm scales and zeros per group."""
    module = _linear(n, k, dtype=torch.bfloat16, seed=n)
    w = copied_weight(module)
    codes = tinygemm_codes(w)
    assert codes.dtype == torch.uint8 and torch.equal(codes, w._data.unpack())
    made = QuantoCopy(module, w)
    made.refresh(made.version(), (0,))
    found = made.grouped
    assert found.dequant == "fma_centered" and found.packed.shape == (n // 2, k)
    assert torch.equal(torch.cat((found.packed & 15, found.packed >> 4)), codes)
    pairs = w._scale_shift
    assert torch.equal(found.scale.reshape(n, -1), pairs[:, :, 0].t()) and torch.equal(found.zero.reshape(n, -1),
                                                                                        pairs[:, :, 1].t())


def test_the_fma_centered_rule_is_tinygemms_reading():
    """The weights the tinygemm matmul reads (its product with an identity, bf16) are (q - 8) * scale +
    zero rounded once, of the copy's codes and groups (checked in fp32: the interpreter has no bf16)."""
    module = _linear(96, 512, dtype=torch.bfloat16, seed=4)
    made = QuantoCopy(module, copied_weight(module))
    made.refresh(made.version(), (0,))
    found = made.grouped
    with torch.no_grad():
        theirs = module(torch.eye(512, dtype=torch.bfloat16, device=DEVICE)).t()
    if DEVICE == "cuda":
        ours = _rebuilt(found, torch.bfloat16)
    else:
        ours = _rebuilt(found, torch.float32).to(torch.bfloat16)
    assert torch.equal(ours, theirs)


def test_a_packing_that_is_no_permutation_is_refused(monkeypatch):
    real = quanto_grouped_module._pack_like_tinygemm
    monkeypatch.setitem(quanto_grouped_module.PACKINGS, "tinygemm", lambda codes: real(codes & 7))
    with pytest.raises(RuntimeError, match="not a permutation"):
        packing_order("tinygemm", 32, 256, torch.device(DEVICE))


def test_codes_that_do_not_pack_back_are_refused(monkeypatch):
    """An order that is a permutation but not the packing's: the block's codes do not pack into the
    weight's bytes, so the whole weight's order is read back (and is right); where that fails too, the
    weight is refused."""
    module = _linear(64, 256, dtype=torch.bfloat16, seed=3)
    data = module.weight._data._data
    real = quanto_grouped_module.packing_order
    orders = {("tinygemm", 64, 256, data.device): real("tinygemm", 64, 256, data.device).flip(0)}
    assert torch.equal(tinygemm_codes(module.weight, orders), module.weight._data.unpack())
    monkeypatch.setattr(quanto_grouped_module, "packing_order", lambda *a: real(*a).flip(0))
    with pytest.raises(RuntimeError, match="could not be read back"):
        tinygemm_codes(module.weight)


@pytest.mark.parametrize("n", [2048, 96])
def test_the_order_of_a_block_serves_every_block(n, monkeypatch):
    """A tall weight's codes are read through the order of a block of rows (a few KiB to read back),
    in slices of rows for the check (REPACK_BYTES). 96 rows: a block of 32 first (on the CPU its packing
    takes larger blocks: the codes do not pack back, and the whole weight's order is read)."""
    monkeypatch.setattr(quanto_grouped_module, "REPACK_BYTES", 1 << 16)
    module = _linear(n, 256, dtype=torch.bfloat16, seed=n)
    orders: dict = {}
    assert torch.equal(tinygemm_codes(module.weight, orders), module.weight._data.unpack())
    rows = [key[1] for key in orders]
    assert rows == [256] if n == 2048 else rows[0] == 32


def test_the_copy_follows_writes_to_its_source():
    """A write in place (version counters move) and one through `.data` (only the hash can tell) are
    both seen by DecodeGemms.refresh_copies, which rebuilds that copy alone."""
    model = torch.nn.Sequential(_linear(32, 256, dtype=torch.bfloat16, seed=5),
                                _linear(32, 256, dtype=torch.bfloat16, seed=6))
    gemms = DecodeGemms(model, None)
    assert len(gemms.copies) == 2 and "2 quanto int4 (tinygemm) projections read as 4-bit" in gemms.summary()
    assert gemms.refresh_copies() == 0
    other = _linear(32, 256, dtype=torch.bfloat16, seed=7).weight
    for through_data in (False, True):
        target = model[0].weight._data._data
        with torch.no_grad():
            (target.data if through_data else target).copy_(other._data._data)
            model[0].weight._scale_shift.data.copy_(other._scale_shift)
        assert gemms.refresh_copies() == 1
        assert torch.equal(torch.cat((gemms.copies[0].packed & 15, gemms.copies[0].packed >> 4)), other._data.unpack())
        other = _linear(32, 256, dtype=torch.bfloat16, seed=8).weight


def test_without_room_for_the_copies_tinygemm_runs_its_own(monkeypatch):
    monkeypatch.setattr(decode_gemm, "copies_fit", lambda sizes: False)
    gemms = DecodeGemms(torch.nn.Sequential(_linear(32, 256, dtype=torch.bfloat16)), None)
    assert gemms.copies == [] and "quanto" not in gemms.summary() and gemms.kernel_picks() == []


@pytest.fixture
def grouped_calls(monkeypatch):
    calls = []
    real = skinny.skinny_linear_grouped

    def counted(x, packed, scale, zero, group_size, *, bits=4, shape=None, dequant="hqq", config=None):
        calls.append((x.numel() // x.shape[-1], tuple(packed.shape), dequant))
        return real(x, packed, scale, zero, group_size, bits=bits, shape=shape, dequant=dequant, config=config)

    monkeypatch.setattr(decode_gemm, "skinny_linear_grouped", counted)
    return calls


@pytest.mark.parametrize("weights", ["qint4", "qint2"])
def test_routed_forward_matches_the_quantized_model(weights, grouped_calls):
    model = _model(getattr(quanto, weights))
    expected, got = routed_logits(model, grouped_calls)
    assert len(grouped_calls) == model.config.num_hidden_layers * 7 + 1
    assert {rows for rows, *_ in grouped_calls} == {18} and {d for *_, d in grouped_calls} == {"scale_shift"}
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_engine_greedy_matches_stock(mode, grouped_calls):
    assert_engine_greedy_matches_stock(_model(), mode, grouped_calls)


def test_an_engine_lists_every_grouped_launch(monkeypatch):
    """What an engine on a quanto int4 model hands the precompile covers every skinny GEMM launch of
    its decode steps, the rule's constexpr included."""
    seen, launched, listed = engine_launches_and_listing(monkeypatch, _model())
    assert any(kwargs.get("DEQUANT") == 1 for _, _, kwargs in seen)
    assert launched and launched <= listed


def test_the_routed_modules_keep_cuda_graphs():
    """quanto's plain 4-bit kernels run on the legacy stream: routed through the kernel, their decode
    steps (up to MAX_M tokens) may be captured, larger ones run eagerly; an unrouted one is unsafe."""
    from hf_async_cb.model.graph_safety import graph_token_cap, graph_unsafe_weights, launches_off_stream

    model = _model()
    gemms = DecodeGemms(model, None)
    routed = gemms.graph_routed_modules()
    assert len(routed) == model.config.num_hidden_layers * 7 + 1
    assert all(launches_off_stream(m.weight) for m in routed)
    assert graph_token_cap(routed) == skinny.MAX_M and graph_token_cap([]) is None
    if DEVICE == "cuda":
        assert graph_unsafe_weights(model, routed) == []
        assert len(graph_unsafe_weights(model)) == len(routed)


def test_the_rules_compile_for_sm90():
    """The grouped form's quanto rules in bf16 (4 and 2 bits, split-K with its reduction) build for an
    H200 without a GPU."""
    from sm90 import assert_compiles_for_sm90

    kernels = []
    sig = {"x_ptr": "*bf16", "w_ptr": "*u8", "b_ptr": "*u8", "out_ptr": "*bf16", "s_ptr": "*bf16", "z_ptr": "*bf16",
           "M": "i32", "N": "i32", "K": "i32", "k_per_split": "i32", "stride_xm": "i32"}
    aligned = ["x_ptr", "w_ptr", "b_ptr", "out_ptr", "s_ptr", "z_ptr", "N", "K", "k_per_split", "stride_xm"]
    for dequant, bits, split in (("scale_shift", 4, 1), ("fma_centered", 4, 4), ("fma", 4, 1), ("scale_shift", 2, 2)):
        form = WeightForm(torch.uint8, 128, bits=bits, dequant=dequant)
        c = skinny._config(32, 4096, 4096, torch.bfloat16, torch.uint8, 132, dict(SPLIT_K=split), 128)
        kernels.append(("hf_async_cb.kernels.skinny_gemm", "_skinny_gemm_kernel",
                        dict(sig, out_ptr="*fp32") if split > 1 else sig,
                        dict(BLOCK_M=32, BLOCK_N=c["BLOCK_N"], BLOCK_K=c["BLOCK_K"], SPLIT_K=split, EVEN_K=True,
                             EVEN_N=True, HAS_BIAS=False, SWAP_AB=False, IEEE=False, SCALED=False, GROUP=128,
                             PRESCALED=False, CODEBOOK=0, BITS=bits, DEQUANT=form.dequant_code),
                        dict(num_warps=c["num_warps"], num_stages=c["num_stages"], divisible_by_16=aligned)))
    shared = assert_compiles_for_sm90(kernels)
    assert max(shared) <= 227 * 1024


def test_the_scale_shift_rule_rounds_twice_in_fp32_on_the_gpu():
    """quanto's plain fp32 weights round `scale * q`, then the difference with the shift: compiled for an
    H200, the fp32 kernel must not fuse that product into the subtraction (Triton fuses a product and
    an add into one rounding, which the interpreter does not show); its PTX holds as many fused
    multiply-adds as HQQ's rule (the product's) and a product and a difference per weight of its own."""
    from sm90 import ptx_counts

    sig = {"x_ptr": "*fp32", "w_ptr": "*u8", "b_ptr": "*u8", "out_ptr": "*fp32", "s_ptr": "*fp32", "z_ptr": "*fp32",
           "M": "i32", "N": "i32", "K": "i32", "k_per_split": "i32", "stride_xm": "i32"}
    kernels = [("hf_async_cb.kernels.skinny_gemm", "_skinny_gemm_kernel", sig,
                dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, SPLIT_K=1, EVEN_K=True, EVEN_N=True, HAS_BIAS=False,
                     SWAP_AB=False, IEEE=True, SCALED=False, GROUP=128, PRESCALED=False, CODEBOOK=0, BITS=4,
                     DEQUANT=WeightForm(torch.uint8, 128, dequant=dequant).dequant_code))
               for dequant in ("hqq", "scale_shift")]
    (hqq_fma, hqq_mul), (quanto_fma, quanto_mul) = ptx_counts(kernels, ("fma.rn.f32", "mul.f32"))
    assert quanto_fma == hqq_fma and quanto_mul == hqq_mul > 0


@pytest.mark.skipif(DEVICE != "cuda", reason="quanto's bf16 int4 on CUDA (tinygemm): the interpreter has no bf16")
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_cuda_tinygemm_model_through_the_copies(mode, grouped_calls):
    """A bf16 quanto int4 model (tinygemm tensors) on CUDA: decode steps read the copies, the routed
    logits are the model's to bf16's rounding of another summation order, and generate runs in CUDA
    graphs with tokens equal to stock's where stock's top two logits are not within that rounding."""
    from hf_async_cb import BatchingConfig
    from models import left_pad, random_prompts, stock_generate

    model = _model(dtype=torch.bfloat16, wide=True)
    assert type(model.model.layers[0].self_attn.q_proj.weight).__name__ == "TinyGemmWeightQBitsTensor"
    expected, got = routed_logits(model, grouped_calls)
    assert {d for *_, d in grouped_calls} == {"fma_centered"}
    torch.testing.assert_close(got.float(), expected.float(), rtol=0.05, atol=0.05)
    prompts = random_prompts(6, 1, 40, seed=5)
    stock = stock_generate(model, prompts, max_new_tokens=6)
    ids, mask = (t.to(DEVICE) for t in left_pad(prompts))
    config = BatchingConfig(page_size=16, max_batch_tokens=64)
    ours = model.generate(ids, attention_mask=mask, batching=mode, batching_config=config, max_new_tokens=6).cpu()
    assert ours.shape == stock.shape
    assert (ours == stock.cpu()).float().mean() > 0.8  # (near-ties of a random bf16 model aside)


@pytest.mark.skipif(DEVICE != "cuda", reason="quanto makes AWQ tensors on CUDA only (fp16, groups of 128)")
def test_cuda_awq_copy_holds_quantos_codes_and_groups():
    """An fp16 quanto int4 linear on CUDA holds quanto's AWQ tensor (its kernels on the legacy stream):
    the copy holds its codes (quanto's own unpacking) and groups, the kernel rebuilds q * scale + shift
    rounded once (its fma's rounding), and the module is routed, so its decode steps may be captured.
    (Quanto's AWQ matmul itself builds an extension on first use: not run here.)"""
    module = _linear(256, 512, dtype=torch.float16, seed=9)
    w = module.weight
    if type(w).__name__ != "AWQWeightQBitsTensor":
        pytest.skip(f"quanto chose {type(w).__name__} on this machine")
    assert copied_weight(module) is w
    made = QuantoCopy(module, w)
    made.refresh(made.version(), (0,))
    found = made.grouped
    codes = w._data.unpack()
    assert found.dequant == "fma" and torch.equal(torch.cat((found.packed & 15, found.packed >> 4)), codes)
    scale, shift = w._scale.t(), w._shift.t()  # [N, K / 128]
    assert torch.equal(found.scale.reshape(256, -1), scale) and torch.equal(found.zero.reshape(256, -1), shift)
    expected = (codes.float().reshape(256, 4, 128) * scale.float()[:, :, None] + shift.float()[:, :, None])
    assert torch.equal(_rebuilt(found, torch.float16), expected.reshape(256, 512).to(torch.float16))
    gemms = DecodeGemms(torch.nn.Sequential(module), None)
    assert gemms.graph_routed_modules() == [module] and "quanto int4 (awq)" in gemms.summary()
