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


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@torch.no_grad()
def content_sums(tensors) -> tuple:
    """Per tensor, numbers that change when its values do, whatever wrote them: a write through
    `.data`, a collective (`broadcast`, `all_reduce`: RL trainers' weight sync) or a NumPy view
    bumps no version counter. A floating tensor gives its L2 norm in float64 (one bf16 step in one
    of 16M values moves it by ~1e-9 of itself, far above float64's rounding) and the int64 sum of
    its values' bits (which a sign flip moves, and the norm does not); an integer one its int64 sum;
    a tensor over no storage of its own (a wrapper subclass: its inner tensors hold the data) or of
    another kind (complex) None. Two passes over the data (about 10 ms for an 8B model on an H200,
    predicted), one transfer per device and dtype."""
    groups: dict[tuple, list[tuple[int, torch.Tensor]]] = {}
    for i, t in enumerate(tensors):
        data = _plain_view(t)
        if data is not None and data.device.type != "meta" and not data.dtype.is_complex:
            groups.setdefault((data.device, data.dtype), []).append((i, data))
    out: list = [None] * len(tensors)
    for (_, dtype), members in groups.items():
        data = [t for _, t in members]
        bits = torch.stack([t.view(_BITS[t.element_size()]).sum(dtype=torch.int64) if t.numel() else
                            torch.zeros((), dtype=torch.int64, device=t.device) for t in data]).tolist()
        if dtype.is_floating_point:
            norms = torch.stack([n.reshape(()) for n in torch._foreach_norm(data, 2, dtype=torch.float64)]).tolist()
            values = list(zip(norms, bits))
        else:
            values = bits
        for (i, _), value in zip(members, values):
            out[i] = value
    return tuple(out)


def _plain_view(t: torch.Tensor) -> torch.Tensor | None:
    """`t`'s data as a plain tensor (a Parameter subclass over real storage, as bitsandbytes' are,
    seen through), or None for a wrapper subclass (torchao's, quanto's), whose inner tensors hold
    the data."""
    if is_plain(t):
        return t.detach()
    if not isinstance(t, nn.Parameter):  # (a wrapper subclass: torchao's, whose ops it dispatches itself)
        return None
    try:
        plain = t.detach().as_subclass(torch.Tensor)
        if type(plain) is not torch.Tensor:
            return None
        plain.untyped_storage().data_ptr()
        return plain
    except Exception:  # noqa: BLE001 - no storage of its own: its inner tensors are not looked at
        return None
