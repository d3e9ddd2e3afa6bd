"""The engine follows each layer's stock mask, not the `sliding_window` keyword its attention
passes: families whose masks slide without the keyword, or whose keyword names a window their
masks never apply, give stock's tokens past the window; masks carrying a bias or looking ahead are
refused by name."""

import pytest
import torch
import transformers
from models import left_pad, random_prompts, scaled

from hf_async_cb import BatchingConfig
from hf_async_cb.model import mask_semantics

SMALL = dict(vocab_size=256, hidden_size=48, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
             eos_token_id=2)


def build(config):
    torch.manual_seed(0)
    return scaled(transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval(), 3.0)


WINDOWED = {
    # Their attention passes no `sliding_window` keyword: the window lives in the mask alone.
    "phimoe": lambda: transformers.PhimoeConfig(**SMALL, sliding_window=24, num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
        **SMALL, use_sliding_window=True, sliding_window=24, max_window_layers=3, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48),
    # Keyword and mask agree.
    "mistral": lambda: transformers.MistralConfig(**SMALL, sliding_window=24),
}


@pytest.mark.parametrize("family", list(WINDOWED))
def test_windows_follow_the_stock_masks(family):
    model = build(WINDOWED[family]())
    prompts = random_prompts(3, 30, 70, seed=5)  # longer than the window
    ids, mask = left_pad(prompts)
    kwargs = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0, eos_token_id=None)
    expected = model.generate(ids, **kwargs)
    for mode, config in (("sync", BatchingConfig()), ("async", BatchingConfig(max_batch_tokens=16, page_size=4))):
        assert torch.equal(model.generate(ids, batching=mode, batching_config=config, **kwargs), expected), mode


EDITED = {
    # Their attention modules keep the window they were built with; stock's masks read the config.
    "gemma2": lambda: transformers.Gemma2Config(**SMALL, sliding_window=40),
    "qwen2": lambda: transformers.Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=40, max_window_layers=0),
    # It reads the config at call time.
    "mistral": lambda: transformers.MistralConfig(**SMALL, sliding_window=40),
}


@pytest.mark.parametrize("after_a_call", [False, True])
@pytest.mark.parametrize("family", list(EDITED))
def test_a_window_changed_in_the_config_after_the_model_was_built_is_the_one_applied(family, after_a_call):
    """`model.config.sliding_window` set after the model was built: stock's masks apply the new window,
    while some families' attention modules keep passing the old one as their keyword; the engine
    applies the masks' (it gave a model built with the old window's tokens)."""
    model = build(EDITED[family]())
    ids, mask = left_pad(random_prompts(3, 34, 44, seed=6))  # past the new window, within the old one
    kwargs = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None)
    if after_a_call:
        model.generate(ids, batching="sync", **kwargs)
    model.config.sliding_window = 20
    expected = model.generate(ids, **kwargs)
    for mode in ("sync", "async"):
        assert torch.equal(model.generate(ids, batching=mode, **kwargs), expected), mode


def test_a_stray_window_the_masks_never_apply_is_not_applied():
    """OLMoE's attention passes `sliding_window` from its config, but its masks are full causal ones:
    the engine's logits are the model's own forward's over the whole sequence. (Stock's cached
    generate is no oracle here: its cache drops keys past the window that its masks still show.)"""
    model = build(transformers.OlmoeConfig(**{**SMALL, "hidden_size": 64}, sliding_window=24, num_experts=4,
                                           num_experts_per_tok=2))
    prompt = random_prompts(1, 40, 40, seed=5)[0]
    out = model.generate(torch.tensor([prompt]), batching="sync", max_new_tokens=6, do_sample=False, pad_token_id=0,
                         eos_token_id=None, return_dict_in_generate=True, output_logits=True)
    with torch.no_grad():
        reference = model(out.sequences).logits[0, len(prompt) - 1:-1]
    assert torch.allclose(torch.cat(out.logits), reference, atol=1e-4, rtol=0)


def test_what_the_masks_say_per_layer():
    qwen = build(WINDOWED["qwen2_moe"]())
    found = mask_semantics.read_masks(qwen)
    layers = [layer.self_attn for layer in qwen.model.layers]
    # qwen2_moe's layer types: sliding, full, sliding (max_window_layers); no keyword anywhere.
    assert [found.windows[id(m)][1:] for m in layers] == [(True, None), (False, None), (True, None)]
    assert not found.bias and not found.bidirectional
    assert qwen.config.sliding_window == 24  # the probe's shrunk window given back
    mask_semantics.apply_masks(qwen)
    assert [mask_semantics.window_override(m, None) for m in layers] == [24, None, 24]


def test_a_bias_in_the_mask_is_refused():
    doge = build(transformers.DogeConfig(**{**SMALL, "num_hidden_layers": 2}, is_moe=False))
    with pytest.raises(ValueError, match="adds a bias to the scores through the mask"):
        doge.generate(torch.tensor([[5, 6, 7, 8]]), max_new_tokens=3, batching="sync")


def test_a_bidirectional_mask_is_refused():
    gemma = build(transformers.Gemma3TextConfig(**{**SMALL, "num_hidden_layers": 2}, sliding_window=5,
                                                layer_types=["sliding_attention", "full_attention"],
                                                use_bidirectional_attention=True))
    with pytest.raises(ValueError, match="its attention is bidirectional"):
        gemma.generate(torch.tensor([[5, 6, 7, 8]]), max_new_tokens=3, batching="sync")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16_bit_masks_are_read_as_such(dtype):
    """Eager masks hold their own dtype's minimum where masked (fp16's is -65504): neither taken for
    a bias nor missed as a window."""
    model = build(WINDOWED["mistral"]()).to(dtype)
    found = mask_semantics.read_masks(model)
    assert not found.bias and not found.bidirectional
    assert [slides for _, slides, _ in found.windows.values()] == [True] * 3
