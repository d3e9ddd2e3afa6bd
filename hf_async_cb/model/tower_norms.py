"""A vision tower's RMSNorms on the rms_norm Triton kernel, for the towers' run in a call.

Qwen2.5-VL's tower norms every patch twice per layer in torch's code: a cast to fp32, pow, mean,
rsqrt, two multiplies and a cast back, each a pass over [patches, hidden] in fp32: ~110 ms of a
0.66 s tower for 64 images on an H100 (docs/benchmarks.md). The language model's norms already run
on kernels/elementwise.rms_norm (model/elementwise_fusion.py, while the engine runs); `fused_tower_norms`
does the same for the other modules' RMSNorms (the towers' and projectors'), for a block.

A norm is taken where elementwise_fusion takes one (its RMSNorm forms, nothing patched on its
instance) and its kind (class, dtype, device) agrees with its own forward on random inputs (bit for
bit, or an ulp where the mean's reduction order differs), checked once per process.
"""

from __future__ import annotations

import contextlib
import types
from typing import Iterator

from torch import nn

from hf_async_cb.model import elementwise_fusion as ew
from hf_async_cb.model.fusion import has_hooks

_AGREES: dict[tuple, bool] = {}  # (class, forward, dtype, device) -> the kernel agrees with the norm


def modules_outside(model: nn.Module, inner: nn.Module | None):
    """`model`'s modules that are not `inner`'s (a vision-language model's towers and projector)."""
    inside = {id(m) for m in inner.modules()} if inner is not None else set()
    return (m for m in model.modules() if id(m) not in inside)


def _norms(model: nn.Module, skip: nn.Module | None) -> list[tuple[nn.Module, types.FunctionType]]:
    found = []
    for m in modules_outside(model, skip):
        patch = None if has_hooks(m) else ew.checked_patch(m, _AGREES)
        if patch is not None and patch[1] == "rms_norms":
            found.append((m, patch[0]))
    return found


@contextlib.contextmanager
def fused_tower_norms(model: nn.Module, language_model: nn.Module | None = None) -> Iterator[int]:
    """Inside the block, `model`'s RMSNorms outside `language_model` run on the kernel; yields how many."""
    taken = _norms(model, language_model)
    for m, forward in taken:
        m.forward = types.MethodType(forward, m)
    try:
        yield len(taken)
    finally:
        for m, _ in taken:
            vars(m).pop("forward", None)


def tower_norm_variants(model: nn.Module, language_model: nn.Module | None = None) -> list:
    """The rms_norm variants the towers' norms launch (compiled ahead with the model's others, on CUDA)."""
    from hf_async_cb.kernels.elementwise import rms_variants

    kinds = set()
    for m in modules_outside(model, language_model):
        patch = ew._patchable(m)
        if patch is not None and patch[2] == "rms_norms" and patch[1].device.type == "cuda":
            x_dtype = patch[1].dtype  # (the towers run in the model's dtype)
            kinds.add((patch[1].shape[-1], x_dtype, patch[1].dtype, patch[0] is ew._unit_offset_rms_forward))
    return [v for width, x_dtype, w_dtype, unit in sorted(kinds, key=str)
            for v in rms_variants(width, x_dtype, w_dtype, unit)]
