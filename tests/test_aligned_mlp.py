"""aligned_mlps: a gated MLP of misaligned inner width (Qwen2.5-VL's vision tower: 3,420) runs with its
weights padded inside the block, giving the module's own output within the GEMMs' rounding; any MLP
whose forward is not proven to be the gated form, is hooked, or is aligned runs its own forward; the
modules are given back as they were; and a Qwen2.5-VL with such a tower gives stock's tokens."""

import functools

import pytest
import torch
from torch import nn
from transformers.activations import ACT2FN

from hf_async_cb.model.aligned_mlp import aligned_mlps, gated_form


class GatedMLP(nn.Module):
    def __init__(self, hidden=32, inner=58, bias=True, act="silu"):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=bias)
        self.up_proj = nn.Linear(hidden, inner, bias=bias)
        self.down_proj = nn.Linear(inner, hidden, bias=bias)
        self.act_fn = ACT2FN[act]

    def forward(self, hidden_state):
        """Qwen2.5-VL's vision MLP."""
        return self.down_proj(self.act_fn(self.gate_proj(hidden_state)) * self.up_proj(hidden_state))


class SwappedMLP(GatedMLP):
    def forward(self, x):
        return self.down_proj(self.act_fn(self.up_proj(x)) * self.gate_proj(x))


class ScaledMLP(GatedMLP):
    def forward(self, x):
        y = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        return y * 2


class NanAtZero(nn.Module):
    def forward(self, x):
        return torch.log(x)


def _taken(model):
    return functools.partial(aligned_mlps, model, on_cpu=True)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
def test_a_misaligned_gated_mlp_runs_padded_with_its_own_output(dtype, tol, bias, act):
    torch.manual_seed(0)
    m = GatedMLP(bias=bias, act=act).to(dtype)
    x = torch.randn(3, 17, 32, dtype=dtype)
    with torch.no_grad():
        expected = m(x)
        with _taken(m)() as n, torch.autograd.profiler.profile() as prof:
            assert n == 1 and "forward" in vars(m)
            got = m(x)
    pads = [e for e in prof.function_events if e.name == "aten::constant_pad_nd"]
    assert len(pads) >= 3  # the padded weights ran, not the module's own forward
    assert got.shape == expected.shape and got.dtype == expected.dtype
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol)
    assert "forward" not in vars(m)


def test_only_proven_unhooked_misaligned_mlps_are_taken():
    assert gated_form(GatedMLP)
    assert not gated_form(SwappedMLP) and not gated_form(ScaledMLP)
    hooked = GatedMLP()
    hooked.up_proj.register_forward_hook(lambda mod, args, out: out * 0)
    nan_act = GatedMLP()
    nan_act.act_fn = NanAtZero()
    owned = GatedMLP()
    owned.forward = lambda x: x
    model = nn.ModuleList([GatedMLP(inner=64), SwappedMLP(), ScaledMLP(), hooked, nan_act, owned,
                           GatedMLP(inner=60).to(torch.bfloat16), GatedMLP(inner=62).float()])
    with aligned_mlps(model, on_cpu=True) as n:
        taken = [i for i, m in enumerate(model) if "forward" in vars(m) and m is not owned]
    assert taken == [6, 7] and n == 2  # 64 bf16/fp32 widths are aligned; 62 fp32 is not (248 bytes)
    with aligned_mlps(model) as n:  # CPU modules stay as they are unless asked
        assert n == 0


def test_the_modules_are_given_back_on_an_error_and_with_grad_the_own_forward_runs():
    m = GatedMLP()
    x = torch.randn(4, 32)
    with pytest.raises(RuntimeError), _taken(m)():
        with torch.enable_grad():
            torch.testing.assert_close(m(x), GatedMLP.forward(m, x), rtol=0, atol=0)
        raise RuntimeError
    assert "forward" not in vars(m)


def test_a_qwen2_5_vl_whose_tower_mlp_is_misaligned_gives_stock_tokens(monkeypatch):
    pytest.importorskip("PIL")
    import transformers
    import vlm_families as V

    import hf_async_cb
    from hf_async_cb.model import vision

    torch.manual_seed(0)
    tok = V._qwen_tok()
    cfg = transformers.Qwen2_5_VLConfig(
        text_config=V._qwen_text("qwen2_5_vl_text", tok),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=58, num_heads=2, out_hidden_size=64,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                           fullatt_block_indexes=[1]),
        **V._qwen_ids(tok))
    model = transformers.Qwen2_5_VLForConditionalGeneration(cfg).eval()
    model.generation_config.eos_token_id = None
    inputs = V.build_inputs("qwen2_5_vl", "one_each")
    seen = []

    @functools.wraps(aligned_mlps)
    def forced(model, on_cpu=False):
        with aligned_mlps(model, on_cpu=True) as n:
            seen.append(n)
            yield n

    monkeypatch.setattr(vision, "aligned_mlps", __import__("contextlib").contextmanager(forced))
    expected = model.generate(**inputs, max_new_tokens=6, do_sample=False)
    for mode in ("sync", "async"):
        got = model.generate(**inputs, max_new_tokens=6, do_sample=False, batching=mode)
        assert torch.equal(got, expected), mode
        hf_async_cb.release(model)
    assert seen and all(n == 2 for n in seen)  # both tower blocks' MLPs ran padded


@pytest.mark.parametrize("act, fused", [("silu", "silu"), ("gelu_pytorch_tanh", "gelu_tanh"), ("relu", None)])
def test_the_activation_runs_in_the_kernel_where_triton_runs(act, fused, monkeypatch):
    from hf_async_cb.kernels.paged_attention import runs_on
    from hf_async_cb.model import aligned_mlp

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not runs_on(device):
        pytest.skip("the kernel runs on CUDA or in Triton's interpreter")
    calls = []
    kernel = aligned_mlp.silu_mul
    monkeypatch.setattr(aligned_mlp, "silu_mul",
                        lambda y, gelu_tanh=False: calls.append((y.dim(), gelu_tanh)) or kernel(y, gelu_tanh))
    torch.manual_seed(0)
    m = GatedMLP(act=act).to(device)
    x = torch.randn(2, 5, 32, device=device)
    with torch.no_grad():
        expected = m(x)
        with _taken(m)():
            got = m(x)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    layer_calls = [gelu for dim, gelu in calls if dim == 3]  # (2-D: the once-per-kind agreement check's)
    assert layer_calls == ([fused == "gelu_tanh"] if fused else [])


def test_the_padded_activation_variants_are_listed_for_cuda_modules_outside_the_language_model(monkeypatch):
    from hf_async_cb.model import aligned_mlp

    tower, text = GatedMLP(inner=58).to(torch.bfloat16), GatedMLP(inner=50).to(torch.bfloat16)
    model = torch.nn.ModuleDict(dict(tower=tower, text=text))
    monkeypatch.setattr(aligned_mlp, "_takes", lambda m, on_cpu: isinstance(m, GatedMLP))  # (as if on CUDA)
    variants = aligned_mlp.mlp_variants(model, text)
    assert variants and {v.args[3] for v in variants} == {64}  # 58 padded to 64 bf16 values; not the text's
