"""Checkpoints saved by llm-compressor (compressed-tensors: int8 and packed int4 weights in groups,
float8 weights with static or per-token dynamic float8 activations), loaded as a user loads them with
`from_pretrained`. transformers gives the model a forward pre-hook that decompresses every weight in
place on its first forward; the engine calls the model's own forward, so the hook runs there too,
whether the engine or stock generate runs first. Tokens are stock's, in both loops, fused or not.
"""

import copy

import pytest
import torch
import transformers
from models import COMMON, left_pad, random_prompts, scaled

import hf_async_cb
from hf_async_cb import BatchingConfig

ct = pytest.importorskip("compressed_tensors", reason="compressed-tensors is not installed")
from compressed_tensors.compressors import ModelCompressor  # noqa: E402
from compressed_tensors.quantization import (QuantizationConfig, apply_quantization_config,  # noqa: E402
                                             preset_name_to_scheme)
from compressed_tensors.quantization.utils import calculate_qparams  # noqa: E402

# (preset, saved format, group size where the preset groups): what llm-compressor's recipes save
SCHEMES = {
    "w8a16-int": ("W8A16", "int-quantized", 32),
    "w4a16-packed": ("W4A16", "pack-quantized", 32),
    "fp8-static": ("FP8", "float-quantized", None),  # per-tensor weights and activations, static scales
    "fp8-dynamic": ("FP8_DYNAMIC", "float-quantized", None),  # per-row weights, per-token dynamic activations
}


def _calibrate(module: torch.nn.Module) -> None:
    """Weight scales (and zero points) from the weight's own range, per tensor, row or group: what
    llm-compressor's min-max observer gives for a weight-only recipe."""
    args = module.quantization_scheme.weights
    w = module.weight.detach()
    strategy = str(getattr(args.strategy, "value", args.strategy))
    if strategy == "group":
        groups = w.reshape(w.shape[0], -1, args.group_size)
        lo, hi = groups.amin(-1), groups.amax(-1)
    elif strategy == "channel":
        lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    else:
        lo, hi = w.amin().reshape(1), w.amax().reshape(1)
    scale, zero = calculate_qparams(lo, hi, args)
    module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
    if hasattr(module, "weight_zero_point"):
        module.weight_zero_point.data.copy_(zero.reshape(module.weight_zero_point.shape))


def _input_ranges(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Each linear's largest input magnitude over a calibration batch: what a static activation
    scale is set from (llm-compressor runs calibration data through the model)."""
    ranges, handles = {}, []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            handles.append(module.register_forward_pre_hook(
                lambda m, args, name=name: ranges.__setitem__(name, args[0].detach().abs().amax().reshape(1))))
    with torch.no_grad():
        model(torch.randint(3, 256, (4, 24), generator=torch.Generator().manual_seed(3)))
    for handle in handles:
        handle.remove()
    return ranges


def _save(path, name: str) -> None:
    preset, fmt, group = SCHEMES[name]
    torch.manual_seed(0)
    model = scaled(transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON)).eval())
    ranges = _input_ranges(model)
    scheme = preset_name_to_scheme(preset, ["Linear"])
    if group is not None:  # (the presets' 128 is wider than the tiny model's rows)
        scheme = scheme.model_copy(update={"weights": scheme.weights.model_copy(update={"group_size": group})})
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
    for module_name, module in model.named_modules():
        if getattr(module, "quantization_scheme", None) is not None:
            _calibrate(module)
            if hasattr(module, "input_scale"):  # static activation scales (uncalibrated, they hold garbage)
                module.input_scale.data.copy_((ranges[module_name] / 448).reshape(module.input_scale.shape))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    model.save_pretrained(path)
    compressor.update_config(path)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    paths = {}
    for name in SCHEMES:
        paths[name] = str(tmp_path_factory.mktemp(name))
        _save(paths[name], name)
    return paths


def _load(path: str) -> torch.nn.Module:
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    assert str(model.model.layers[0].self_attn.q_proj.quantization_status) == "QuantizationStatus.COMPRESSED"
    return model


def _greedy(model, batching, **kwargs) -> torch.Tensor:
    ids, mask = left_pad(random_prompts(4, 5, 20, seed=7))
    return model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=8, eos_token_id=None,
                          pad_token_id=0, batching=batching, **kwargs)


@pytest.mark.parametrize("name", list(SCHEMES))
def test_compressed_checkpoints_give_stocks_tokens_whoever_runs_first(checkpoints, name):
    """The engine meets the still-compressed weights first (packed int32, int8 or float8 data beside
    their scales); stock runs on a copy taken before either ran. (A copy, not a second load: with
    transformers 5.24 and compressed-tensors 0.20 two loads of one checkpoint in one process can
    decompress to different weights, depending on what was loaded before.)"""
    for mode in ("sync", "async"):
        for fuse in (False, True):
            model = _load(checkpoints[name])
            twin = copy.deepcopy(model)
            got = _greedy(model, mode, batching_config=BatchingConfig(fuse_projections=fuse))
            expected = _greedy(twin, "off")
            assert len(set(expected[:, -8:].flatten().tolist())) > 8, "a degenerate checkpoint (its logits NaN?)"
            assert torch.equal(got, expected), (name, mode, fuse)
            hf_async_cb.release(model)
            assert torch.equal(_greedy(model, "off"), expected)
