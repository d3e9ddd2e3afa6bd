"""A vision tower's gated MLP with its inner width padded to what cuBLAS's fast kernels need.

Qwen2.5-VL's vision tower (3B and 7B) has an MLP of inner width 3,420, which is not a multiple of 8:
the gate/up outputs and the down projection's input have rows of 6,840 bytes, so cuBLAS can only
use its 4-byte-aligned kernels for all three GEMMs. On an H100 one layer's MLP over 64 images
(147,456 patches) takes 10.5 ms at width 3,420 against 3.5 ms at 3,424; the tower's MLPs are 0.50 s
of a 1.29 s tower. `aligned_mlps` runs such MLPs, for a block, with the gate and up weights padded by
zero rows into one GEMM and the down weight by zero columns: the padded channels are act(0) * 0 = 0
and add nothing, so the output is the module's own up to the GEMMs' summation order.

A module is taken only where its forward is proven to be `down(act(gate(x)) * up(x))` (its source,
statement by statement), its three projections are plain nn.Linear layers, nothing hooks it, and
the inner width is misaligned. The padded weights are made per call (about 1/100 of the GEMMs'
time); nothing is kept between calls. Where Triton runs, act(gate) * up is one kernel over the
padded gate|up output (kernels/elementwise.silu_mul, as the language model's MLPs run it), checked
once per activation kind against the torch form.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import inspect
import textwrap
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from hf_async_cb.kernels.elementwise import silu_mul
from hf_async_cb.kernels.paged_attention import runs_on
from hf_async_cb.model.elementwise_fusion import _activation, _agrees
from hf_async_cb.model.fusion import has_hooks
from hf_async_cb.model.weight_kinds import is_plain_floating

_ALIGN_BYTES = 16
_KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_KERNEL_AGREES: dict[tuple, bool] = {}  # (activation class, kind, dtype, device) -> silu_mul agrees


def gated_form(cls: type) -> bool:
    """Whether cls.forward is exactly `return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))`
    for its one argument x (a docstring aside). Read once per forward function: a class whose forward
    is patched later is read afresh."""
    return _gated_form(getattr(cls, "forward", None))


@functools.lru_cache(maxsize=None)
def _gated_form(forward) -> bool:
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(forward)))
    except (OSError, TypeError, SyntaxError):
        return False
    fn = tree.body[0] if tree.body else None
    if not isinstance(fn, ast.FunctionDef) or fn.decorator_list:
        return False
    a = fn.args
    if len(a.args) != 2 or a.vararg or a.kwarg or a.kwonlyargs or a.posonlyargs or a.defaults:
        return False
    body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    if len(body) != 1 or not isinstance(body[0], ast.Return) or body[0].value is None:
        return False
    s, x = a.args[0].arg, a.args[1].arg
    expected = ast.parse(f"{s}.down_proj({s}.act_fn({s}.gate_proj({x})) * {s}.up_proj({x}))", mode="eval").body
    return ast.dump(body[0].value) == ast.dump(expected)


def _padded(width: int, dtype: torch.dtype) -> int:
    """`width` rounded up to whole 16-byte rows of `dtype`."""
    step = _ALIGN_BYTES // dtype.itemsize
    return width + -width % step


def _takes(m: nn.Module, on_cpu: bool) -> bool:
    parts = [getattr(m, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
    if not all(type(p) is nn.Linear for p in parts) or not gated_form(type(m)):
        return False
    gate, up, down = parts
    act = getattr(m, "act_fn", None)
    if not callable(act) or any(has_hooks(x) or "forward" in vars(x) for x in (m, *parts)):
        return False
    if isinstance(act, nn.Module) and (has_hooks(act) or "forward" in vars(act)):
        return False
    tensors = [t for p in parts for t in (p.weight, p.bias) if t is not None]
    if not all(is_plain_floating(t) and t.dtype == gate.weight.dtype and t.device == gate.weight.device
               for t in tensors):
        return False
    if (gate.bias is None) != (up.bias is None) or not (gate.out_features == up.out_features == down.in_features):
        return False
    if gate.weight.device.type != "cuda" and not on_cpu:
        return False
    return _padded(gate.out_features, gate.weight.dtype) != gate.out_features


def _aligned_forward(m: nn.Module, fused_activation: str | None):
    """The padded forward; `fused_activation` ("silu", "gelu_tanh"): act(gate) * up in one kernel
    (kernels/elementwise.silu_mul, rounding as torch does), else in torch."""
    gate, up, down, act = m.gate_proj, m.up_proj, m.down_proj, m.act_fn
    pad = _padded(gate.out_features, gate.weight.dtype) - gate.out_features
    own = type(m).forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        if x.dtype != gate.weight.dtype or torch.is_grad_enabled():
            return own(m, x)
        gate_up = torch.cat([F.pad(gate.weight, (0, 0, 0, pad)), F.pad(up.weight, (0, 0, 0, pad))])
        bias = None if gate.bias is None else torch.cat([F.pad(gate.bias, (0, pad)), F.pad(up.bias, (0, pad))])
        projected = F.linear(x, gate_up, bias)
        if fused_activation is not None and projected.numel():
            hidden = silu_mul(projected, gelu_tanh=fused_activation == "gelu_tanh")
        else:
            g, u = projected.chunk(2, dim=-1)
            hidden = act(g) * u
        return F.linear(hidden, F.pad(down.weight, (0, pad)), down.bias)

    return forward


def _fused_activation(m: nn.Module) -> str | None:
    """The activation silu_mul computes for m (checked once per kind against the torch form), or None."""
    w = m.gate_proj.weight
    kind = _activation(m.act_fn) if runs_on(w.device) and w.dtype in _KERNEL_DTYPES else None
    if kind is None:
        return None
    key = (type(m.act_fn), type(m.act_fn).forward, kind, w.dtype, w.device)
    if key not in _KERNEL_AGREES:
        g = torch.Generator().manual_seed(0)
        y = (torch.randn(4, 2 * 24, generator=g) * 3).to(w.device, w.dtype)
        gate_, up_ = y.chunk(2, dim=-1)
        try:
            _KERNEL_AGREES[key] = _agrees(lambda t: silu_mul(t, gelu_tanh=kind == "gelu_tanh"),
                                          lambda t: m.act_fn(gate_) * up_, y)
        except Exception:  # noqa: BLE001 - the torch form then
            _KERNEL_AGREES[key] = False
    return kind if _KERNEL_AGREES[key] else None


def _zero_stays_zero(act, dtype: torch.dtype) -> bool:
    """act(0) * 0 == 0: the padded channels add nothing (a NaN or inf at 0 would poison the sum).
    Asked on the CPU, so that no device work is waited for."""
    zero = torch.zeros(1, dtype=dtype)
    try:
        return bool((act(zero) * zero == 0).all())
    except Exception:
        return False


@contextlib.contextmanager
def aligned_mlps(model: nn.Module, on_cpu: bool = False) -> Iterator[int]:
    """Inside the block, each gated MLP of `model` with a misaligned inner width runs padded (on CUDA;
    `on_cpu` takes CPU modules too, for tests); yields how many."""
    taken = [m for m in model.modules() if _takes(m, on_cpu)
             and _zero_stays_zero(m.act_fn, m.gate_proj.weight.dtype)]
    for m in taken:
        m.forward = _aligned_forward(m, _fused_activation(m))
    try:
        yield len(taken)
    finally:
        for m in taken:
            vars(m).pop("forward", None)


def mlp_variants(model: nn.Module, language_model: nn.Module | None = None) -> list:
    """The silu_mul variants the padded MLPs outside `language_model` launch (compiled ahead with the
    model's others, on CUDA)."""
    from hf_async_cb.kernels.elementwise import silu_mul_variants

    from hf_async_cb.model.tower_norms import modules_outside

    kinds = set()
    for m in modules_outside(model, language_model):
        if _takes(m, on_cpu=False):
            kind = _activation(m.act_fn)
            if kind is not None:
                dtype = m.gate_proj.weight.dtype
                kinds.add((_padded(m.gate_proj.out_features, dtype), dtype, kind == "gelu_tanh"))
    return [v for width, dtype, gelu in sorted(kinds, key=str) for v in silu_mul_variants(width, dtype, gelu)]
