"""GPTQ and AWQ checkpoints loaded through transformers (`quant_method` "gptq" / "awq" in the config,
gptqmodel's QuantLinear modules): stock generate's tokens in both loops, projections fused and not,
and a write into a module's codes or scales is seen by the next call (no stale cached prefix).

gptqmodel 7.7 needs torch >= 2.14.1 and transformers >= 5.20, which the CI's torch does not meet: these
tests skip there, by name. To run them: `bash benchmarks/gptq_awq_check.sh` (a virtual environment with
torch 2.14.1 and gptqmodel beside the installed package).

The checkpoints hold random codes, zeros and scales in each format's layout (GPTQ v1: codes packed
along the input dimension; AWQ "gemm": along the output dimension): the tokens are compared with stock
generate on the same loaded model, so any valid codes do; no calibration is needed.
"""

import json
import os

import pytest
import torch
import transformers
from models import COMMON, left_pad, random_prompts

import hf_async_cb
from hf_async_cb import BatchingConfig

pytest.importorskip("gptqmodel", reason="gptqmodel is not installed (it needs torch >= 2.14.1)")
pytest.importorskip("optimum", reason="optimum is not installed (transformers' GPTQ loading needs it)")

GROUP = 32
RUNS = tuple((mode, fuse) for fuse in (False, True) for mode in ("sync", "async"))


def _write_checkpoint(path, bits: int, method: str, seed: int = 0) -> str:
    """A tiny Llama saved with its layers' projections replaced by random `method` codes of `bits` bits."""
    from safetensors.torch import load_file, save_file

    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON)).save_pretrained(path)
    weights = os.path.join(path, "model.safetensors")
    state = load_file(weights)
    draw = torch.Generator().manual_seed(seed + 1)

    def words(*shape):
        return torch.randint(-2**31, 2**31 - 1, shape, dtype=torch.int32, generator=draw)

    for name in [n for n in state if ".layers." in n and n.endswith("proj.weight")]:
        out_features, in_features = state.pop(name).shape
        base = name[: -len(".weight")]
        if method == "awq":
            state[base + ".qweight"] = words(in_features, out_features * bits // 32)
        else:
            state[base + ".qweight"] = words(in_features * bits // 32, out_features)
            state[base + ".g_idx"] = (torch.arange(in_features) // GROUP).to(torch.int32)
        state[base + ".qzeros"] = words(in_features // GROUP, out_features * bits // 32)
        state[base + ".scales"] = (torch.rand(in_features // GROUP, out_features, generator=draw) * 0.05
                                   + 0.02).to(torch.float16)
    save_file(state, weights, metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = (
        {"quant_method": "awq", "bits": bits, "group_size": GROUP, "version": "gemm", "zero_point": True}
        if method == "awq" else
        {"quant_method": "gptq", "bits": bits, "group_size": GROUP, "desc_act": False, "sym": True,
         "checkpoint_format": "gptq"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return str(path)


def _load(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, device_map="cpu", dtype=torch.float32).eval()


def _greedy(model, batching, config=None) -> torch.Tensor:
    ids, mask = left_pad(random_prompts(4, 5, 40, seed=7))
    kwargs = {} if config is None else {"batching_config": config}
    return model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=8, eos_token_id=None,
                          pad_token_id=0, batching=batching, **kwargs)


@pytest.mark.parametrize("method, bits", [("gptq", 2), ("gptq", 3), ("gptq", 4), ("gptq", 8), ("awq", 4)])
def test_checkpoints_give_stock_tokens_and_are_never_fused(tmp_path, method, bits):
    model = _load(_write_checkpoint(tmp_path, bits, method))
    q_proj = model.model.layers[0].self_attn.q_proj
    assert not isinstance(q_proj, torch.nn.Linear) and hasattr(q_proj, "qweight")  # gptqmodel's module
    expected = _greedy(model, "off")
    for mode, fuse in RUNS:
        got = _greedy(model, mode, BatchingConfig(fuse_projections=fuse))
        assert torch.equal(got, expected), (mode, fuse)
        assert model.model.layers[0].self_attn.q_proj is q_proj  # fusion left it in place
    hf_async_cb.release(model)
    assert torch.equal(_greedy(model, "off"), expected)


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("write", ["scales", "qweight"])
def test_a_write_into_the_codes_or_scales_is_seen_by_the_next_call(tmp_path, mode, write):
    model = _load(_write_checkpoint(tmp_path, 4, "gptq"))
    before = _greedy(model, mode)
    assert torch.equal(before, _greedy(model, "off"))
    assert torch.equal(_greedy(model, mode), before)  # the second call reads its prompts' cached pages
    assert hf_async_cb.prefix_cache_stats(model)["hit_tokens"] > 0
    module = model.model.layers[0].self_attn.q_proj
    with torch.no_grad():
        if write == "scales":
            module.scales.mul_(4.0)
        else:
            module.qweight.copy_(torch.roll(module.qweight, 1, 0))
    expected = _greedy(model, "off")
    assert not torch.equal(expected, before)  # the write changed stock's tokens
    assert torch.equal(_greedy(model, mode), expected)
