"""Checks every quantized weight form of the skinny GEMM shares (tests/test_int8_gemm.py,
test_hqq_gemm.py, test_quanto_gemm.py, test_torchao_float8_gemm.py, test_bnb_4bit_gemm.py): the
routed forward's logits beside the model's own, the engine's greedy tokens against stock generate
with the form routed, and an engine's listed variants against its launches."""

import pytest
import torch
from models import left_pad, random_prompts, stock_generate

import hf_async_cb.kernels.skinny_gemm as skinny
from hf_async_cb import BatchingConfig

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def assert_engine_greedy_matches_stock(model, mode: str, calls: list) -> None:
    """generate(batching=mode) with the skinny GEMM on (forced on the CPU) gives stock's greedy tokens,
    its decode steps went through the kernel (`calls`: (rows, weight shape) per routed call), and the
    model is left without instance forwards."""
    prompts = random_prompts(6, 1, 40, seed=5)
    expected = stock_generate(model, prompts, max_new_tokens=6)
    ids, mask = (t.to(DEVICE) for t in left_pad(prompts))
    config = BatchingConfig(page_size=16, max_batch_tokens=64, skinny_gemm=True)
    got = model.generate(ids, attention_mask=mask, batching=mode, batching_config=config, max_new_tokens=6)
    assert torch.equal(got.cpu(), expected.cpu())
    assert calls and min(rows for rows, *_ in calls) <= 8  # decode steps went through the kernel
    assert not any("forward" in vars(m) for m in model.modules())


def hqq_linear(n: int, k: int, *, dtype, bias=False, seed=0, nbits=4, group_size=64, axis=1, round_zero=None,
               **settings):
    """An HQQLinear of a seeded random [n, k] linear (weights times 4) on DEVICE, `dtype` its compute dtype;
    round_zero False: fractional zeros (the rounding steps then matter)."""
    from hqq.core import quantize

    torch.manual_seed(seed)
    linear = torch.nn.Linear(k, n, bias=bias).to(DEVICE)
    with torch.no_grad():
        linear.weight.mul_(4)
        if bias:
            linear.bias.uniform_(-1, 1)
    config = quantize.BaseQuantizeConfig(nbits=nbits, group_size=group_size, axis=axis, **settings)
    if round_zero is not None:  # (4 bits round the zeros by default: fractional ones round in the subtraction)
        config["weight_quant_params"]["round_zero"] = round_zero
    return quantize.HQQLinear(linear, config, compute_dtype=dtype, device=DEVICE)


def quanto_linear(n: int, k: int, weights, *, dtype, bias=False, activations=None, frozen=True, seed=0):
    """A QLinear of optimum-quanto's `weights` qtype from a seeded random [n, k] linear on DEVICE in `dtype`
    (frozen: its quantized tensor in place of the float weight)."""
    from optimum import quanto

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(k, n, bias=bias)).to(DEVICE, dtype)
    quanto.quantize(model, weights=weights, activations=activations)
    if frozen:
        quanto.freeze(model)
    return model[0]


def routed_logits(model, calls: list) -> tuple[torch.Tensor, torch.Tensor]:
    """(expected, got): the model's logits for 2 x 9 tokens from its own forward, then with its
    projections routed (DecodeGemms attached: 18 decode-sized rows through the kernel). Routed
    still, 2 x 200 tokens (400 rows, a prefill) must not reach the kernel (`calls`: its calls as the
    test's fixture records them). The model is left without instance forwards."""
    from hf_async_cb.model.decode_gemm import DecodeGemms

    ids = torch.randint(3, 256, (2, 9), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    with torch.no_grad():
        expected = model(ids).logits
    gemms = DecodeGemms(model, None)
    gemms.attach()
    try:
        with torch.no_grad():
            got = model(ids).logits
            before = len(calls)
            model(torch.randint(3, 256, (2, 200), generator=torch.Generator().manual_seed(2)).to(DEVICE))
            assert len(calls) == before  # 400 rows: the module's own forward
    finally:
        gemms.detach()
    assert not any("forward" in vars(m) for m in model.modules())
    return expected, got


def interpreter_launches(monkeypatch) -> list:
    """Every kernel launch Triton's interpreter runs from now on in the test, as (kernel, args,
    kwargs); skips the test off the CPU (it reads the interpreter's launches)."""
    from triton.runtime.interpreter import InterpretedFunction

    if DEVICE != "cpu":
        pytest.skip("records the interpreter's launches")
    seen = []
    run = InterpretedFunction.run

    def recording(self, *args, grid, warmup, **kwargs):
        seen.append((self, args, kwargs))
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", recording)
    return seen


def engine_launches_and_listing(monkeypatch, model, kernels=None) -> tuple[list, set[str], set[str]]:
    """Run an engine on `model` at several batch sizes, recording the launches of `kernels` (default:
    the skinny GEMM's; the interpreter's) and what its build handed the precompile: (launches as
    (kernel, args, kwargs), their keys, the listed keys)."""
    from hf_async_cb import Engine
    from hf_async_cb.engine import engine as engine_module
    from hf_async_cb.kernels.model_variants import facts_of, model_variants
    from hf_async_cb.kernels.variant import jit_key, variant_key

    launches = interpreter_launches(monkeypatch)
    listed = set()

    def listing(engine, model, ahead=None):
        listed.update(variant_key(v) for v in model_variants(facts_of(engine, model)))

    monkeypatch.setattr(engine_module, "precompile", listing)
    config = BatchingConfig(page_size=16, max_batch_tokens=64, skinny_gemm=True, mode="sync")
    with Engine(model, config) as engine:
        for rows in (1, 3, 9):
            engine.generate(random_prompts(rows, 2, 9, seed=rows), max_new_tokens=3)
    kernels = kernels or (skinny._skinny_gemm_kernel, skinny._splitk_reduce_kernel)
    seen = [launch for launch in launches if launch[0] in kernels]
    return seen, {jit_key(kernel, args, kwargs) for kernel, args, kwargs in seen}, listed
