"""The vision towers' rotary embedding kernel: bit for bit what the towers' apply_rotary_pos_emb_vision
computes (fp32 arithmetic, one rounding), on the strided q/k views the towers pass; patched in for a
block only where a family's function agrees, given back after; a Qwen2.5-VL call runs it and gives
stock's tokens."""

import sys
import types

import pytest
import torch

from hf_async_cb.kernels.elementwise import vision_rotary
from hf_async_cb.kernels.paged_attention import runs_on
from hf_async_cb.model import vision_rotary as vr

qwen2_vl = pytest.importorskip("transformers.models.qwen2_vl.modeling_qwen2_vl")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # (the CPU runs the kernel in Triton's interpreter)


@pytest.mark.parametrize("tokens", [None, 1, 4])  # per program: None the default (1 on the GPU)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads, dim", [((4, 4), 80), ((3, 1), 16), ((2, 2), 6), ((16, 16), 80)])
def test_the_kernel_is_the_towers_rotary_bit_for_bit(dtype, heads, dim, tokens):
    g = torch.Generator().manual_seed(0)
    seq = 7
    qkv = (torch.randn(seq, 2 * heads[0] + heads[1], dim, generator=g) * 4).to(DEVICE, dtype)
    q, k = qkv[:, :heads[0]], qkv[:, heads[0]:heads[0] + heads[1]]  # strided views of one projection
    cos, sin = (torch.randn(seq, dim, generator=g).to(DEVICE) for _ in range(2))  # fp32, as the towers make them
    got = vision_rotary(q, k, cos, sin, tokens)
    expected = qwen2_vl.apply_rotary_pos_emb_vision(q, k, cos, sin)
    for a, b in zip(got, expected):
        assert a.dtype == b.dtype and a.is_contiguous()
        assert torch.equal(a, b)


def _fake_family(fn):
    name = "transformers.models.fake_tower.modeling_fake_tower"
    module = types.ModuleType(name)
    module.apply_rotary_pos_emb_vision = fn
    cls = type("FakeVisionAttention", (torch.nn.Module,), {"__module__": name})
    sys.modules[name] = module
    return module, cls()


def _interleaved(q, k, cos, sin):  # a different form: pairs (x0, x1) rotated, not halves
    def rot(x):
        x = x.float()
        pairs = torch.stack([-x[..., 1::2], x[..., ::2]], -1).flatten(-2)
        return (x * cos[:, None] + pairs * sin[:, None]).to(q.dtype)
    return rot(q), rot(k)


def test_a_family_whose_function_disagrees_keeps_its_own():
    module, tower = _fake_family(_interleaved)
    try:
        q, k = torch.randn(5, 2, 8), torch.randn(5, 2, 8)
        cos, sin = torch.randn(5, 8), torch.randn(5, 8)
        with vr.fused_vision_rotary(tower) as n:
            assert n == 1 and module.apply_rotary_pos_emb_vision is not _interleaved
            got = module.apply_rotary_pos_emb_vision(q, k, cos, sin)
        assert module.apply_rotary_pos_emb_vision is _interleaved
        for a, b in zip(got, _interleaved(q, k, cos, sin)):
            assert torch.equal(a, b)
    finally:
        del sys.modules[module.__name__]


def test_patches_nest_and_are_given_back_and_grad_runs_the_original():
    module, tower = _fake_family(qwen2_vl.apply_rotary_pos_emb_vision)
    try:
        own = module.apply_rotary_pos_emb_vision
        with vr.fused_vision_rotary(tower):
            fused = module.apply_rotary_pos_emb_vision
            with vr.fused_vision_rotary(tower):
                assert module.apply_rotary_pos_emb_vision is fused
            assert module.apply_rotary_pos_emb_vision is fused
            q = torch.randn(3, 2, 8, requires_grad=True)
            out, _ = fused(q, torch.randn(3, 2, 8), torch.randn(3, 8), torch.randn(3, 8))
            assert out.requires_grad  # the original's autograd graph, not the kernel's output
        assert module.apply_rotary_pos_emb_vision is own
    finally:
        del sys.modules[module.__name__]


def test_a_qwen2_5_vl_call_runs_the_kernel_and_gives_stock_tokens(monkeypatch):
    pytest.importorskip("PIL")
    import vlm_families as V

    import hf_async_cb

    model = V.build_model("qwen2_5_vl")
    model.generation_config.eos_token_id = None
    inputs = V.build_inputs("qwen2_5_vl", "one_each")
    calls = []

    def counted(*args):
        calls.append(args[0].shape)
        return vision_rotary(*args)

    monkeypatch.setattr(vr, "vision_rotary", counted)
    expected = model.generate(**inputs, max_new_tokens=6, do_sample=False)
    assert not calls
    got = model.generate(**inputs, max_new_tokens=6, do_sample=False, batching="async")
    hf_async_cb.release(model)
    assert torch.equal(got, expected)
    layers = [shape for shape in calls if shape[0] != 5]  # (5 rows: the agreement check's, once per process)
    # every layer of the one tower run (a CPU model without Triton's interpreter runs the torch code)
    assert len(layers) == (model.config.vision_config.depth if runs_on(torch.device("cpu")) else 0)
