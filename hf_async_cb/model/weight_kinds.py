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
    bumps no version counter. The sum of the tensor's bits read as 32-bit words, wrapping (mod 2**32,
    so the same whatever the reduction order), moves with any change of one word; a floating tensor
    also gives the float32 sum of its values, which moves when every sign flips (each word then moves
    by 2**31, and an even count of them cancels in the first). A tensor over no storage of its own (a
    wrapper subclass: its inner tensors hold the data) or of another kind (complex) gives None.
    About two reads of the data, one transfer per device (a float64 norm beside an int64 sum, the
    first form, took 72 ms for an 8B bf16 model on an H100; benchmarks/fingerprint_cost.py times it)."""
    groups: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
    for i, t in enumerate(tensors):
        data = _plain_view(t)
        if data is not None and data.device.type != "meta" and not data.dtype.is_complex:
            groups.setdefault(data.device, []).append((i, data))
    out: list = [None] * len(tensors)
    for device, members in groups.items():
        words = torch.stack([_word_sum(t) for _, t in members]).tolist()
        values = torch.stack([t.sum(dtype=torch.float32) if t.dtype in FLOATING else
                              torch.zeros((), dtype=torch.float32, device=device) for _, t in members]).tolist()
        for (i, _), word, value in zip(members, words, values):
            out[i] = (word, value)
    return tuple(out)


def _word_sum(t: torch.Tensor) -> torch.Tensor:
    """The wrapping int32 sum of t's bits as 32-bit words (as narrower words where its size is not a
    multiple of 4 bytes: a tensor of an odd number of 16-bit values)."""
    if not t.numel():
        return torch.zeros((), dtype=torch.int32, device=t.device)
    flat = t.reshape(-1) if t.is_contiguous() else t.contiguous().reshape(-1)
    size = t.element_size()
    if size < 4 and (flat.numel() * size) % 4 == 0:
        words = flat.view(torch.int32)
    else:
        words = flat.view(_BITS[size])
    if words.dtype == torch.int64:  # (8-byte values: the low and high words)
        words = words.view(torch.int32)
    return words.sum(dtype=torch.int32)


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
