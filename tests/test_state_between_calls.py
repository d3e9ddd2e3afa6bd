"""What a user changes on a model between engine calls (or while a loop serves it) is what the next
call runs, as in stock generate, or a clear refusal: config values edited in place, tensors modules
hold as plain attributes, forwards patched onto an instance, the attention implementation switched
while serving, layers deep-copied in or removed."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from models import left_pad, random_prompts, scaled
from torch import nn

import hf_async_cb
from hf_async_cb import BatchingConfig, Engine, SamplingParams
from hf_async_cb.model.config_snapshot import config_snapshot

PROMPTS = random_prompts(3, 40, 60, seed=7)
NEW = 8
COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _llama(**kw) -> nn.Module:
    torch.manual_seed(0)
    return scaled(transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**COMMON, **kw})).eval())


def _generate(model, **kwargs) -> torch.Tensor:
    ids, mask = left_pad(PROMPTS)
    return model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                          **kwargs)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_config_list_edited_in_place_is_what_the_next_call_runs(mode):
    """Gemma 2 reads layer_types at every forward: which layers slide changes the tokens."""
    torch.manual_seed(0)
    model = scaled(transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**COMMON, head_dim=16, sliding_window=8)))
    model.eval()
    before = _generate(model, batching=mode)
    model.config.layer_types[0] = "full_attention"
    expected = _generate(model)
    assert not torch.equal(expected, before)
    assert torch.equal(_generate(model, batching=mode), expected)


def test_a_held_engine_and_a_serving_loop_refuse_a_config_edited_in_place():
    model = _llama(layer_types=["full_attention", "full_attention"])
    params = SamplingParams(max_new_tokens=4, eos_token_ids=())
    with Engine(model) as engine:
        engine.generate(PROMPTS[:1], params)
        model.config.layer_types[0] = "sliding_attention"
        with pytest.raises(RuntimeError, match="the model changed since this Engine was built"):
            engine.generate(PROMPTS[:1], params)
    model.config.layer_types[0] = "full_attention"
    with Engine(model) as engine:
        engine.start()
        assert engine.add_request(PROMPTS[0], params).result(timeout=60).output_token_ids
        model.config.layer_types[0] = "sliding_attention"
        with pytest.raises(RuntimeError, match="the model changed since this Engine was built"):
            engine.add_request(PROMPTS[0], params).result(timeout=60)


def test_the_config_snapshot_sees_edits_in_place_in_sub_configs():
    config = transformers.LlavaConfig(text_config=transformers.LlamaConfig(**COMMON))
    before = config_snapshot(config)
    config.text_config.rope_parameters["rope_theta"] = 1.0  # (a dict inside a sub-config)
    assert config_snapshot(config) != before
    config.text_config.rope_parameters["rope_theta"] = before["text_config"]["rope_parameters"]["rope_theta"]
    config._attn_implementation = "eager"  # the engine's own switch is not a change
    assert config_snapshot(config) == before


class _Steered(nn.Module):
    """Activation steering as a custom module: its vector a plain tensor attribute, not a buffer."""

    def __init__(self, inner: nn.Module, vector: torch.Tensor) -> None:
        super().__init__()
        self.inner, self.vector = inner, vector

    def forward(self, x):
        return self.inner(x) + self.vector


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_steering_vector_held_as_a_plain_attribute_is_what_the_next_call_runs(mode):
    model = _llama()
    layer = model.model.layers[0]
    layer.mlp = _Steered(layer.mlp, torch.full((64,), 3.0))
    _generate(model, batching=mode)
    hits = hf_async_cb.prefix_cache_stats(model)["hit_tokens"]
    _generate(model, batching=mode)  # unchanged: the prompts' pages are taken from the cache
    assert hf_async_cb.prefix_cache_stats(model)["hit_tokens"] > hits
    with torch.no_grad():
        layer.mlp.vector.mul_(-1)  # in place
    assert torch.equal(_generate(model, batching=mode), _generate(model))
    layer.mlp.vector = torch.full((64,), 7.0)  # another tensor
    assert torch.equal(_generate(model, batching=mode), _generate(model))


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_forward_patched_onto_an_instance_is_run_afresh_each_call(mode):
    """Its code may read anything (here a dict the caller changes): nothing it computed is reused."""
    model = _llama()
    mlp = model.model.layers[0].mlp
    state = {"scale": 1.0}
    forward = type(mlp).forward
    mlp.forward = lambda x: forward(mlp, x) * state["scale"]
    _generate(model, batching=mode)
    state["scale"] = -4.0
    assert torch.equal(_generate(model, batching=mode), _generate(model))


def test_switching_the_attention_while_a_loop_serves_takes_effect_after_it():
    model = _llama()
    params = SamplingParams(max_new_tokens=6, eos_token_ids=())
    with Engine(model, BatchingConfig(mode="async")) as engine:
        engine.start()
        first = engine.add_request(PROMPTS[0], params).result(timeout=60).output_token_ids
        model.set_attn_implementation("eager")
        assert engine.add_request(PROMPTS[0], params).result(timeout=60).output_token_ids == first
        engine.shutdown()
    assert model.config._attn_implementation == "eager"
    ids = torch.tensor([PROMPTS[0]])
    assert model.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=None)[0, -6:].tolist() == first


def test_a_layer_deep_copied_in_runs_and_leaves_no_verdict_for_its_family():
    """A deep-copied layer keeps a copy of its model's config, which its attention reads."""
    model = _llama()
    layer = copy.deepcopy(model.model.layers[-1])
    layer.self_attn.layer_idx = 2
    model.model.layers.append(layer)
    model.config.num_hidden_layers = 3
    assert torch.equal(_generate(model, batching="sync"), _generate(model))
    clean = _llama(num_hidden_layers=3)
    assert torch.equal(_generate(clean, batching="sync"), _generate(clean))


def test_a_layer_removed_without_the_config_is_refused_saying_so():
    model = _llama()
    del model.model.layers[1]
    with pytest.raises(ValueError, match="declares 2 layers .* layer indices \\[0\\]"):
        _generate(model, batching="sync")


def test_graphs_of_a_model_running_user_code_are_captured_afresh_each_call():
    """A hook reading a setting the caller changes between calls: a graph would replay the value it
    captured (on the CPU the graphs' stand-in runs eagerly, so the captures are compared)."""
    model = _llama()
    scale = {"value": 1.0}
    model.model.layers[0].mlp.register_forward_hook(lambda module, args, out: out * scale["value"])
    params = SamplingParams(max_new_tokens=6, eos_token_ids=())
    with Engine(model, BatchingConfig(cuda_graphs=True, prefix_caching=False, page_size=4)) as engine:
        engine.generate(PROMPTS, params)
        first = dict(engine.graphs._graphs)
        assert first
        scale["value"] = -2.0
        engine.generate(PROMPTS, params)
        assert engine.graphs._graphs and not any(engine.graphs._graphs.get(k) is g for k, g in first.items())


@pytest.mark.parametrize("where", ["model", "layer"])
def test_a_compiled_forward_set_on_an_instance_keeps_the_prefix_cache(where):
    """torch.compile's wrapper copies the metadata of what it wraps: it is judged by what it wraps
    (the class's own forward here), not taken for the user's code."""
    model = _llama()
    expected = _generate(model)  # (before compiling: the engine sets the compiled wrapper aside)
    module = model if where == "model" else model.model.layers[0]
    module.forward = torch.compile(module.forward)
    for _ in range(2):
        assert torch.equal(_generate(model, batching="sync"), expected)
    assert hf_async_cb.prefix_cache_stats(model)["hit_tokens"] > 0


@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
def test_a_copy_made_while_a_loop_serves_is_a_stock_model(how):
    """A copy of the model made while the engine holds it (here a serving loop; a generate call on
    another thread alike) is a stock model: it used to keep the engine's attention in its config (its
    every forward and generate raising, for good) and the fused projections' parts in place of its
    Linears (no gradient reaching their weights)."""
    import io

    model = _llama()
    expected = _generate(model, batching="off")
    engine = Engine(model, BatchingConfig(fuse_projections=True, fuse_elementwise=False, max_batch_tokens=64))
    engine.start()
    try:
        engine.add_request(PROMPTS[0], max_new_tokens=2).result()
        if how == "deepcopy":
            twin = copy.deepcopy(model)
        else:
            buffer = io.BytesIO()
            torch.save(model, buffer)
            buffer.seek(0)
            twin = torch.load(buffer, weights_only=False)
    finally:
        engine.shutdown()
        engine.close()
    assert twin.config._attn_implementation == model.config._attn_implementation
    assert {type(m) for m in twin.modules()} == {type(m) for m in model.modules()}
    assert torch.equal(_generate(twin, batching="off"), expected)
    assert torch.equal(_generate(twin, batching="sync"), expected)
    twin.train()
    ids, _ = left_pad(PROMPTS[:1])
    twin(ids, labels=ids).loss.backward()
    assert twin.model.layers[0].self_attn.q_proj.weight.grad is not None


@pytest.fixture
def patch_llama():
    """Patches of Llama's modeling code, as liger-kernel's apply_liger_kernel_to_llama() makes them (a
    class's forward, a modeling file's function), undone after the test."""
    from transformers.models.llama import modeling_llama

    saved = {"forward": modeling_llama.LlamaMLP.forward, "rotary": modeling_llama.apply_rotary_pos_emb}

    def patch(what: str):
        if what == "class forward":
            modeling_llama.LlamaMLP.forward = lambda self, x: saved["forward"](self, x) * 2.0
        else:  # the keys rotated twice as far: another formula than the one the fused kernel computes
            modeling_llama.apply_rotary_pos_emb = lambda q, k, cos, sin, *a, **kw: saved["rotary"](
                q, k, cos * cos - sin * sin, 2 * sin * cos, *a, **kw)

    yield patch
    modeling_llama.LlamaMLP.forward, modeling_llama.apply_rotary_pos_emb = saved["forward"], saved["rotary"]


@pytest.mark.parametrize("what", ["class forward", "modeling function"])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_code_patched_between_calls_is_what_the_next_call_runs(mode, fused, what, patch_llama):
    """A class's forward or a modeling file's function patched after a first call changes no model:
    the next call must not reuse the prefix cache's K/V, fusions that replaced the old code (the fused
    MLP and rotary kernels with fuse_elementwise, the CUDA default) or graphs captured on it."""
    model = _llama()
    config = BatchingConfig(fuse_projections=fused, fuse_elementwise=fused)
    before = _generate(model, batching=mode, batching_config=config)
    assert torch.equal(before, _generate(model))
    patch_llama(what)
    expected = _generate(model)
    assert not torch.equal(expected, before)
    assert torch.equal(_generate(model, batching=mode, batching_config=config), expected)


def test_a_held_engine_and_a_serving_loop_refuse_code_patched_since_and_no_verdict_is_borrowed(patch_llama):
    """A held Engine's preparation, pool and graphs were made on the old code: refused, saying so; a
    verdict of the parity check is kept per code, never borrowed by a model whose class was patched."""
    from hf_async_cb.engine import parity

    model = _llama()
    params = SamplingParams(max_new_tokens=4, eos_token_ids=())
    with Engine(model) as engine:
        engine.generate(PROMPTS[:1], params)
        verdicts = len(parity._VERDICTS)
        patch_llama("class forward")
        with pytest.raises(RuntimeError, match="modeling file's function patched"):
            engine.generate(PROMPTS[:1], params)
    with Engine(model) as engine:  # (the patched code: checked afresh)
        assert len(parity._VERDICTS) == verdicts + 1
        engine.start()
        assert engine.add_request(PROMPTS[0], params).result(timeout=60).output_token_ids
        patch_llama("modeling function")
        with pytest.raises(RuntimeError, match="the model changed since this Engine was built"):
            engine.add_request(PROMPTS[0], params).result(timeout=60)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_an_attention_modules_window_set_after_a_call_is_read_as_stock_reads_it(mode):
    """Stock's masks come from the config: a module's own `sliding_window` set after a first call
    changes nothing in stock, and must not change the window the engine attends with."""
    torch.manual_seed(0)
    model = scaled(transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**COMMON, head_dim=16, sliding_window=24)))
    model.eval()
    ids, mask = left_pad(random_prompts(3, 30, 60, seed=11))
    def generate(**kw):
        return model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=None, **kw)
    generate(batching=mode, batching_config=BatchingConfig(prefix_caching=False))
    for layer in model.model.layers:
        if getattr(layer.self_attn, "sliding_window", None):
            layer.self_attn.sliding_window = 8
    assert torch.equal(generate(batching=mode, batching_config=BatchingConfig(prefix_caching=False)), generate())


def test_a_sub_models_config_replaced_after_a_call_is_never_run_stale():
    """`model.model.config = other` (a window stock's masks then read): the next call runs the model as
    it now is or refuses it (here the parity check does), never with the old config's window."""
    torch.manual_seed(0)
    model = scaled(transformers.MistralForCausalLM(transformers.MistralConfig(**COMMON, sliding_window=32))).eval()
    _generate(model, batching="sync")
    inner = copy.deepcopy(model.model.config)
    inner.sliding_window = 8
    model.model.config = inner
    expected = _generate(model)
    try:
        got = _generate(model, batching="sync")
    except ValueError as refusal:
        assert "cannot run on hf_async_cb" in str(refusal)
    else:
        assert torch.equal(got, expected)
