"""Fuse a model's small element-wise ops (RMSNorm, rotary embeddings, SiLU-mul or GELU-tanh-mul) into
Triton kernels.

A bf16 decode step of a Llama-shaped model spends about a third of its kernel time in some thirty
tiny element-wise kernels per layer: RMSNorm (~7 kernels, twice), apply_rotary_pos_emb (~10) and
the MLP's act_fn(gate) * up (2). fuse_elementwise() replaces each group with one Triton kernel that
computes in fp32 and rounds every intermediate that torch rounds to the model dtype, so results
match the unfused model bit for bit, or rarely by an ulp or two where a reduction order (RMSNorm's
mean) or a transcendental's implementation (exp) differs. Each patch is checked once on random inputs against the
original before it is applied, and falls back to the original code where a kernel cannot run
(CPU without Triton's interpreter, autograd, unexpected shapes or dtypes).

RMSNorm and MLP forwards are replaced on the instances, RMSNorms in Llama's form (weight times the
normed input rounded to its dtype) or Gemma's ((1 + weight) times it, in fp32, rounded once).
apply_rotary_pos_emb is replaced in its modeling module, which every model of that family shares,
so those patches are reference counted; any family whose function gives the kernel's results bit
for bit on random inputs qualifies (Llama's rotate-half form, copied by most families).
The SiLU-mul needs the gate/up GEMM fused by fusion.fuse_projections() first. Undo in reverse
order: restore the elementwise fusion, then the projections.

Decoder layers whose forward is proven to be the plain pre-norm pattern (Llama, Mistral, Qwen2,
Qwen3) also get their forward replaced on the instance (model/residual_fusion.py): each residual
add runs in one kernel with the RMSNorm that follows it (add_rms_norm), inside the layer and, through
a stash keyed by the layer's output tensor, across layers: two kernels fewer per layer.
"""

from __future__ import annotations

import functools
import sys
import types

import torch
import torch.nn.functional as F
from torch import nn

from hf_async_cb.kernels.elementwise import add_rms_norm, rms_norm, rotary, silu_mul  # noqa: F401 (add_rms_norm: residual_fusion)
from hf_async_cb.kernels.paged_attention import runs_on
from hf_async_cb.model.fusion import FusedPart, has_hooks



def _usable(x, *params) -> bool:
    """Whether the kernels can take input x (else the patched code falls back to the original)."""
    return (isinstance(x, torch.Tensor) and x.is_floating_point() and x.dim() > 0 and x.numel() > 0
            and runs_on(x.device) and not (torch.is_grad_enabled() and any(t.requires_grad for t in (x, *params))))


def _rms_forward(self, x, *args, **kwargs):
    w = self.weight
    if args or kwargs or not _usable(x, w) or x.shape[-1] != w.shape[0] or x.device != w.device:
        return type(self).forward(self, x, *args, **kwargs)
    return rms_norm(x, w, self.variance_epsilon)


def _unit_offset_rms_forward(self, x, *args, **kwargs):  # Gemma's: (x * rsqrt(...) * (1 + w)) in fp32
    w = self.weight
    if args or kwargs or not _usable(x, w) or x.shape[-1] != w.shape[0] or x.device != w.device:
        return type(self).forward(self, x, *args, **kwargs)
    return rms_norm(x, w, self.eps, unit_offset=True)


def _mlp_forward(self, x, *args, **kwargs):
    group = getattr(self.gate_proj, "group", None)  # None once the projections are restored
    if group is None or args or kwargs or not _usable(x, self.gate_proj.weight):
        return type(self).forward(self, x, *args, **kwargs)
    return self.down_proj(silu_mul(group.project(x), _activation(self.act_fn) == "gelu_tanh"))


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
_ROTARY_CHECKED: dict[tuple, bool] = {}  # (modeling module, its function, dtype, device) -> the fused one agrees


def rotary_candidates(model: nn.Module) -> list[str]:
    """The transformers modeling modules of `model`'s classes that define apply_rotary_pos_emb."""
    names = {type(m).__module__ for m in model.modules()}
    return sorted(n for n in names if n.startswith("transformers.models.") and n in sys.modules
                  and callable(getattr(sys.modules[n], "apply_rotary_pos_emb", None)))


def _rotary_agrees(name: str, dtype: torch.dtype, device: torch.device, heads: tuple[int, int, int] = (4, 2, 8)) -> bool:
    """Whether the fused rotary reproduces the module's own bit for bit on random inputs (checked
    once per kind): Llama's rotate-half form, which most families copy; an interleaved or otherwise
    different one (Cohere, GLM, ...) disagrees and keeps its own. `heads`: (query heads, key heads,
    head size) of the inputs, the model's where known (its steps' compiled variant then serves)."""
    original = getattr(sys.modules[name], "apply_rotary_pos_emb", None)
    original = _ROTARY[name][0] if name in _ROTARY and original is _ROTARY[name][1] else original  # (ours: what it wraps)
    # The function checked is part of the key: one patched in since (liger-kernel's) is checked afresh.
    key = (name, original, dtype, device)
    if key not in _ROTARY_CHECKED:
        if not callable(original) or not runs_on(device):
            return False
        fused, g = _fused_rotary(original), torch.Generator().manual_seed(0)
        q_heads, k_heads, dim = heads
        q, k = (torch.randn(2, 3, h, dim, generator=g).to(device, dtype).transpose(1, 2) for h in (q_heads, k_heads))
        cos, sin = (torch.randn(2, 3, dim, generator=g).to(device, dtype) for _ in range(2))
        try:
            with torch.no_grad():
                got, expected = fused(q, k, cos, sin), original(q, k, cos, sin)
            _ROTARY_CHECKED[key] = all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(got, expected, strict=True))
        except Exception:
            _ROTARY_CHECKED[key] = False
    return _ROTARY_CHECKED[key]


def _patch_rotary(name: str) -> None:
    if name in _ROTARY:
        _ROTARY[name][2] += 1
        return
    module = sys.modules[name]
    original = module.apply_rotary_pos_emb
    fused = _fused_rotary(original)
    module.apply_rotary_pos_emb = fused
    _ROTARY[name] = [original, fused, 1]


def _unpatch_rotary(name: str) -> None:
    entry = _ROTARY[name]
    entry[2] -= 1
    if entry[2] == 0:
        del _ROTARY[name]
        module = sys.modules[name]
        if module.apply_rotary_pos_emb is entry[1]:  # leave anyone else's later wrapper alone
            module.apply_rotary_pos_emb = entry[0]


def _heads(model: nn.Module) -> tuple[tuple[int, int, int], ...]:
    """((query heads, key heads, head size),) from the model's text config, or () if it does not say."""
    from hf_async_cb.model.checks import text_config_of

    if getattr(model, "config", None) is None:  # a lone module
        return ()
    c = text_config_of(model.config)
    q = getattr(c, "num_attention_heads", None)
    hidden = getattr(c, "hidden_size", None)
    if not isinstance(q, int) or not isinstance(hidden, int) or q <= 0:
        return ()
    k = getattr(c, "num_key_value_heads", None) or q
    dim = getattr(c, "head_dim", None) or hidden // q
    return ((q, k, dim),) if isinstance(k, int) and isinstance(dim, int) and dim % 2 == 0 else ()


def check_variants(model: nn.Module) -> list:
    """The compiled variants fuse_elementwise's checks (and the steps after them) launch for `model`:
    its RMSNorms (alone and after a residual add), its gated MLPs' activation and its rotary, as
    their kinds appear before any check. Listed so that they can compile in workers while the model
    is prepared, rather than one by one in the checks (seconds on a first call)."""
    from hf_async_cb.kernels import elementwise

    found = []
    params = [p for p in model.parameters() if p.is_floating_point()]
    if not params or not runs_on(params[0].device):
        return found
    dtype, libdevice = params[0].dtype, params[0].device.type == "cuda"  # (the interpreter has no libdevice)
    for m in model.modules():
        name, w = type(m).__name__, getattr(m, "weight", None)
        if name.endswith("RMSNorm") and isinstance(w, torch.Tensor) and w.dim() == 1 and w.is_floating_point():
            unit = not isinstance(getattr(m, "variance_epsilon", None), float)
            for x_dtype in {w.dtype, dtype}:  # the check's inputs (the weight's dtype), the steps' (the model's)
                found += elementwise.rms_variants(w.shape[0], x_dtype, w.dtype, unit_offset=unit, use_libdevice=libdevice)
                if not unit:
                    found += elementwise.rms_variants(w.shape[0], x_dtype, w.dtype, add=True, use_libdevice=libdevice)
        elif name.endswith("MLP") and hasattr(m, "down_proj"):
            gate, gate_up = getattr(m, "gate_proj", None), getattr(m, "gate_up_proj", None)
            act = _activation(getattr(m, "act_fn", None) or getattr(m, "activation_fn", None))
            width = gate.out_features if isinstance(gate, nn.Linear) else (
                gate_up.out_features // 2 if isinstance(gate_up, nn.Linear) else None)
            if act is not None and width:
                found += elementwise.silu_mul_variants(width, dtype, act == "gelu_tanh", use_libdevice=libdevice)
    if rotary_candidates(model):
        for q, k, dim in _heads(model):
            found += elementwise.rotary_variants(q, k, dim, dtype)
    unique = {}
    for variant in found:  # one each (many norms share a kind)
        unique.setdefault((variant.name, repr(variant.args), repr(sorted(variant.constexprs.items())),
                           repr(sorted(variant.options.items()))), variant)
    return list(unique.values())


def _is_silu(act) -> bool:
    from transformers.activations import SiLUActivation
    return isinstance(act, nn.SiLU) or type(act) is SiLUActivation


def _activation(act) -> str | None:
    """"silu", "gelu_tanh" (torch's gelu with approximate="tanh", in one op: Gemma's
    gelu_pytorch_tanh) or None (an activation the kernel does not compute)."""
    if _is_silu(act):
        return "silu"
    if isinstance(act, nn.GELU) and act.approximate == "tanh":
        return "gelu_tanh"
    fn = getattr(act, "act", None)  # transformers' GELUTanh, unless it runs its python formula
    if (type(act).__name__ == "GELUTanh" and isinstance(fn, functools.partial) and fn.func is F.gelu
            and fn.keywords == {"approximate": "tanh"} and not fn.args):
        return "gelu_tanh"
    return None


def _patchable(m: nn.Module):
    """(fused forward, the weight whose dtype/device/in-width it runs with, counter) for m, or None."""
    name, w = type(m).__name__, getattr(m, "weight", None)
    if "forward" in m.__dict__:  # already patched, by us or by someone else
        return None
    if name.endswith("RMSNorm") and isinstance(w, torch.Tensor) and w.dim() == 1 and w.is_floating_point():
        if isinstance(getattr(m, "variance_epsilon", None), float):  # Llama's form
            return _rms_forward, w, "rms_norms"
        if isinstance(getattr(m, "eps", None), float):  # Gemma's form, if the check agrees
            return _unit_offset_rms_forward, w, "rms_norms"
        return None
    if not name.endswith("MLP") or not hasattr(m, "down_proj"):
        return None
    gate, up, gate_up = (getattr(m, a, None) for a in ("gate_proj", "up_proj", "gate_up_proj"))
    act = getattr(m, "act_fn", None) or getattr(m, "activation_fn", None)
    if isinstance(act, nn.Module) and (has_hooks(act) or "forward" in act.__dict__):  # the kernel bypasses its call
        return None
    if (isinstance(gate, FusedPart) and isinstance(up, FusedPart) and gate.group is up.group
            and (gate.index, up.index) == (0, 1) and len(gate.group.sizes) == 2
            and gate.group.sizes[0] == gate.group.sizes[1] and _activation(getattr(m, "act_fn", None))):
        return _mlp_forward, gate.weight, "silu_muls" if _is_silu(m.act_fn) else "gelu_muls"
    if type(gate_up) is nn.Linear and gate_up.out_features % 2 == 0 and _is_silu(getattr(m, "activation_fn", None)):
        return _gate_up_forward, gate_up.weight, "silu_muls"
    return None


class FusedElementwise:
    """The element-wise fusions chosen for one model. attach() swaps them in, detach() puts the
    original forwards back (the model is stock again; the choice is kept for the next attach()),
    restore() detaches for good. A `with` block restores."""

    def __init__(self):
        self._modules: list[tuple[nn.Module, types.MethodType]] = []
        self._rotary: list[str] = []
        self._stashes: list = []  # residual_fusion's stashes, emptied on detach
        self._attached = False
        self.rms_norms = self.rotary_modules = self.silu_muls = self.gelu_muls = self.add_norms = 0

    def summary(self) -> str:
        """One line for logging, e.g. "fused 5 RMSNorm, rotary in 1 module, 2 SiLU-mul, 4 add+RMSNorm"."""
        s = "" if self.rotary_modules == 1 else "s"
        gelu = f"{self.gelu_muls} GELU-tanh-mul, " if self.gelu_muls else ""
        return (f"fused {self.rms_norms} RMSNorm, rotary in {self.rotary_modules} module{s}, {self.silu_muls} SiLU-mul, "
                f"{gelu}{self.add_norms} add+RMSNorm")

    def attach(self) -> None:
        if self._attached:
            return
        self._attached = True
        for m, forward in self._modules:
            m.forward = forward
        for name in self._rotary:
            _patch_rotary(name)

    def detach(self) -> None:
        """Put the original forwards and rotary functions back (idempotent)."""
        if not self._attached:
            return
        self._attached = False
        for m, forward in self._modules:
            if m.__dict__.get("forward") is forward:
                del m.forward
        for name in self._rotary:
            _unpatch_rotary(name)
        for stash in self._stashes:  # hold no activations between calls
            stash.clear()

    def restore(self) -> None:
        """Detach and forget the fusions (idempotent)."""
        self.detach()
        self._modules.clear()
        self._rotary.clear()
        self._stashes.clear()

    def __enter__(self) -> "FusedElementwise":
        return self

    def __exit__(self, *exc) -> None:
        self.restore()


def checked_patch(m: nn.Module, checked: dict) -> tuple | None:
    """(fused forward, counter) for m where its kind (class, forward, dtype, device) agrees with its own
    forward on random inputs, checked once per kind in `checked`; None where m is not patched."""
    found = _patchable(m)
    if found is None or not runs_on(found[1].device):
        return None
    forward, w, counter = found
    key = (type(m), forward, w.dtype, w.device)
    if key not in checked:
        x = torch.randn(3, w.shape[-1], generator=torch.Generator().manual_seed(0)).to(w.device, w.dtype)
        checked[key] = _agrees(types.MethodType(forward, m), m.forward, x)
    return (forward, counter) if checked[key] else None


def fuse_elementwise(model: nn.Module) -> FusedElementwise:
    """Point `model`'s RMSNorms, SiLU MLPs (whose gate/up fuse_projections() has fused, or Phi3's
    gate_up_proj) and its families' apply_rotary_pos_emb at the Triton kernels, in place, and fold
    the residual adds of its plain pre-norm decoder layers into the norms after them
    (residual_fusion.py).

    Each kind (class, dtype, device) is first checked against the original on random inputs and
    left alone if it disagrees; nothing is patched on devices Triton cannot run on. Returns the
    handle that restores; restore it before the projections' handle.
    """
    fused, checked = FusedElementwise(), {}
    try:
        for m in model.modules():
            found = checked_patch(m, checked)
            if found is not None:
                forward, counter = found
                fused._modules.append((m, types.MethodType(forward, m)))
                setattr(fused, counter, getattr(fused, counter) + 1)
        params = [p for p in model.parameters() if p.is_floating_point()]
        for name in rotary_candidates(model):
            if params and _rotary_agrees(name, params[0].dtype, params[0].device, *_heads(model)):
                fused._rotary.append(name)
                fused.rotary_modules += 1
        from hf_async_cb.model.residual_fusion import fuse_residuals  # (it imports this module)

        fuse_residuals(model, fused)
        fused.attach()
    except BaseException:
        fused.restore()
        raise
    return fused
