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
import hf_async_cb.model.hqq_four_bit_copy as four_bit_copy
from hf_async_cb.model.hqq_four_bit_copy import FourBitCopy, takes_a_copy, three_bit_rows

quantize = pytest.importorskip("hqq.core.quantize")
bitpack = pytest.importorskip("hqq.core.bitpack")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32
# The models whose tokens are compared with stock's: fp32 on CUDA too (bf16 near-ties of random weights
# would flip tokens between two correct roundings).
MODEL_DTYPE = torch.float32


def _three_bit_linear(n: int, k: int, *, dtype=DTYPE, seed=0, group_size=64):
    torch.manual_seed(seed)
    linear = torch.nn.Linear(k, n, bias=False).to(DEVICE)
    config = quantize.BaseQuantizeConfig(nbits=3, group_size=group_size)
    config["weight_quant_params"]["round_zero"] = False  # (fractional zeros: the rounding steps show)
    return quantize.HQQLinear(linear, config, compute_dtype=dtype, device=DEVICE)


def _three_bit_model(plain_tensors: bool = False) -> torch.nn.Module:
    """A tiny Llama with 3-bit HQQ projections; HQQ makes its words, scales and zeros under
    `torch.inference_mode()` (inference tensors: no version counters); `plain_tensors`: made plain."""
    model = hqq_in_place(copy.deepcopy(tiny_model("llama")).to(DEVICE, MODEL_DTYPE), quantize, nbits=3)
    if plain_tensors:
        for module in model.modules():
            if type(module).__name__ == "HQQLinear":
                module.W_q = torch.nn.Parameter(module.W_q.clone(), requires_grad=False)
                module.meta["scale"], module.meta["zero"] = module.meta["scale"].clone(), module.meta["zero"].clone()
    return model


@pytest.mark.parametrize("rows_at_once", [1 << 24, 200])
@pytest.mark.parametrize("n, k, group", [(96, 192, 64), (34, 128, 32), (64, 512, 128), (2, 64, 16)])
def test_the_copy_holds_hqqs_values_in_hqqs_4bit_layout(n, k, group, rows_at_once, monkeypatch):
    """Unpacked: HQQ's own unpacking of its words (parts starting mid-row where N * K / group is no
    multiple of ten); the copy: HQQ's own 4-bit packing of those values, written whole or a few rows
    at a time (ROWS_AT_ONCE)."""
    monkeypatch.setattr(four_bit_copy, "ROWS_AT_ONCE", rows_at_once)
    module = _three_bit_linear(n, k, group_size=group, seed=n + k)
    found = hqq_grouped(module)
    assert found.bits == 3 and takes_a_copy(found)
    values = three_bit_rows(found, 0, n)
    theirs = bitpack.BitPack.unpack_3bit_32(module.W_q)[: n * k // group].reshape(n, k)
    assert values.dtype == torch.uint8 and torch.equal(values, theirs)
    made = FourBitCopy(module, found)
    made.refresh(made.version(), 0)
    assert torch.equal(made.copy, bitpack.BitPack.pack_4bit_u8(theirs))


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
    made = FourBitCopy(module, hqq_grouped(module))
    made.refresh(made.version(), 0)
    found = made.grouped
    assert found.bits == 4 and found.packed.shape == (48, 192) and found.packed.dtype == torch.uint8
    eye = torch.eye(192, dtype=dtype, device=DEVICE)
    got = skinny.skinny_linear_grouped(eye, found.packed, found.scale, found.zero, 64, bits=4,
                                       config=dict(BLOCK_N=64, SPLIT_K=split))
    assert torch.equal(got.t(), module.dequantize())


@pytest.fixture
def grouped_calls(monkeypatch):
    calls = []
    real = skinny.skinny_linear_grouped

    def counted(x, packed, scale, zero, group_size, *, bits=4, shape=None, dequant="hqq", config=None):
        calls.append((x.numel() // x.shape[-1], tuple(packed.shape), packed.dtype, bits))
        return real(x, packed, scale, zero, group_size, bits=bits, shape=shape, dequant=dequant, config=config)

    monkeypatch.setattr(decode_gemm, "skinny_linear_grouped", counted)
    return calls


def test_decode_steps_read_the_copies(grouped_calls):
    model = _three_bit_model()
    gemms = DecodeGemms(model, None)
    layers = model.config.num_hidden_layers
    assert len(gemms.copies) == layers * 7
    assert f"{layers * 7} HQQ 3-bit projections read as 4-bit (copies of" in gemms.summary()
    x = torch.randn(1, 3, 64, dtype=MODEL_DTYPE, device=DEVICE)
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
                                   compute_dtype=MODEL_DTYPE, device=DEVICE)
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


def _served_around(model, prompt, write, **config) -> tuple[list, list, list]:
    """(tokens, tokens, stock's): `prompt` served by a loop, `write(engine)`, `prompt` served again;
    stock's tokens of the model as written."""
    engine = Engine(model, BatchingConfig(**CONFIG, mode="async", **config))
    try:
        engine.start()
        first = engine.add_request(prompt, max_new_tokens=6, eos_token_ids=()).result(timeout=60).output_token_ids
        write(engine)
        second = engine.add_request(prompt, max_new_tokens=6, eos_token_ids=()).result(timeout=60).output_token_ids
        engine.shutdown(timeout=60)
    finally:
        engine.shutdown(cancel=True, timeout=60)
        engine.close()
    expected = stock_generate(model, [prompt], max_new_tokens=6, eos_token_id=[], pad_token_id=0)[0, len(prompt):]
    return first, second, expected.tolist()


@pytest.mark.parametrize("through_data", [False, True])
def test_a_serving_loop_reads_the_new_weights(through_data):
    """While a loop serves: a write in place is seen at the next admission; one through `.data` after
    `clear_prefix_cache()`, as the docs ask (and so one of an inference tensor's, which keeps no counter)."""
    model = _three_bit_model(plain_tensors=not through_data)

    def write(engine):
        _requantize(model, seed=9, through_data=through_data)
        if through_data:
            engine.clear_prefix_cache()

    first, second, expected = _served_around(model, PROMPTS[1], write)
    assert first != second and second == expected


def _nudge(model, through_data: bool) -> None:
    """In every word row of every projection, the first part's field of column 0 +1 and of column 1 -1
    (a re-rounding at fixed scales and zeros): each row's sum of words is unchanged."""
    for module in model.modules():
        if type(module).__name__ == "HQQLinear":
            words = module.W_q.data if through_data else module.W_q
            with torch.no_grad():
                fields = (words[:, :2] >> 27) & 7
                up = (fields[:, 0] < 7) & (fields[:, 1] > 0)
                down = ~up & (fields[:, 0] > 0) & (fields[:, 1] < 7)
                delta = (up.to(torch.int32) - down.to(torch.int32)) << 27
                words[:, 0] += delta
                words[:, 1] -= delta


@pytest.mark.parametrize("through_data", [False, True])
def test_a_write_keeping_each_rows_sum_is_seen(through_data):
    """+1 and -1 in two fields of one row (in place: the counter moves; through `.data`: only the words'
    hash can tell), on a held Engine."""
    model = _three_bit_model()
    with Engine(model, BatchingConfig(**CONFIG, mode="sync")) as engine:
        first = [o.output_token_ids for o in engine.generate(PROMPTS, max_new_tokens=6, eos_token_ids=())]
        _nudge(model, through_data)
        second = [o.output_token_ids for o in engine.generate(PROMPTS, max_new_tokens=6, eos_token_ids=())]
    expected = stock_generate(model, PROMPTS, max_new_tokens=6, eos_token_id=[], pad_token_id=0)[:, -6:].tolist()
    assert first != second and second == expected


def test_word_hashes_see_moves_within_a_row():
    from hf_async_cb.model.hqq_four_bit_copy import word_hashes

    words = torch.randint(-2**31, 2**31 - 1, (40, 64), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    swapped, nudged = words.clone(), words.clone()
    swapped[3, [5, 9]] = words[3, [9, 5]]
    nudged[7, 0] += 1 << 27
    nudged[7, 1] -= 1 << 27
    rows_moved = words[[1, 0, *range(2, 40)]]
    hashes = word_hashes([words, swapped, nudged, rows_moved, words.clone()])
    assert len(set(hashes[:4])) == 4 and hashes[4] == hashes[0]


def test_a_serving_loop_reads_words_written_in_an_inference_tensor():
    """Words made (and written) under inference_mode keep no version counter: a loop hashes them at
    each admission, prefix caching on or off."""
    for prefix_caching in (True, False):
        model = _three_bit_model()
        for module in model.modules():
            if type(module).__name__ == "HQQLinear":
                with torch.inference_mode():
                    module.W_q = torch.nn.Parameter(module.W_q.clone(), requires_grad=False)
        copies = DecodeGemms(model, None).copies
        assert copies and all(c.version() is None for c in copies)
        first, second, expected = _served_around(
            model, PROMPTS[2], lambda engine: _requantize(model, seed=10, through_data=False),
            prefix_caching=prefix_caching)
        assert first != second and second == expected


@pytest.mark.parametrize("replace", ["words_data", "scale"])
@pytest.mark.parametrize("nbits", [3, 4])
def test_a_serving_loop_refuses_hqq_tensors_given_new_data(replace, nbits):
    """`W_q.data = ...` (same Parameter, other storage) or `meta["scale"] = ...` (another tensor in HQQ's
    dict) while a loop serves: the decode GEMMs read the old ones, so the next request is refused with
    the reason (as a held Engine refuses it), never served stale."""
    model = hqq_in_place(copy.deepcopy(tiny_model("llama")).to(DEVICE, MODEL_DTYPE), quantize, nbits=nbits)
    prompt = PROMPTS[0]
    engine = Engine(model, BatchingConfig(**CONFIG, mode="async"))
    try:
        engine.start()
        engine.add_request(prompt, max_new_tokens=4, eos_token_ids=()).result(timeout=60)
        module = model.model.layers[0].mlp.down_proj
        if replace == "words_data":
            module.W_q.data = module.W_q.data.clone()
        else:
            module.meta["scale"] = module.meta["scale"].clone() * 2
        with pytest.raises(RuntimeError, match="the model changed since this Engine was built"):
            engine.add_request(prompt, max_new_tokens=4, eos_token_ids=()).result(timeout=60)
    finally:
        engine.shutdown(cancel=True, timeout=60)
        engine.close()
