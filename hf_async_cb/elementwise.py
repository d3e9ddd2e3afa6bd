"""Fuse a model's small element-wise ops (RMSNorm, rotary embeddings, SiLU-mul) into Triton kernels.

A bf16 decode step of a Llama-shaped model spends about a third of its kernel time in some thirty
tiny element-wise kernels per layer: RMSNorm (~7 kernels, twice), apply_rotary_pos_emb (~10) and
the MLP's act_fn(gate) * up (2). fuse_elementwise() replaces each group with one Triton kernel that
computes in fp32 and rounds every intermediate that torch rounds to the model dtype, so results
match the unfused model bit for bit, or rarely by an ulp or two where a reduction order (RMSNorm's
mean) or a transcendental's implementation (exp) differs. Each patch is checked once on random inputs against the
original before it is applied, and falls back to the original code where a kernel cannot run
(CPU without Triton's interpreter, autograd, unexpected shapes or dtypes).

RMSNorm and MLP forwards are replaced on the instances; apply_rotary_pos_emb is replaced in its
modeling module, which every model of that family shares, so those patches are reference counted.
The SiLU-mul needs the gate/up GEMM fused by fusion.fuse_projections() first. Undo in reverse
order: restore the elementwise fusion, then the projections.
"""

from __future__ import annotations

import sys
import types

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import nn
from triton.language.extra import libdevice

from .attention.triton_paged import runs_on
from .fusion import FusedPart

ROTARY_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3")  # phi3: full rotary only (else fallback)
_LAUNCH = dict(enable_fp_fusion=False)  # no FMA contraction: torch rounds each product


# Every value torch rounds to a 16-bit dtype is rounded the same way here, inline (helper calls are
# slow in Triton's interpreter): fp16 by a cast, bf16 by hand, since the interpreter's fp32->bf16 cast
# truncates. The bf16 rounding is round-to-nearest-even on the bits (what cvt.rn.bf16.f32 does),
# keeping NaNs; after it, the cast to bf16 is exact.


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, n_rows, n_cols, inner, stride_outer, stride_inner, inv_n, eps,
                     ROWS: tl.constexpr, BLOCK: tl.constexpr, X_BF16: tl.constexpr, Y_BF16: tl.constexpr,
                     LIBDEVICE: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    src = (rows // inner).to(tl.int64) * stride_outer + (rows % inner).to(tl.int64) * stride_inner
    x = tl.load(x_ptr + src[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    var = tl.sum(x * x, axis=1) * inv_n + eps
    if LIBDEVICE:
        h = x * libdevice.rsqrt(var)[:, None]
    else:
        h = x * tl.math.rsqrt(var)[:, None]
    if X_BF16:  # h.to(input dtype)
        bits = h.to(tl.uint32, bitcast=True)
        h = tl.where(h != h, h, ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True))
    h = h.to(x_ptr.dtype.element_ty).to(tl.float32)
    y = tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)[None, :] * h
    if Y_BF16:  # weight * h
        bits = y.to(tl.uint32, bitcast=True)
        y = tl.where(y != y, y, ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True))
    tl.store(y_ptr + rows.to(tl.int64)[:, None] * n_cols + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr, seq_len, n_q, n_heads, half,
                   sqb, sqh, sqt, skb, skh, skt, scb, sct, sob, soh, sot, skob, skoh, skot,
                   HEADS: tl.constexpr, DIM: tl.constexpr, BF16: tl.constexpr):
    """One program per (token, block of HEADS heads), q's heads first, then k's, one head per row."""
    pid = tl.program_id(0)
    b = (pid // seq_len).to(tl.int64)
    t = (pid % seq_len).to(tl.int64)
    dt = qo_ptr.dtype.element_ty
    d = tl.arange(0, DIM)
    d_mask = d < 2 * half
    first = d < half
    d_rot = tl.where(first, d + half, d - half)  # rotate_half(x) = cat(-x2, x1): x[d_rot] * sign
    sign = tl.where(first, -1.0, 1.0)[None, :]
    cs = b * scb + t * sct
    c = tl.load(cos_ptr + cs + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + cs + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    h = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
    is_q = (h < n_q)[:, None]
    mask = (h < n_heads)[:, None] & d_mask[None, :]
    row_q = q_ptr + b * sqb + t * sqt + h[:, None] * sqh
    row_k = k_ptr + b * skb + t * skt + (h[:, None] - n_q) * skh
    row = tl.where(is_q, row_q, row_k)
    x = tl.load(row + d[None, :], mask=mask, other=0.0).to(tl.float32)
    xr = tl.load(row + d_rot[None, :], mask=mask, other=0.0).to(tl.float32)
    p = x * c  # q * cos
    r = xr * s  # rotate_half(q) * sin, up to the sign (exact)
    if BF16:
        bits = p.to(tl.uint32, bitcast=True)
        p = tl.where(p != p, p, ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True))
        bits = r.to(tl.uint32, bitcast=True)
        r = tl.where(r != r, r, ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True))
    o = p.to(dt).to(tl.float32) + sign * r.to(dt).to(tl.float32)
    if BF16:
        bits = o.to(tl.uint32, bitcast=True)
        o = tl.where(o != o, o, ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True))
    dst_q = qo_ptr + b * sob + t * sot + h[:, None] * soh
    dst_k = ko_ptr + b * skob + t * skot + (h[:, None] - n_q) * skoh
    tl.store(tl.where(is_q, dst_q, dst_k) + d[None, :], o.to(dt), mask=mask)


@triton.jit
def _silu_mul_kernel(y_ptr, o_ptr, n_rows, n_cols, stride_y,
                     ROWS: tl.constexpr, BLOCK: tl.constexpr, BF16: tl.constexpr, LIBDEVICE: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    src = y_ptr + rows.to(tl.int64)[:, None] * stride_y + cols[None, :]
    gate = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(src + n_cols, mask=mask, other=0.0).to(tl.float32)
    if LIBDEVICE:  # torch's CUDA silu: x / (1 + expf(-x)) with IEEE division
        a = tl.math.div_rn(gate, 1.0 + libdevice.exp(-gate))
    else:
        a = tl.math.div_rn(gate, 1.0 + tl.exp(-gate))
    dt = o_ptr.dtype.element_ty
    if BF16:
        bits = a.to(tl.uint32, bitcast=True)
        a = tl.where(a != a, a, ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True))
    o = a.to(dt).to(tl.float32) * up
    if BF16:
        bits = o.to(tl.uint32, bitcast=True)
        o = tl.where(o != o, o, ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True))
    tl.store(o_ptr + rows.to(tl.int64)[:, None] * n_cols + cols[None, :], o.to(dt), mask=mask)


def _row_layout(x: torch.Tensor):
    """(rows, inner, stride_outer, stride_inner): row r of x starts at (r // inner) * stride_outer +
    (r % inner) * stride_inner; None if x's leading dims need more than two strides."""
    dims = []
    for size, stride in zip(x.shape[:-1], x.stride()[:-1]):
        if size == 1:
            continue
        if dims and dims[-1][1] == size * stride:  # collapses into the previous dim
            dims[-1] = (dims[-1][0] * size, stride)
        else:
            dims.append((size, stride))
    if len(dims) > 2:
        return None
    if len(dims) == 2:
        (n0, s0), (n1, s1) = dims
        return n0 * n1, n1, s0, s1
    n, stride = dims[0] if dims else (1, 0)
    return n, 1, stride, 0


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * (x.float() * rsqrt(mean(x.float()**2) + eps)).to(x.dtype)` in one kernel."""
    if x.stride(-1) != 1 or _row_layout(x) is None:
        x = x.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    rows, inner, stride_outer, stride_inner = _row_layout(x)
    n = x.shape[-1]
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    block = triton.next_power_of_2(n)
    per = max(1, min(triton.next_power_of_2(rows), 4096 // block))
    _rms_norm_kernel[(triton.cdiv(rows, per),)](
        x, weight, out, rows, n, inner, stride_outer, stride_inner, 1.0 / n, eps,
        ROWS=per, BLOCK=block, X_BF16=x.dtype == torch.bfloat16, Y_BF16=out.dtype == torch.bfloat16,
        LIBDEVICE=not triton.knobs.runtime.interpret, num_warps=min(16, max(1, per * block // 512)), **_LAUNCH)
    return out


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """transformers' apply_rotary_pos_emb(q, k, cos, sin) for q [B, H, T, D], k [B, KVH, T, D], cos/sin
    [B or 1, T, D]; returns [B, T, heads, D] buffers transposed to [B, heads, T, D], like the usual inputs."""
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    (batch, n_q, seq, dim), n_k = q.shape, k.shape[1]
    cos, sin = cos.expand(batch, seq, dim), sin.expand(batch, seq, dim)
    if cos.stride() != sin.stride() or cos.stride(-1) != 1:
        cos, sin = cos.contiguous(), sin.contiguous()
    qo = torch.empty(batch, seq, n_q, dim, dtype=q.dtype, device=q.device).transpose(1, 2)
    ko = torch.empty(batch, seq, n_k, dim, dtype=k.dtype, device=k.device).transpose(1, 2)
    block_d = triton.next_power_of_2(dim)
    heads = min(triton.next_power_of_2(n_q + n_k), max(1, 2048 // block_d))
    _rotary_kernel[(batch * seq, triton.cdiv(n_q + n_k, heads))](
        q, k, cos, sin, qo, ko, seq, n_q, n_q + n_k, dim // 2,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), cos.stride(0), cos.stride(1),
        qo.stride(0), qo.stride(1), qo.stride(2), ko.stride(0), ko.stride(1), ko.stride(2),
        HEADS=heads, DIM=block_d, BF16=q.dtype == torch.bfloat16, num_warps=4, **_LAUNCH)
    return qo, ko


def silu_mul(y: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` for y = [..., gate | up] (last dim 2I), rounded like torch; returns [..., I]."""
    n = y.shape[-1] // 2
    y2 = y.reshape(-1, 2 * n)
    y2 = y2 if y2.stride(-1) == 1 else y2.contiguous()
    rows = y2.shape[0]
    out = torch.empty(*y.shape[:-1], n, dtype=y.dtype, device=y.device)
    block = min(triton.next_power_of_2(n), 1024)
    per = max(1, min(triton.next_power_of_2(rows), 1024 // block))
    _silu_mul_kernel[(triton.cdiv(rows, per), triton.cdiv(n, block))](
        y2, out, rows, n, y2.stride(0), ROWS=per, BLOCK=block, BF16=y.dtype == torch.bfloat16,
        LIBDEVICE=not triton.knobs.runtime.interpret, num_warps=4, **_LAUNCH)
    return out


def _usable(x, *params) -> bool:
    """Whether the kernels can take input x (else the patched code falls back to the original)."""
    return (isinstance(x, torch.Tensor) and x.is_floating_point() and x.dim() > 0 and x.numel() > 0
            and runs_on(x.device) and not (torch.is_grad_enabled() and any(t.requires_grad for t in (x, *params))))


def _rms_forward(self, x, *args, **kwargs):
    w = self.weight
    if args or kwargs or not _usable(x, w) or x.shape[-1] != w.shape[0] or x.device != w.device:
        return type(self).forward(self, x, *args, **kwargs)
    return rms_norm(x, w, self.variance_epsilon)


def _mlp_forward(self, x, *args, **kwargs):
    group = getattr(self.gate_proj, "group", None)  # None once the projections are restored
    if group is None or args or kwargs or not _usable(x, self.gate_proj.weight):
        return type(self).forward(self, x, *args, **kwargs)
    return self.down_proj(silu_mul(F.linear(x, group.weight, group.bias)))


def _gate_up_forward(self, x, *args, **kwargs):  # Phi3-style MLP: one gate_up_proj Linear
    if args or kwargs or not _usable(x, self.gate_up_proj.weight):
        return type(self).forward(self, x, *args, **kwargs)
    return self.down_proj(silu_mul(self.gate_up_proj(x)))


def _fused_rotary(original):
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1, *args, **kwargs):
        if (type(unsqueeze_dim) is int and unsqueeze_dim == 1 and not (args or kwargs)
                and all(isinstance(t, torch.Tensor) for t in (k, cos, sin)) and _usable(q, k, cos, sin)
                and q.dim() == k.dim() == 4
                and cos.dim() == 3 and sin.shape == cos.shape and q.shape[-1] % 2 == 0
                and k.shape[0] == q.shape[0] and k.shape[2:] == q.shape[2:] and k.numel() > 0
                and cos.shape[0] in (1, q.shape[0]) and cos.shape[1:] == q.shape[2:]  # (phi3's partial rotary: no)
                and len({q.dtype, k.dtype, cos.dtype, sin.dtype}) == 1
                and len({q.device, k.device, cos.device, sin.device}) == 1):
            return rotary(q, k, cos, sin)
        return original(q, k, cos, sin, unsqueeze_dim, *args, **kwargs)
    apply_rotary_pos_emb.__wrapped__ = original
    apply_rotary_pos_emb.__doc__ = "Triton-fused " + (original.__doc__ or "apply_rotary_pos_emb")
    return apply_rotary_pos_emb


def _agrees(fused, original, *inputs) -> bool:
    """fused(*inputs) == original(*inputs) up to rounding: within 1e-6 (fp32) or 2**-7 (16-bit dtypes)
    relative to each element, plus as much relative to the largest one (an MLP's down_proj sums
    products, so a near-zero output can carry its inputs' rounding differences)."""
    try:
        with torch.no_grad():
            got, expected = fused(*inputs), original(*inputs)
    except Exception:
        return False
    pairs = list(zip(got, expected)) if isinstance(got, tuple) else [(got, expected)]
    for a, b in pairs:
        tol = 2 ** -7 if b.dtype in (torch.float16, torch.bfloat16) else 1e-6
        if a.shape != b.shape or a.dtype != b.dtype or not torch.allclose(
                a.float(), b.float(), rtol=tol, atol=tol * b.float().abs().max().item()):
            return False
    return True


_ROTARY: dict[str, list] = {}  # modeling module -> [original function, fused function, handles using it]


def _patch_rotary(name: str, dtype: torch.dtype, device: torch.device) -> bool:
    if name in _ROTARY:
        _ROTARY[name][2] += 1
        return True
    module = sys.modules[name]
    original = getattr(module, "apply_rotary_pos_emb", None)
    if not callable(original) or not runs_on(device):
        return False
    fused, g = _fused_rotary(original), torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 3, h, 8, generator=g).to(device, dtype).transpose(1, 2) for h in (4, 2))
    cos, sin = (torch.randn(2, 3, 8, generator=g).to(device, dtype) for _ in range(2))
    if not _agrees(fused, original, q, k, cos, sin):
        return False
    module.apply_rotary_pos_emb = fused
    _ROTARY[name] = [original, fused, 1]
    return True


def _unpatch_rotary(name: str) -> None:
    entry = _ROTARY[name]
    entry[2] -= 1
    if entry[2] == 0:
        del _ROTARY[name]
        module = sys.modules[name]
        if module.apply_rotary_pos_emb is entry[1]:  # leave anyone else's later wrapper alone
            module.apply_rotary_pos_emb = entry[0]


def _is_silu(act) -> bool:
    from transformers.activations import SiLUActivation
    return isinstance(act, nn.SiLU) or type(act) is SiLUActivation


def _patchable(m: nn.Module):
    """(fused forward, the weight whose dtype/device/in-width it runs with, counter) for m, or None."""
    name, w = type(m).__name__, getattr(m, "weight", None)
    if "forward" in m.__dict__:  # already patched, by us or by someone else
        return None
    if (name.endswith("RMSNorm") and isinstance(w, torch.Tensor) and w.dim() == 1 and w.is_floating_point()
            and isinstance(getattr(m, "variance_epsilon", None), float)):
        return _rms_forward, w, "rms_norms"
    if not name.endswith("MLP") or not hasattr(m, "down_proj"):
        return None
    gate, up, gate_up = (getattr(m, a, None) for a in ("gate_proj", "up_proj", "gate_up_proj"))
    if (isinstance(gate, FusedPart) and isinstance(up, FusedPart) and gate.group is up.group
            and (gate.index, up.index) == (0, 1) and len(gate.group.sizes) == 2
            and gate.group.sizes[0] == gate.group.sizes[1] and _is_silu(getattr(m, "act_fn", None))):
        return _mlp_forward, gate.weight, "silu_muls"
    if type(gate_up) is nn.Linear and gate_up.out_features % 2 == 0 and _is_silu(getattr(m, "activation_fn", None)):
        return _gate_up_forward, gate_up.weight, "silu_muls"
    return None


class FusedElementwise:
    """The element-wise fusions applied to one model; restore() (or leaving a `with` block) undoes them."""

    def __init__(self):
        self._modules: list[nn.Module] = []
        self._rotary: list[str] = []
        self.rms_norms = self.rotary_modules = self.silu_muls = 0

    def summary(self) -> str:
        """One line for logging, e.g. "fused 5 RMSNorm, rotary in 1 module, 2 SiLU-mul"."""
        s = "" if self.rotary_modules == 1 else "s"
        return f"fused {self.rms_norms} RMSNorm, rotary in {self.rotary_modules} module{s}, {self.silu_muls} SiLU-mul"

    def restore(self) -> None:
        """Put the original forwards and rotary functions back (idempotent)."""
        ours = (_rms_forward, _mlp_forward, _gate_up_forward)
        for m in self._modules:
            if getattr(m.__dict__.get("forward"), "__func__", None) in ours:
                del m.forward
        for name in self._rotary:
            _unpatch_rotary(name)
        self._modules.clear()
        self._rotary.clear()

    def __enter__(self) -> "FusedElementwise":
        return self

    def __exit__(self, *exc) -> None:
        self.restore()


def fuse_elementwise(model: nn.Module) -> FusedElementwise:
    """Point `model`'s RMSNorms, SiLU MLPs (whose gate/up fuse_projections() has fused, or Phi3's
    gate_up_proj) and its families' apply_rotary_pos_emb at the Triton kernels, in place.

    Each kind (class, dtype, device) is first checked against the original on random inputs and
    left alone if it disagrees; nothing is patched on devices Triton cannot run on. Returns the
    handle that restores; restore it before the projections' handle.
    """
    fused, checked = FusedElementwise(), {}
    try:
        for m in model.modules():
            found = _patchable(m)
            if found is None or not runs_on(found[1].device):
                continue
            forward, w, counter = found
            key = (type(m), forward, w.dtype, w.device)
            if key not in checked:
                x = torch.randn(3, w.shape[-1], generator=torch.Generator().manual_seed(0)).to(w.device, w.dtype)
                checked[key] = _agrees(types.MethodType(forward, m), m.forward, x)
            if checked[key]:
                m.forward = types.MethodType(forward, m)
                fused._modules.append(m)
                setattr(fused, counter, getattr(fused, counter) + 1)
        params = [p for p in model.parameters() if p.is_floating_point()]
        names = {type(m).__module__ for m in model.modules()}
        for family in ROTARY_FAMILIES:
            name = f"transformers.models.{family}.modeling_{family}"
            if params and name in names and _patch_rotary(name, params[0].dtype, params[0].device):
                fused._rotary.append(name)
                fused.rotary_modules += 1
    except BaseException:
        fused.restore()
        raise
    return fused
