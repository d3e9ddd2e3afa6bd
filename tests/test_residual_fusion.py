"""residual_fusion: which decoder layers the AST matcher accepts, and that a model whose residual adds
run in add_rms_norm gives what the unfused model gives (hidden states included), never serves a
stale stash, falls back to the original forward where it must, and restores cleanly."""

import copy
import importlib.util
import inspect

import pytest
import torch
import transformers
from models import COMMON, tiny_model
from transformers.models.cohere import modeling_cohere
from transformers.models.gemma import modeling_gemma
from transformers.models.gemma2 import modeling_gemma2
from transformers.models.granite import modeling_granite
from transformers.models.llama import modeling_llama
from transformers.models.mistral import modeling_mistral
from transformers.models.phi3 import modeling_phi3
from transformers.models.qwen2 import modeling_qwen2
from transformers.models.qwen3 import modeling_qwen3

from hf_async_cb.model import elementwise_fusion as ew
from hf_async_cb.model import residual_fusion as rf
from hf_async_cb.model.elementwise_fusion import fuse_elementwise
from hf_async_cb.model.fusion import fuse_projections

# What the installed transformers' layers look like: 5.24 renamed the layers' `past_key_values` to
# `cache` (the old name still taken, through a deprecate_kwarg wrapper), and from some 5.2x on
# GradientCheckpointingLayer wraps forward where older versions (5.17) override __call__.
CACHE_KEYWORD = "cache" if "cache" in inspect.signature(modeling_llama.LlamaDecoderLayer.forward).parameters \
    else "past_key_values"
FORWARD_WRAPPED = "__call__" not in vars(transformers.modeling_layers.GradientCheckpointingLayer)

pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="the CPU run of the interpreted kernels (CUDA runs test_gpu.py)")

# transformers 5.17's form of the Llama layer: past_key_values and cache_position, another deprecation.
FORM_5_17 = '''
import torch
from transformers.models.llama.modeling_llama import LlamaDecoderLayer
from transformers.utils.deprecation import deprecate_kwarg


class Layer(LlamaDecoderLayer):
    @deprecate_kwarg("past_key_value", new_name="past_key_values", version="4.58")
    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values=None,
        use_cache: bool | None = False,
        cache_position: torch.LongTensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs,
    ) -> torch.Tensor:
        """A docstring, ignored."""
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        # Self Attention
        hidden_states, _ = self.self_attn(
            hidden_states=hidden_states,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            use_cache=use_cache,
            cache_position=cache_position,
            position_embeddings=position_embeddings,
            **kwargs,
        )
        hidden_states = residual + hidden_states

        # Fully Connected
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        hidden_states = residual + hidden_states
        return hidden_states
'''

MODIFIED = {
    "scaled-residual": ("hidden_states = residual + hidden_states\n\n", "hidden_states = residual + 2 * hidden_states\n\n"),
    "non-parameter-passed": ("position_ids=position_ids", "position_ids=residual"),
    "positional-argument": ("hidden_states=hidden_states,", "hidden_states,"),
    "attention-weights-as-residual": ("hidden_states, _ = self", "hidden_states, residual = self"),
    "residual-named-as-a-parameter": ("residual", "attention_mask"),
    "norm-after-mlp": ("hidden_states = self.post_attention_layernorm(hidden_states)\n        hidden_states = self.mlp",
                       "hidden_states = self.mlp(hidden_states)\n        hidden_states = self.post_attention_layernorm"),
    "extra-statement": ("        return hidden_states",
                        "        hidden_states = hidden_states.clone()\n        return hidden_states"),
    "tuple-return": ("return hidden_states", "return (hidden_states,)"),
    "other-decorator": ("    @deprecate_kwarg", "    @torch.no_grad()\n    @deprecate_kwarg"),
    "other-norm": ("self.post_attention_layernorm(", "self.input_layernorm("),
}


def load_layer(tmp_path, name, source):
    """The Layer class of `source`, loaded from a file (the matcher reads the source)."""
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"residual_fusion_{name.replace('-', '_')}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Layer


@pytest.mark.parametrize("modeling", [modeling_llama, modeling_mistral, modeling_qwen2, modeling_qwen3])
def test_matcher_accepts_plain_prenorm_layers(modeling):
    layer = next(c for n, c in vars(modeling).items() if n.endswith("DecoderLayer"))
    form = rf.plain_prenorm(layer)
    assert form is not None and form.hidden == form.attn_keyword == "hidden_states"
    assert (CACHE_KEYWORD, CACHE_KEYWORD) in form.passes and form.var_keyword == "kwargs"
    assert form.deprecated == (("past_key_values",) if CACHE_KEYWORD == "cache" else ())
    assert form.checkpointing == FORWARD_WRAPPED


@pytest.mark.parametrize("modeling", [modeling_granite, modeling_phi3, modeling_gemma2, modeling_cohere])
def test_matcher_rejects_other_layers(modeling):
    """Granite's multipliers, Phi3's dropouts, Gemma2's extra norms, Cohere's parallel MLP."""
    layer = next(c for n, c in vars(modeling).items() if n.endswith("DecoderLayer"))
    assert rf.plain_prenorm(layer) is None


def test_gemma_norms_are_left_alone():
    """Gemma's layer has the plain pattern, but its RMSNorm scales by (1 + weight): no fused norm, so
    no residual fusion either."""
    assert rf.plain_prenorm(modeling_gemma.GemmaDecoderLayer) is not None
    torch.manual_seed(0)
    model = transformers.GemmaForCausalLM(transformers.GemmaConfig(**COMMON, head_dim=16)).eval()
    with fuse_elementwise(model) as fused:
        assert fused.add_norms == 0
        assert not any("forward" in vars(layer) for layer in model.model.layers)


def test_matcher_accepts_the_5_17_form(tmp_path):
    form = rf.plain_prenorm(load_layer(tmp_path, "form_5_17", FORM_5_17))
    assert form is not None and form.deprecated == ("past_key_value",) and form.checkpointing == FORWARD_WRAPPED
    assert dict(form.passes) == {n: n for n in ("attention_mask", "position_ids", "past_key_values", "use_cache",
                                                "cache_position", "position_embeddings")}


@pytest.mark.parametrize("change", list(MODIFIED))
def test_matcher_rejects_modified_copies(tmp_path, change):
    old, new = MODIFIED[change]
    assert old in FORM_5_17
    source = FORM_5_17.replace(old, new) if change == "residual-named-as-a-parameter" else FORM_5_17.replace(old, new, 1)
    assert rf.plain_prenorm(load_layer(tmp_path, change, source)) is None


def count_kernel_calls(monkeypatch):
    calls = {"rms_norm": 0, "add_rms_norm": 0}
    for name in calls:
        def counted(*args, _name=name, _fn=getattr(ew, name)):
            calls[_name] += 1
            return _fn(*args)
        monkeypatch.setattr(ew, name, counted)
    return calls


def fused(model, residuals=True):
    """model (a copy) with projections and element-wise fusions, the residual ones or not."""
    model = copy.deepcopy(model)
    projections = fuse_projections(model)
    if not residuals:
        with pytest.MonkeyPatch.context() as m:
            m.setattr(rf, "fuse_residuals", lambda *args: None)
            return model, projections, fuse_elementwise(model)
    return model, projections, fuse_elementwise(model)


def ids(seed=0, batch=2, length=8):
    return torch.randint(3, 256, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family,q_k_norms", [("llama", 0), ("qwen3", 2)])
def test_fused_model_matches_unfused(family, q_k_norms, monkeypatch):
    original = tiny_model(family)
    model, projections, elementwise = fused(original)
    plain, plain_projections, plain_elementwise = fused(original, residuals=False)
    layers = len(model.model.layers)
    assert elementwise.add_norms == 2 * layers and plain_elementwise.add_norms == 0
    assert elementwise.summary().endswith(f", {2 * layers} add+RMSNorm")
    calls = count_kernel_calls(monkeypatch)
    x = ids(seed=1)
    with torch.no_grad():
        got = model(x, output_hidden_states=True)
        # Every residual add in add_rms_norm; of the plain norms, only the first layer's input norm.
        assert calls == {"add_rms_norm": 2 * layers, "rms_norm": 1 + q_k_norms * layers}
        expected, unfused = plain(x, output_hidden_states=True), original(x, output_hidden_states=True)
    torch.testing.assert_close(got.logits, unfused.logits, rtol=1e-5, atol=1e-5)
    assert len(got.hidden_states) == len(unfused.hidden_states) == layers + 1
    for a, b, c in zip(got.hidden_states, expected.hidden_states, unfused.hidden_states):
        assert torch.equal(a, b)  # add_rms_norm is the add, then the same rms_norm kernel: bit for bit
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-5)
    assert torch.equal(got.logits, expected.logits)
    for handle in (elementwise, projections, plain_elementwise, plain_projections):
        handle.restore()


def test_bf16_model_is_bit_for_bit_the_unfused_kernels():
    original = copy.deepcopy(tiny_model("qwen3")).to(torch.bfloat16)
    (model, p1, f1), (plain, p2, f2) = fused(original), fused(original, residuals=False)
    x = ids(seed=2, batch=1)
    with torch.no_grad():
        got, expected = model(x, output_hidden_states=True), plain(x, output_hidden_states=True)
    assert all(torch.equal(a, b) for a, b in zip(got.hidden_states, expected.hidden_states))
    assert torch.equal(got.logits, expected.logits)
    for handle in (f1, p1, f2, p2):
        handle.restore()


def test_a_modified_layer_output_is_normed_afresh(monkeypatch):
    """A hook that changes layer 0's output in place: the next norm must not serve the stash."""
    original = tiny_model("llama")
    model, projections, elementwise = fused(original)
    reference = copy.deepcopy(original)

    def double(module, args, output):
        output.mul_(2)

    for m in (model, reference):
        m.model.layers[0].register_forward_hook(double)
    calls = count_kernel_calls(monkeypatch)
    x = ids(seed=3)
    with torch.no_grad():
        got, expected = model(x).logits, reference(x).logits
    assert calls["rms_norm"] == 2  # layer 0's input norm, and layer 1's, recomputed
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    elementwise.restore()
    projections.restore()


def test_stash_serves_only_its_own_unmodified_tensor():
    stash, weight = rf._Stash(), torch.ones(4)
    x, normed = torch.randn(2, 4), torch.randn(2, 4)
    stash.put(x, normed, weight)
    assert stash.take(x, weight) is normed
    assert stash.take(x, weight) is None  # served once
    stash.put(x, normed, weight)
    assert stash.take(x.clone(), weight) is None and stash.take(x, weight) is None  # any other call drops it
    stash.put(x, normed, weight)
    x.add_(1)
    assert stash.take(x, weight) is None  # modified in place since
    stash.put(x, normed, weight)
    weight.mul_(2)
    assert stash.take(x, weight) is None  # the norm's weight changed
    with torch.inference_mode():
        y = torch.randn(2, 4)
    stash.put(y, normed, weight)
    assert stash.take(y, weight) is None  # no version counter: never stashed


def test_fallbacks(monkeypatch):
    original = tiny_model("llama")
    model, projections, elementwise = fused(original)
    calls = count_kernel_calls(monkeypatch)
    x = ids(seed=4)
    # Inference tensors have no version counter: the adds inside layers fuse, none across them.
    with torch.inference_mode():
        got = model(x).logits
    assert calls == {"add_rms_norm": 2, "rms_norm": 3}
    with torch.no_grad():
        torch.testing.assert_close(got, original(x).logits, rtol=1e-5, atol=1e-5)
    # Autograd: the original forward, gradients flow.
    calls.update(add_rms_norm=0, rms_norm=0)
    model.model.layers[0](model.model.embed_tokens(x), position_embeddings=model.model.rotary_emb(
        model.model.embed_tokens(x), torch.arange(8)[None])).sum().backward()
    assert calls["add_rms_norm"] == 0 and model.model.layers[0].mlp.down_proj.weight.grad is not None
    # A deprecated keyword name (5.24 on): the decorated original renames it, so the original runs.
    layer, stock = model.model.layers[1], original.model.layers[1]
    try:
        with torch.no_grad():
            h = torch.randn(2, 8, 64)
            pe = model.model.rotary_emb(h, torch.arange(8)[None])
            if CACHE_KEYWORD == "cache":
                with pytest.warns(FutureWarning):
                    out = layer(h, position_embeddings=pe, past_key_values=None)
                assert calls["add_rms_norm"] == 0
                torch.testing.assert_close(out, stock(h, position_embeddings=pe), rtol=1e-5, atol=1e-5)
            layer(h, position_embeddings=pe, **{CACHE_KEYWORD: None})
            assert calls["add_rms_norm"] == 2
            with pytest.raises(TypeError):  # as the original: an unknown positional argument does not bind
                layer(h, None, None, None, None, pe, "extra")
    finally:
        elementwise.restore()
        projections.restore()


@pytest.mark.filterwarnings("ignore::FutureWarning")  # 5.24's attention, given 5.17's past_key_values
def test_the_5_17_form_runs_fused(tmp_path, monkeypatch):
    """A model whose layers have 5.17's forward: fused, same output; the 5.17 deprecated name falls back."""
    layer_class = load_layer(tmp_path, "form_5_17_run", FORM_5_17)
    original = copy.deepcopy(tiny_model("llama"))
    for layer in original.model.layers:
        layer.__class__ = layer_class
    model, projections, elementwise = fused(original)
    assert elementwise.add_norms == 4
    calls = count_kernel_calls(monkeypatch)
    x = ids(seed=5)
    with torch.no_grad():
        got, expected = model(x, use_cache=False).logits, original(x, use_cache=False).logits
        assert calls["add_rms_norm"] == 4
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        h = torch.randn(1, 3, 64)
        pe = model.model.rotary_emb(h, torch.arange(3)[None])
        model.model.layers[0](h, position_embeddings=pe, past_key_value=None)  # (deprecated since 4.58: no warning)
        assert calls["add_rms_norm"] == 4
    elementwise.restore()
    projections.restore()


def test_detach_attach_restore():
    original = tiny_model("qwen3")
    model, projections, elementwise = fused(original)
    layers = model.model.layers
    assert all("forward" in vars(layer) for layer in layers) and "forward" in vars(model.model.norm)
    x = ids(seed=6)
    with torch.no_grad():
        first = model(x).logits
        elementwise.detach()
        assert not any("forward" in vars(m) for m in (*layers, model.model.norm))
        assert all(s._x is None for s in elementwise._stashes)
        torch.testing.assert_close(model(x).logits, first, rtol=1e-5, atol=1e-5)
        elementwise.attach()
        assert torch.equal(model(x).logits, first)
    elementwise.restore()
    projections.restore()
    assert not any("forward" in vars(m) for m in model.modules())
    assert type(layers[0]).forward is modeling_qwen3.Qwen3DecoderLayer.forward
