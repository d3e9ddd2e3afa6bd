"""fuse_elementwise: the RMSNorm, rotary and SiLU-mul kernels reproduce the torch code they replace
(rotary bit for bit; RMSNorm and SiLU-mul bit for bit in bf16/fp16 but for rare ulps, and within
1e-6 in fp32, where the mean's reduction order and exp's implementation differ from torch's CPU
code), fused models match the originals, and restore() undoes everything."""

import copy
import sys

import pytest
import torch
import torch.nn.functional as F
import transformers
from models import left_pad, random_prompts, stock_generate, tiny_model
from sm90 import assert_compiles_for_sm90
from transformers.models.gemma3 import modeling_gemma3
from transformers.models.llama import modeling_llama
from transformers.models.qwen3 import modeling_qwen3

from hf_async_cb.model import elementwise_fusion as ew
from hf_async_cb.model.elementwise_fusion import fuse_elementwise
from hf_async_cb.model.fusion import fuse_projections

# CPU tensors through Triton's interpreter (set by conftest where there is no CUDA); on a CUDA
# machine test_gpu.py runs the kernels and the fused models on the device instead.
pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="the CPU run of the interpreted kernels (CUDA runs test_gpu.py)")

ORIGINAL_ROTARY = {m: m.apply_rotary_pos_emb for m in (modeling_llama, modeling_qwen3)}
apply_rotary = ORIGINAL_ROTARY[modeling_llama]
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
LLAMA_LIKE = ("llama", "qwen2", "qwen3", "mistral", "phi3")


def assert_matches(got, expected):
    """fp32: within 1e-6. bf16/fp16: equal, but for the rare element whose fp32 intermediate, one fp32
    ulp off (reduction order, numpy's exp against torch's), rounds the other way: the rounded
    intermediate is then one ulp off, and the output, a product of it, at most two; under 1%."""
    assert got.shape == expected.shape and got.dtype == expected.dtype
    if expected.dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
        return
    diff = (got.float() - expected.float()).abs()
    assert (diff <= 2 * torch.finfo(expected.dtype).eps * expected.float().abs()).all()
    assert (diff > 0).float().mean() < 0.01


def randn(*shape, dtype=torch.float32, seed=0, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def rms_module(width, dtype, weight_dtype=None):
    norm = modeling_llama.LlamaRMSNorm(width, eps=1e-5).to(weight_dtype or dtype)
    with torch.no_grad():
        norm.weight.copy_(randn(width, seed=1) + 1)
    return norm


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_kernel(dtype):
    norm = rms_module(48, dtype)
    x = randn(3, 5, 48, dtype=dtype, scale=3)
    assert_matches(ew.rms_norm(x, norm.weight, norm.variance_epsilon), norm(x))
    # A transposed view (rows need two strides) and a slice of a wider buffer (row stride != width).
    xt = randn(2, 4, 3, 48, dtype=dtype).transpose(1, 2)
    assert_matches(ew.rms_norm(xt, norm.weight, 1e-5), norm(xt))
    xs = randn(7, 100, dtype=dtype)[:, 20:68]
    assert_matches(ew.rms_norm(xs, norm.weight, 1e-5), norm(xs))
    xc = randn(48, 6, dtype=dtype).t()  # last dim not contiguous
    assert_matches(ew.rms_norm(xc, norm.weight, 1e-5), norm(xc))


def test_rms_norm_kernel_mixed_dtypes():
    norm = rms_module(32, torch.bfloat16, weight_dtype=torch.float32)  # fp32 weight, bf16 input -> fp32 out
    x = randn(4, 32, dtype=torch.bfloat16, scale=2)
    out = ew.rms_norm(x, norm.weight, 1e-5)
    assert out.dtype == torch.float32 and torch.equal(out, norm(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_kernel_is_add_then_rms_norm(dtype):
    """add_rms_norm(x, r) == (r + x, rms_norm(r + x)) bit for bit: the sum rounded as torch's add
    rounds it, the norm the rms_norm kernel's own result for that sum."""
    norm = rms_module(48, dtype)
    cases = [
        (randn(3, 5, 48, dtype=dtype, scale=3), randn(3, 5, 48, dtype=dtype, seed=7, scale=3)),
        (randn(1, 1, 48, dtype=dtype, scale=50), randn(1, 1, 48, dtype=dtype, seed=7)),  # a decode row
        # A transposed view against a contiguous residual, and a slice of a wider buffer.
        (randn(2, 4, 3, 48, dtype=dtype).transpose(1, 2), randn(2, 3, 4, 48, dtype=dtype, seed=8)),
        (randn(7, 100, dtype=dtype)[:, 20:68], randn(7, 48, dtype=dtype, seed=9)),
        (randn(48, 6, dtype=dtype).t(), randn(6, 48, dtype=dtype, seed=10).t().contiguous().t()),
    ]
    for x, residual in cases:
        total, normed = ew.add_rms_norm(x, residual, norm.weight, norm.variance_epsilon)
        expected = residual + x
        assert torch.equal(total, expected) and torch.equal(normed, ew.rms_norm(expected, norm.weight, 1e-5))
        assert total.dtype == normed.dtype == dtype and total.shape == normed.shape == x.shape
    wide = rms_module(32, torch.bfloat16, weight_dtype=torch.float32) if dtype == torch.bfloat16 else None
    if wide is not None:  # an fp32 weight: the norm in fp32, the sum in the activations' dtype
        x, residual = randn(4, 32, dtype=dtype, scale=2), randn(4, 32, dtype=dtype, seed=3)
        total, normed = ew.add_rms_norm(x, residual, wide.weight, 1e-5)
        assert total.dtype == dtype and normed.dtype == torch.float32
        assert torch.equal(normed, ew.rms_norm(residual + x, wide.weight, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_kernel(dtype):
    batch, seq, dim = 2, 5, 16
    q = randn(batch, seq, 4, dim, dtype=dtype, seed=2).transpose(1, 2)  # the usual [B,T,H,D] view
    k = randn(batch, seq, 2, dim, dtype=dtype, seed=3).transpose(1, 2)
    cos, sin = randn(batch, seq, dim, dtype=dtype, seed=4), randn(batch, seq, dim, dtype=dtype, seed=5)
    (qe, ke), (qg, kg) = apply_rotary(q, k, cos, sin), ew.rotary(q, k, cos, sin)
    assert torch.equal(qg, qe) and torch.equal(kg, ke)
    assert qg.stride() == q.stride() and kg.stride() == k.stride()  # the same layout as the inputs
    # Contiguous [B,H,T,D] inputs, and cos/sin shared by the batch.
    qc, kc, c1, s1 = q.contiguous(), k.contiguous(), cos[:1], sin[:1]
    for got, expected in zip(ew.rotary(qc, kc, c1, s1), apply_rotary(qc, kc, c1, s1)):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_kernel(dtype):
    y = randn(3, 4, 2 * 80, dtype=dtype, scale=4)
    expected = F.silu(y[..., :80]) * y[..., 80:]
    assert_matches(ew.silu_mul(y), expected)
    wide = randn(5, 400, dtype=dtype)[:, :160]  # rows with a stride
    assert_matches(ew.silu_mul(wide), F.silu(wide[:, :80]) * wide[:, 80:])


def test_fallbacks_give_the_original_results():
    fused = ew._fused_rotary(apply_rotary)
    q, k = randn(1, 3, 2, 8, seed=1), randn(1, 3, 1, 8, seed=2)  # [B, T, H, D]: unsqueeze_dim=2
    cos, sin = randn(1, 3, 8, seed=3), randn(1, 3, 8, seed=4)
    for got, expected in zip(fused(q, k, cos, sin, unsqueeze_dim=2), apply_rotary(q, k, cos, sin, 2)):
        assert torch.equal(got, expected)
    norm = rms_module(8, torch.float32)
    with fuse_elementwise(norm) as fused_norm:
        assert fused_norm.rms_norms == 1
        x = randn(2, 8).requires_grad_()
        norm(x).sum().backward()  # autograd: the original forward runs
        assert x.grad is not None and torch.isfinite(x.grad).all()


def fused_copy(family):
    model = copy.deepcopy(tiny_model(family))
    projections = fuse_projections(model)
    return model, projections, fuse_elementwise(model)


def input_ids(seed=0, batch=2, length=8):
    return torch.randint(3, 256, (batch, length), generator=torch.Generator().manual_seed(seed))


def greedy(model, ids, new=8):
    return model.generate(ids, attention_mask=torch.ones_like(ids), batching="off", do_sample=False,
                          max_new_tokens=new)


def count_kernel_calls(monkeypatch):
    calls = {}
    for name in ("rms_norm", "add_rms_norm", "rotary", "silu_mul"):
        def counted(*args, _name=name, _fn=getattr(ew, name)):
            calls[_name] = calls.get(_name, 0) + 1
            return _fn(*args)
        monkeypatch.setattr(ew, name, counted)
    return calls


@pytest.mark.parametrize("family", LLAMA_LIKE + ("gpt2",))
def test_fused_model_matches_original(family, monkeypatch):
    calls = count_kernel_calls(monkeypatch)
    original = tiny_model(family)
    model, projections, fused = fused_copy(family)
    calls.clear()  # count the model's calls, not the checks before patching
    module = type(original.model.layers[0].self_attn).__module__ if family != "gpt2" else None
    if family == "gpt2":
        assert (fused.rms_norms, fused.rotary_modules, fused.silu_muls) == (0, 0, 0)
    else:
        norms = sum(type(m).__name__.endswith("RMSNorm") for m in model.modules())
        assert (fused.rms_norms, fused.rotary_modules, fused.silu_muls) == (norms, 1, 2)
        assert getattr(sys.modules[module].apply_rotary_pos_emb, "__wrapped__", None) is not None
    assert fused.summary().startswith(f"fused {fused.rms_norms} RMSNorm, rotary in {fused.rotary_modules} module")
    ids = input_ids(seed=len(family))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, original(ids).logits, rtol=0, atol=1e-5)
    assert torch.equal(greedy(model, ids), greedy(original, ids))
    plain = {"add_rms_norm"} if family in ("llama", "qwen2", "qwen3", "mistral") else set()  # residual fusion
    assert set(calls) == (set() if family == "gpt2" else {"rms_norm", "rotary", "silu_mul"} | plain)  # they ran
    rotary = module and sys.modules[module].apply_rotary_pos_emb
    fused.restore()
    fused.restore()  # idempotent
    projections.restore()
    assert not any("forward" in m.__dict__ for m in model.modules())
    if module:
        assert sys.modules[module].apply_rotary_pos_emb is rotary.__wrapped__
    if family in ("llama", "qwen3"):
        assert sys.modules[module].apply_rotary_pos_emb is ORIGINAL_ROTARY[sys.modules[module]]


def test_bf16_model_matches_original():
    original = copy.deepcopy(tiny_model("qwen3")).to(torch.bfloat16)
    model = copy.deepcopy(original)
    with fuse_projections(model), fuse_elementwise(model) as fused:
        assert fused.rms_norms == 9
        ids = input_ids(seed=3, batch=1)
        with torch.no_grad():
            got, expected = model(ids).logits, original(ids).logits
        assert (got == expected).float().mean() > 0.99  # RMSNorm's mean may round a row differently
        torch.testing.assert_close(got, expected, rtol=2 ** -7, atol=2 ** -7)
        assert torch.equal(greedy(model, ids, new=4), greedy(original, ids, new=4))


def test_engine_with_fused_model_matches_stock():
    prompts = random_prompts(4, 1, 30, seed=5)
    expected = stock_generate(tiny_model("llama"), prompts, max_new_tokens=6)
    model, projections, fused = fused_copy("llama")
    with projections, fused:
        ids, mask = left_pad(prompts)
        got = model.generate(ids, attention_mask=mask, batching="sync", max_new_tokens=6)
    assert torch.equal(got, expected)


def test_overlapping_fusions_restore_the_original_function():
    first, p1, f1 = fused_copy("llama")
    second, p2, f2 = fused_copy("llama")
    patched = modeling_llama.apply_rotary_pos_emb
    assert patched is not apply_rotary and f1.rotary_modules == f2.rotary_modules == 1
    f1.restore()
    assert modeling_llama.apply_rotary_pos_emb is patched  # the second model still uses it
    ids = input_ids()
    with torch.no_grad():
        torch.testing.assert_close(second(ids).logits, tiny_model("llama")(ids).logits, rtol=0, atol=1e-5)
    f2.restore()
    assert modeling_llama.apply_rotary_pos_emb is apply_rotary
    # Interleaved the other way round.
    f3, f4 = fuse_elementwise(first), fuse_elementwise(second)
    f4.restore()
    assert modeling_llama.apply_rotary_pos_emb is not apply_rotary
    f3.restore()
    assert modeling_llama.apply_rotary_pos_emb is apply_rotary
    for p in (p1, p2):
        p.restore()


def test_context_manager_restores_on_exception():
    model, projections, prefused = fused_copy("qwen3")
    prefused.restore()
    with pytest.raises(RuntimeError, match="boom"):
        with fuse_elementwise(model) as fused:
            assert fused.rms_norms == 9 and modeling_qwen3.apply_rotary_pos_emb is not ORIGINAL_ROTARY[modeling_qwen3]
            raise RuntimeError("boom")
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert modeling_qwen3.apply_rotary_pos_emb is ORIGINAL_ROTARY[modeling_qwen3]
    projections.restore()


def test_unfused_projections_leave_the_mlp_alone():
    model = copy.deepcopy(tiny_model("llama"))
    with fuse_elementwise(model) as fused:
        assert (fused.rms_norms, fused.silu_muls) == (5, 0)
        assert "forward" not in model.model.layers[0].mlp.__dict__


class GemmaLikeRMSNorm(modeling_llama.LlamaRMSNorm):
    """Looks like a Llama RMSNorm but scales by (1 + weight): the check before patching must refuse it."""

    def forward(self, x):
        h = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (1 + self.weight) * h.to(x.dtype)


def test_a_different_formula_is_left_alone():
    model = torch.nn.Sequential(GemmaLikeRMSNorm(16), modeling_llama.LlamaRMSNorm(16))
    with fuse_elementwise(model) as fused:
        assert fused.rms_norms == 1
        assert "forward" not in model[0].__dict__ and "forward" in model[1].__dict__


@pytest.mark.parametrize("dtype", DTYPES)
def test_unit_offset_rms_norm_kernel(dtype):
    """Gemma's RMSNorm: (x * rsqrt(mean(x**2) + eps) * (1 + weight)) in fp32, rounded once."""
    norm = modeling_gemma3.Gemma3RMSNorm(48, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(randn(48, seed=2))
    x = randn(3, 5, 48, dtype=dtype, scale=3)
    got = ew.rms_norm(x, norm.weight, norm.eps, unit_offset=True)
    assert_matches(got, norm(x))
    assert not torch.equal(got, ew.rms_norm(x, norm.weight, norm.eps))  # the forms differ
    xt = randn(2, 4, 3, 48, dtype=dtype).transpose(1, 2)  # q/k norms see head views
    assert_matches(ew.rms_norm(xt, norm.weight, norm.eps, unit_offset=True), norm(xt))


def _tiny(model_type, **overrides):
    config = transformers.AutoConfig.for_model(model_type, **{**SMALL_CONFIG, **overrides})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # Gemma's norms start at zero (1 + weight = 1): make the weights count
        for m in model.modules():
            if type(m).__name__.endswith("RMSNorm"):
                m.weight.normal_(0, 0.5)
    return model


SMALL_CONFIG = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                    pad_token_id=0, bos_token_id=1, eos_token_id=2)


@pytest.mark.parametrize("model_type,norm_form,rotary,gelu", [
    ("gemma3_text", "unit", True, 2),  # Gemma's RMSNorm (q/k norms too), Llama's rotary, GELU-tanh MLPs
    ("gemma", "unit", True, 2),
    ("mixtral", "llama", True, 0),  # a family outside the old fixed list
    ("cohere", None, False, 0),  # LayerNorm, and an interleaved rotary: both left alone
])
def test_other_families_fuse_what_agrees(model_type, norm_form, rotary, gelu):
    original = _tiny(model_type)
    model = copy.deepcopy(original)
    ids = input_ids(seed=4)
    with torch.no_grad():
        expected = original(ids).logits
    projections = fuse_projections(model)
    with projections, fuse_elementwise(model) as fused:
        assert fused.gelu_muls == gelu
        norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
        assert fused.rms_norms == len(norms) and (norm_form is None) == (not norms)
        forms = {getattr(m.__dict__["forward"], "__func__", "stash") for m in norms}  # (residual fusion's)
        if norm_form:
            assert forms == ({ew._unit_offset_rms_forward} if norm_form == "unit" else {ew._rms_forward, "stash"})
        assert fused.rotary_modules == int(rotary)
        with torch.no_grad():
            got = model(ids).logits
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        assert torch.equal(greedy(model, ids, new=4), greedy(original, ids, new=4))
    assert not any("forward" in m.__dict__ for m in model.modules())


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_tanh_mul_kernel(dtype):
    y = randn(3, 5, 2 * 40, dtype=dtype, scale=3)
    gate, up = y.chunk(2, dim=-1)
    # torch's GPU kernel computes in fp32 and rounds once (its CPU bf16 kernel takes another path in the tails)
    expected = F.gelu(gate.float(), approximate="tanh").to(dtype) * up
    got = ew.silu_mul(y, gelu_tanh=True)
    # Where gelu's tail is ~1e-7 (x < -4), 1 + tanh(u) is a few ulps of 1 and tanh implementations (this
    # interpreter's, torch's CPU one, CUDA's) disagree by an ulp there: equal to 1e-5 absolute, elsewhere
    # to rounding (one 16-bit ulp).
    torch.testing.assert_close(got, expected, rtol=1e-5 if dtype == torch.float32 else 2 ** -7, atol=1e-5)
    if dtype != torch.float32:  # rounded to 16 bits, the body is torch's but for rare ulps
        body = expected.float().abs() > 1e-3
        assert (got[body] == expected[body]).float().mean() > 0.98


def test_kernels_compile_for_sm90():
    """The kernels compile for an H200 (no GPU needed), without the interpreter."""
    rotary = {n: "*bf16" for n in ("q_ptr", "k_ptr", "cos_ptr", "sin_ptr", "qo_ptr", "ko_ptr")}
    rotary.update({n: "i32" for n in ("seq_len", "n_q", "n_heads", "half")})
    rotary.update({n: "i64" for n in "sqb sqh sqt skb skh skt scb sct sob soh sot skob skoh skot".split()})
    module = "hf_async_cb.kernels.elementwise"
    assert_compiles_for_sm90([
        (module, "_rms_norm_kernel", {"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16", "n_rows": "i32",
                                      "n_cols": "i32", "inner": "i32", "stride_outer": "i64", "stride_inner": "i64",
                                      "inv_n": "fp32", "eps": "fp32"},
         dict(ROWS=1, BLOCK=4096, X_BF16=True, Y_BF16=True, LIBDEVICE=True, UNIT_OFFSET=False, ALIGNED=True)),
        (module, "_rms_norm_kernel", {"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16", "n_rows": "i32",
                                      "n_cols": "i32", "inner": "i32", "stride_outer": "i64", "stride_inner": "i64",
                                      "inv_n": "fp32", "eps": "fp32"},
         dict(ROWS=4, BLOCK=256, X_BF16=True, Y_BF16=True, LIBDEVICE=True, UNIT_OFFSET=True, ALIGNED=False)),
        (module, "_add_rms_norm_kernel", {"x_ptr": "*bf16", "r_ptr": "*bf16", "w_ptr": "*bf16", "s_ptr": "*bf16",
                                          "y_ptr": "*bf16", "n_rows": "i32", "n_cols": "i32", "inner": "i32",
                                          "stride_outer": "i64", "stride_inner": "i64", "r_outer": "i64",
                                          "r_inner": "i64", "inv_n": "fp32", "eps": "fp32"},
         dict(ROWS=1, BLOCK=4096, X_BF16=True, Y_BF16=True, LIBDEVICE=True, ALIGNED=True)),
        (module, "_rotary_kernel", rotary, dict(HEADS=16, DIM=128, BF16=True, ALIGNED=True, ROUND_TERMS=True, TOKENS=1)),
        *[(module, "_rotary_kernel", dict(rotary, cos_ptr="*fp32", sin_ptr="*fp32"),  # a vision tower's
           dict(HEADS=16, DIM=128, BF16=True, ALIGNED=True, ROUND_TERMS=False, TOKENS=tokens)) for tokens in (1, 4)],
        *[(module, "_silu_mul_kernel", {"y_ptr": "*bf16", "o_ptr": "*bf16", "n_rows": "i32", "n_cols": "i32",
                                        "stride_y": "i64"},
           dict(ROWS=1, BLOCK=1024, BF16=True, LIBDEVICE=True, GELU_TANH=gelu)) for gelu in (False, True)],
    ], options={"enable_fp_fusion": False})


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_engine_with_every_fusion_matches_stock_and_restores(family, mode, monkeypatch):
    """BatchingConfig(fuse_projections=True, fuse_elementwise=True): stock's tokens, the residual adds
    folded into the norms (two per layer), and close() gives every module and the rotary function back."""
    from models import generated_rows, random_prompts, stock_generate

    from hf_async_cb import BatchingConfig, Engine

    calls = count_kernel_calls(monkeypatch)
    model = copy.deepcopy(tiny_model(family))
    modeling = sys.modules[type(model).__module__]
    rotary = modeling.apply_rotary_pos_emb
    prompts = random_prompts(4, 3, 30, seed=5)
    expected = generated_rows(stock_generate(model, prompts, max_new_tokens=6, eos_token_id=[2], pad_token_id=0),
                              max(map(len, prompts)), 0, (2,))
    config = BatchingConfig(mode=mode, fuse_projections=True, fuse_elementwise=True, max_batch_tokens=32)
    with Engine(model, config) as engine:
        fused = engine.prepared_model.elementwise
        assert fused.rms_norms > 0 and fused.silu_muls > 0 and fused.add_norms == 2 * len(model.model.layers)
        outs = engine.generate(prompts, max_new_tokens=6, eos_token_ids=(2,))
    assert [o.output_token_ids for o in outs] == expected
    assert calls["add_rms_norm"] > 0
    assert modeling.apply_rotary_pos_emb is rotary
    assert not any("forward" in vars(m) for m in model.modules())


@pytest.mark.parametrize("model_type", ["gemma3_text", "mixtral"])
def test_engine_with_other_families_fused_matches_stock(model_type):
    """Gemma 3 (its RMSNorm form on hidden states and q/k heads, GELU-tanh-mul, rotary, sliding
    layers) and Mixtral (experts, residual fusion) through the engine with every fusion on: stock's
    greedy tokens."""
    from models import generated_rows, random_prompts, stock_generate

    from hf_async_cb import BatchingConfig, Engine

    model = _tiny(model_type, sliding_window=8) if model_type == "gemma3_text" else _tiny(model_type)
    prompts = random_prompts(3, 3, 20, seed=9)
    expected = generated_rows(stock_generate(model, prompts, max_new_tokens=5, eos_token_id=[2], pad_token_id=0),
                              max(map(len, prompts)), 0, (2,))
    config = BatchingConfig(mode="async", fuse_projections=True, fuse_elementwise=True, max_batch_tokens=32)
    with Engine(model, config) as engine:
        fused = engine.prepared_model.elementwise
        assert fused.rms_norms > 0 and fused.rotary_modules == 1
        outs = engine.generate(prompts, max_new_tokens=5, eos_token_ids=(2,))
    assert [o.output_token_ids for o in outs] == expected
