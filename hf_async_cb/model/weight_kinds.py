"""What kind of tensor a weight is: a plain one, or a quantized form the engine must not look into.

Quantization libraries hold weights in two ways. Some replace the module (bitsandbytes'
Linear8bitLt / Linear4bit, quanto's QLinear, HQQLinear, transformers' FP8 linears); others keep a
plain nn.Linear and give it a tensor subclass as its weight (torchao's Int8Tensor, Float8Tensor,
...: a wrapper whose real data are inner tensors, with no storage of its own, so `data_ptr()` on
it raises). Code that concatenates, views or reads the storage of weights (fusion, the skinny
GEMM kernels, the preparation's signature) may do so only for plain tensors of a floating dtype;
everything else runs through its own module's forward, as in stock.
"""

from __future__ import annotations

import torch
from torch import nn

FLOATING = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def is_plain(t: torch.Tensor | None) -> bool:
    """Whether `t` is an ordinary tensor or parameter (no subclass: torchao, bitsandbytes' Int8Params /
    Params4bit, quanto's tensors and any other wrapper are not)."""
    return type(t) in (torch.Tensor, nn.Parameter)


def is_plain_floating(t: torch.Tensor | None) -> bool:
    """A plain tensor of a floating dtype a GEMM takes as it is (float8 and integer data are not)."""
    return is_plain(t) and t.dtype in FLOATING


def versions(tensors) -> list[int] | None:
    """The version counters of `tensors` (an in-place write bumps one: an optimizer step, a copy_ into
    a weight); None when one is an inference tensor, which keeps none."""
    try:
        return [t._version for t in tensors]
    except RuntimeError:  # "Inference tensors do not track version counter"
        return None


def storage_key(t: torch.Tensor) -> tuple:
    """Where `t`'s data live, without touching a storage a wrapper subclass does not have: a plain
    tensor's data pointer, else its inner tensors' (`__tensor_flatten__`), else nothing beyond the
    object itself (which the caller identifies by id)."""
    if is_plain(t):
        return (t.data_ptr(),)
    flatten = getattr(t, "__tensor_flatten__", None)
    if callable(flatten):
        try:
            names, _ = flatten()
            return tuple(storage_key(inner) for inner in (getattr(t, name, None) for name in names)
                         if isinstance(inner, torch.Tensor))
        except Exception:  # noqa: BLE001 - a subclass whose flatten needs more than itself: its identity is enough
            return ()
    try:
        return (t.data_ptr(),)  # a Parameter subclass over real storage (bitsandbytes)
    except RuntimeError:
        return ()
