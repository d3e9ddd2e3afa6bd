"""Quantized weights whose rows are not computed apart: refused, since no batching reproduces them.

Dynamic activation quantization computes the activations' scales at every forward. With one scale
per token (torchao's PerRow granularity) a token's output depends on that token alone. With one
scale for the whole input (PerTensor, the default of torchao's Float8DynamicActivationFloat8Weight
config), the largest activation of any row sets every row's rounding: a request's tokens then
depend on which other requests share its forward. Stock generate itself gives a prompt other tokens
alone than in a batch, and the engine, whose steps pack other requests together than stock's
padded batch does, cannot give stock's tokens; the parity check would not see it in 16-bit models,
whose tolerance is wider than the effect. Such models are refused by name, before any work.

Read from the weights' own attributes: torchao's current tensors keep the activation settings in
`act_quant_kwargs`, its older LinearActivationQuantizedTensor in `quant_kwargs` (beside the
`input_quant_func` that uses them).
"""

from __future__ import annotations

import torch

_ACTIVATION_SETTINGS = ("act_quant_kwargs", "quant_kwargs")


def _per_tensor(settings) -> bool:
    """Whether activation settings (an object or a dict) ask for one scale per tensor."""
    values = settings.values() if isinstance(settings, dict) else vars(settings).values() \
        if hasattr(settings, "__dict__") else ()
    for value in values:
        for granularity in (value if isinstance(value, (list, tuple)) else (value,)):
            cls = type(granularity)
            if cls.__name__ == "PerTensor" and cls.__module__.startswith("torchao"):
                return True
    return False


def per_tensor_activation_weights(model: torch.nn.Module) -> list[str]:
    """The names of the weights whose forward quantizes its input with one scale per tensor."""
    found = []
    for name, weight in model.named_parameters():
        state = getattr(weight, "__dict__", {})
        if any(settings is not None and _per_tensor(settings)
               for settings in (state.get(attr) for attr in _ACTIVATION_SETTINGS)):
            found.append(name)
    return found


def check_rows_computed_apart(model: torch.nn.Module) -> None:
    """Raise ValueError when some weight quantizes its input per tensor (see the module docstring)."""
    found = per_tensor_activation_weights(model)
    if found:
        raise ValueError(
            f"{type(model).__name__} quantizes its activations with one scale per tensor ({len(found)} weights, e.g. "
            f"{found[0]}: torchao's PerTensor granularity, the default of Float8DynamicActivationFloat8WeightConfig): "
            "each request's tokens then depend on the other requests in its forward, in stock generate too, so no "
            "batching gives stock's tokens. Quantize with granularity=PerRow() (one scale per token) to run it on "
            "hf_async_cb, or use batching='off'.")
