"""HQQ's 3-bit projections read through a 4-bit copy (model/hqq_four_bit_copy.py): the copy holds HQQ's
own values, the kernel rebuilds HQQ's weights from it bit for bit, decode steps read it, and it follows
every write of its source (in place, through `.data`, from a held Engine, through generate(), while a
loop serves), so that the tokens stay stock's. On the CPU the kernel runs in Triton's interpreter."""

import copy

import pytest
import torch
from models import hqq_in_place, left_pad, random_prompts, stock_generate, tiny_model

import hf_async_cb.kernels.skinny_gemm as skinny
import hf_async_cb.model.decode_gemm as decode_gemm
from hf_async_cb import BatchingConfig, Engine
from hf_async_cb.model.decode_gemm import DecodeGemms, hqq_grouped
from hf_async_cb.model.hqq_four_bit_copy import FourBitCopy, pack_four_bit, takes_a_copy, unpack_three_bit

quantize = pytest.importorskip("hqq.core.quantize")
bitpack = pytest.importorskip("hqq.core.bitpack")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32


def _three_bit_linear(n: int, k: int, *, dtype=DTYPE, seed=0, group_size=64):
    torch.manual_seed(seed)
    linear = torch.nn.Linear(k, n, bias=False).to(DEVICE)
    config = quantize.BaseQuantizeConfig(nbits=3, group_size=group_size)
    config["weight_quant_params"]["round_zero"] = False  # (fractional zeros: the rounding steps show)
    return quantize.HQQLinear(linear, config, compute_dtype=dtype, device=DEVICE)


def _three_bit_model(plain_tensors: bool = False) -> torch.nn.Module:
    """A tiny Llama with 3-bit HQQ projections; HQQ makes its words, scales and zeros under
    `torch.inference_mode()` (inference tensors: no version counters); `plain_tensors`: made plain."""
    model = hqq_in_place(copy.deepcopy(tiny_model("llama")).to(DEVICE, DTYPE), quantize, nbits=3)
    if plain_tensors:
        for module in model.modules():
            if type(module).__name__ == "HQQLinear":
                module.W_q = torch.nn.Parameter(module.W_q.clone(), requires_grad=False)
                module.meta["scale"], module.meta["zero"] = module.meta["scale"].clone(), module.meta["zero"].clone()
    return model


@pytest.mark.parametrize("n, k, group", [(96, 192, 64), (34, 128, 32), (64, 512, 128), (2, 64, 16)])
def test_the_copy_holds_hqqs_values_in_hqqs_4bit_layout(n, k, group):
    """Unpacked: HQQ's own unpacking of its words (parts starting mid-row where N * K / group is no
    multiple of ten); packed: HQQ's own 4-bit packing of those values."""
    module = _three_bit_linear(n, k, group_size=group, seed=n + k)
    found = hqq_grouped(module)
    assert found.bits == 3 and takes_a_copy(found)
    values = unpack_three_bit(found)
    theirs = bitpack.BitPack.unpack_3bit_32(module.W_q)[: n * k // group].reshape(n, k)
    assert values.dtype == torch.uint8 and torch.equal(values, theirs)
    assert torch.equal(pack_four_bit(values), bitpack.BitPack.pack_4bit_u8(theirs))


def test_an_odd_row_count_keeps_the_words():
    """HQQ's 4-bit layout holds whole rows per nibble: 33 rows have no copy, and are read as 3 bits."""
    found = hqq_grouped(_three_bit_linear(33, 128))
    assert not takes_a_copy(found)
    assert DecodeGemms(torch.nn.Sequential(_three_bit_linear(33, 128)), None).copies == []


@pytest.mark.parametrize("split", [1, 2])
def test_the_kernel_rebuilds_hqqs_weights_from_the_copy_exactly(split):
    """x = the identity: every weight the kernel rebuilds from the copy, bit for bit HQQ's dequantize
    (fp16 on the CPU: the two rounding steps)."""
    dtype = torch.float16 if DEVICE == "cpu" else torch.bfloat16
    module = _three_bit_linear(96, 192, dtype=dtype, seed=3)
    found = FourBitCopy(module, hqq_grouped(module)).grouped
    assert found.bits == 4 and found.packed.shape == (48, 192) and found.packed.dtype == torch.uint8
    eye = torch.eye(192, dtype=dtype, device=DEVICE)
    got = skinny.skinny_linear_grouped(eye, found.packed, found.scale, found.zero, 64, bits=4,
                                       config=dict(BLOCK_N=64, SPLIT_K=split))
    assert torch.equal(got.t(), module.dequantize())


@pytest.fixture
def grouped_calls(monkeypatch):
    calls = []
    real = skinny.skinny_linear_grouped

    def counted(x, packed, scale, zero, group_size, *, bits=4, shape=None, config=None):
        calls.append((x.numel() // x.shape[-1], tuple(packed.shape), packed.dtype, bits))
        return real(x, packed, scale, zero, group_size, bits=bits, shape=shape, config=config)

    monkeypatch.setattr(decode_gemm, "skinny_linear_grouped", counted)
    return calls


def test_decode_steps_read_the_copies(grouped_calls):
    model = _three_bit_model()
    gemms = DecodeGemms(model, None)
    layers = model.config.num_hidden_layers
    assert len(gemms.copies) == layers * 7
    assert f"{layers * 7} HQQ 3-bit projections read as 4-bit (copies of" in gemms.summary()
    x = torch.randn(1, 3, 64, dtype=DTYPE, device=DEVICE)
    module = model.model.layers[0].self_attn.q_proj
    with torch.no_grad():
        expected = module(x)
        gemms.attach()
        try:
            got = module(x)
        finally:
            gemms.detach()
    assert grouped_calls == [(3, (32, 64), torch.uint8, 4)]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_without_room_for_the_copies_the_words_are_read(monkeypatch, grouped_calls):
    monkeypatch.setattr(decode_gemm, "copies_fit", lambda found: False)
    gemms = DecodeGemms(_three_bit_model(), None)
    assert gemms.copies == [] and "HQQ 3-bit projections read as 3-bit" in gemms.summary()


def _requantize(model, seed: int, through_data: bool) -> None:
    """Every HQQ projection's words, scales and zeros written over with those of another random linear:
    in place (version counters move; inference tensors: under inference_mode, none kept) or through
    `.data` (none moves)."""
    g = torch.Generator().manual_seed(seed)
    for module in model.modules():
        if type(module).__name__ != "HQQLinear":
            continue
        n, k = module.meta["shape"]
        linear = torch.nn.Linear(k, n, bias=False)
        with torch.no_grad():
            linear.weight.copy_(torch.randn(n, k, generator=g) * 0.1)
        other = quantize.HQQLinear(linear.to(DEVICE), quantize.BaseQuantizeConfig(nbits=3, group_size=64),
                                   compute_dtype=DTYPE, device=DEVICE)
        with torch.no_grad():
            for mine, theirs in ((module.W_q, other.W_q), (module.meta["scale"], other.meta["scale"]),
                                 (module.meta["zero"], other.meta["zero"])):
                if mine.is_inference():
                    with torch.inference_mode():
                        mine.copy_(theirs)
                else:
                    (mine.data if through_data else mine).copy_(theirs)


PROMPTS = random_prompts(4, 5, 30, seed=11)
CONFIG = dict(page_size=16, max_batch_tokens=64, skinny_gemm=True)


def _generate(model, mode, **config):
    ids, mask = (t.to(DEVICE) for t in left_pad(PROMPTS))
    return model.generate(ids, attention_mask=mask, batching=mode, max_new_tokens=6,
                          batching_config=BatchingConfig(**CONFIG, **config)).cpu()


@pytest.mark.parametrize("mode, plain, through_data, prefix_caching", [
    ("sync", True, False, True), ("async", True, True, True), ("sync", True, True, False), ("async", False, False, False),
    ("async", False, False, True)])
def test_generate_after_a_write_reads_the_new_weights(mode, plain, through_data, prefix_caching, grouped_calls):
    """generate() keeps its engine (and the copies) between calls: after the projections are written
    (in place, or through `.data`, which no counter sees; HQQ's own inference tensors or plain ones),
    the next call gives stock's tokens of the new weights."""
    model = _three_bit_model(plain_tensors=plain)
    before = stock_generate(model, PROMPTS, max_new_tokens=6)
    assert torch.equal(_generate(model, mode, prefix_caching=prefix_caching), before)
    assert any(bits == 4 for *_, bits in grouped_calls)
    _requantize(model, seed=7, through_data=through_data)
    after = stock_generate(model, PROMPTS, max_new_tokens=6)
    assert not torch.equal(after, before)  # (else the test could not tell a stale copy)
    assert torch.equal(_generate(model, mode, prefix_caching=prefix_caching), after)


def test_a_held_engine_reads_the_new_weights():
    model = _three_bit_model()
    prompt = PROMPTS[0]
    with Engine(model, BatchingConfig(**CONFIG, mode="async")) as engine:
        assert engine.prepared_model.decode_gemms.copies
        first = engine.generate([prompt], max_new_tokens=6)[0].output_token_ids
        _requantize(model, seed=8, through_data=True)
        second = engine.generate([prompt], max_new_tokens=6)[0].output_token_ids
    expected = stock_generate(model, [prompt], max_new_tokens=6, eos_token_id=[], pad_token_id=0)[0, len(prompt):]
    assert first != second and second == expected.tolist()


@pytest.mark.parametrize("through_data", [False, True])
def test_a_serving_loop_reads_the_new_weights(through_data):
    """While a loop serves: a write in place is seen at the next admission; one through `.data` after
    `clear_prefix_cache()`, as the docs ask (and so one of an inference tensor's, which keeps no counter)."""
    model = _three_bit_model(plain_tensors=not through_data)
    prompt = PROMPTS[1]
    engine = Engine(model, BatchingConfig(**CONFIG, mode="async"))
    try:
        engine.start()
        first = engine.add_request(prompt, max_new_tokens=6, eos_token_ids=()).result(timeout=60).output_token_ids
        _requantize(model, seed=9, through_data=through_data)
        if through_data:
            engine.clear_prefix_cache()
        second = engine.add_request(prompt, max_new_tokens=6, eos_token_ids=()).result(timeout=60).output_token_ids
        engine.shutdown(timeout=60)
    finally:
        engine.shutdown(cancel=True, timeout=60)
        engine.close()
    expected = stock_generate(model, [prompt], max_new_tokens=6, eos_token_id=[], pad_token_id=0)[0, len(prompt):]
    assert first != second and second == expected.tolist()
