"""The vision towers' rotary embedding in one Triton kernel, for the towers' run in a call.

Qwen2-VL, Qwen2.5-VL, Qwen3-VL, GLM-4V and their kin apply `apply_rotary_pos_emb_vision` to every
patch in every layer: q and k cast to fp32, multiplied, rotated (a slice, a negation and a cat),
multiplied again, added and cast back, about ten passes over fp32 copies of q and k. For 64 images
of Qwen2.5-VL-7B's tower (147,456 patches, 16 heads of 80) that is ~0.25 s of a 1.3 s tower on an
H100. kernels/elementwise.vision_rotary does it in one pass with the same fp32 arithmetic (no FMA
contraction) and one rounding at the end: the same bits.

`fused_vision_rotary` replaces the function in the modeling module of each of the model's classes
that defines it, for a block (reference counted: the serving loop and a generate call may overlap);
each module's function is first checked bit for bit against the kernel on random inputs of each
kind (dtype, device, head size) it meets, and inputs the kernel does not take run the original.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from typing import Iterator

import torch
from torch import nn

from hf_async_cb.kernels.elementwise import vision_rotary
from hf_async_cb.kernels.paged_attention import runs_on

NAME = "apply_rotary_pos_emb_vision"
_FLOATING = (torch.float32, torch.bfloat16, torch.float16)
_lock = threading.Lock()
_PATCHED: dict[str, list] = {}  # modeling module -> [original, fused, blocks using it]
_AGREES: dict[tuple, bool] = {}  # (modeling module, its function, q dtype, cos dtype, device, head size) -> bit for bit


def _takes(q, k, cos, sin) -> bool:
    if not all(isinstance(t, torch.Tensor) for t in (q, k, cos, sin)):
        return False
    if q.dim() != 3 or k.dim() != 3 or cos.dim() != 2 or sin.shape != cos.shape or cos.dtype != sin.dtype:
        return False
    seq, _, dim = q.shape
    if k.shape[0] != seq or k.shape[2] != dim or tuple(cos.shape) != (seq, dim) or dim % 2 or seq == 0:
        return False
    if q.dtype != k.dtype or q.dtype not in _FLOATING or cos.dtype not in _FLOATING:
        return False
    if len({q.device, k.device, cos.device, sin.device}) != 1 or q.stride(-1) != 1 or k.stride(-1) != 1:
        return False
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, cos, sin))) and runs_on(q.device)


def _agrees(name: str, original, q, cos) -> bool:
    key = (name, original, q.dtype, cos.dtype, q.device, q.shape[-1])
    if key not in _AGREES:
        g = torch.Generator().manual_seed(0)
        dim = q.shape[-1]
        qkv = torch.randn(5, 3, 2, dim, generator=g).to(q.device, q.dtype)  # strided views, as the towers' are
        c, s = (torch.randn(5, dim, generator=g).to(q.device, cos.dtype) for _ in range(2))
        try:
            with torch.no_grad():
                got = vision_rotary(qkv[:, 0], qkv[:, 1], c, s)
                expected = original(qkv[:, 0], qkv[:, 1], c, s)
            _AGREES[key] = all(a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
                               for a, b in zip(got, expected, strict=True))
        except Exception:
            _AGREES[key] = False
    return _AGREES[key]


def _fused(name: str, original):
    def apply_rotary_pos_emb_vision(q, k, cos, sin, *args, **kwargs):
        if not (args or kwargs) and _takes(q, k, cos, sin) and _agrees(name, original, q, cos):
            return vision_rotary(q, k, cos, sin)
        return original(q, k, cos, sin, *args, **kwargs)

    apply_rotary_pos_emb_vision.__wrapped__ = original
    return apply_rotary_pos_emb_vision


def modules_with_vision_rotary(model: nn.Module) -> list[str]:
    """The transformers modeling modules of `model`'s classes that define apply_rotary_pos_emb_vision."""
    names = {type(m).__module__ for m in model.modules()}
    return sorted(n for n in names if n.startswith("transformers.models.") and n in sys.modules
                  and callable(getattr(sys.modules[n], NAME, None)))


@contextlib.contextmanager
def fused_vision_rotary(model: nn.Module) -> Iterator[int]:
    """Inside the block, the model's towers apply their rotary embedding with the kernel; yields how
    many modeling modules were patched."""
    names = modules_with_vision_rotary(model)
    with _lock:
        for name in names:
            if name in _PATCHED:
                _PATCHED[name][2] += 1
            else:
                module = sys.modules[name]
                original = getattr(module, NAME)
                _PATCHED[name] = [original, _fused(name, original), 1]
                setattr(module, NAME, _PATCHED[name][1])
    try:
        yield len(names)
    finally:
        with _lock:
            for name in names:
                entry = _PATCHED[name]
                entry[2] -= 1
                if entry[2] == 0:
                    del _PATCHED[name]
                    if getattr(sys.modules[name], NAME) is entry[1]:  # leave anyone else's later wrapper alone
                        setattr(sys.modules[name], NAME, entry[0])


def tower_variants(model: nn.Module) -> list:
    """The kernel variants the model's towers launch (compiled ahead with the model's others, on CUDA)."""
    from hf_async_cb.kernels.elementwise import vision_rotary_variants

    found, names = [], set(modules_with_vision_rotary(model))
    for m in model.modules():
        heads, dim, qkv = getattr(m, "num_heads", None), getattr(m, "head_dim", None), getattr(m, "qkv", None)
        if (type(m).__module__ in names and type(m).__name__.endswith("VisionAttention") and isinstance(heads, int)
                and isinstance(dim, int) and isinstance(getattr(qkv, "weight", None), torch.Tensor)
                and qkv.weight.device.type == "cuda" and qkv.weight.dtype in _FLOATING):
            found += vision_rotary_variants(heads, dim, qkv.weight.dtype, torch.float32)
    return found
