"""Fold each decoder layer's residual adds into the RMSNorms that follow them (one kernel each).

A Llama-style pre-norm layer runs `residual + attn_out` and `residual + mlp_out` as torch add
kernels, each followed by an RMSNorm: the layer's post_attention_layernorm, and across layers the
next layer's input_layernorm (the model's final norm after the last layer). fuse_residuals(), part
of elementwise_fusion.fuse_elementwise(), replaces the forward of each layer whose code is proven
to be that plain pattern (plain_prenorm(): its source's AST, statement by statement) with one that
computes each add and the norm after it in one kernel (kernels/elementwise.py add_rms_norm, bit for
bit the add followed by the rms_norm kernel): two kernels fewer per layer in every step.

Inside the layer the normed sum goes straight to the MLP. Across layers the layer still returns the
real sum, so hidden-state outputs, hooks and anything else reading it see what the original
returns; the normed sum is stashed on the next norm, keyed by that output tensor (its identity and
version counter, and the norm's weight), and the next norm, patched, returns it only when called
with that very tensor, unmodified since; any other input, or a modified one, is normed afresh, and a
stash is dropped once looked at. Calls the patch cannot prove it handles as the original does
(deprecated keyword names, gradient checkpointing, arguments that do not bind, inputs the kernels
cannot take) run the original forward; past the attention, tensors the kernel cannot take (autograd,
mixed dtypes, inference tensors for the stash) take the original torch ops.

Only norms fuse_elementwise() patches qualify (RMSNorms computed by the rms_norm kernel), and each
kind (class, dtype, device) is first checked on random inputs against the add followed by the
norm's original forward.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
import types
from dataclasses import dataclass

import torch
from torch import nn

from hf_async_cb.kernels.paged_attention import runs_on
from hf_async_cb.model import elementwise_fusion as ew
from hf_async_cb.model.fusion import has_hooks


@dataclass(frozen=True)
class LayerForm:
    """What plain_prenorm() proved about a decoder layer class's forward."""

    hidden: str  # the hidden-states parameter
    attn_keyword: str  # the keyword self_attn gets the normed hidden states by
    passes: tuple[tuple[str, str], ...]  # (keyword, parameter): self_attn's other keyword arguments
    var_keyword: str | None  # the **kwargs parameter, when self_attn gets it spread
    deprecated: tuple[str, ...]  # keywords a deprecate_kwarg wrapper renames: calls using them run the original
    checkpointing: bool  # wrapped by GradientCheckpointingLayer: checkpointed calls run the original
    signature: inspect.Signature  # of the undecorated forward


# The statements around the attention call (index 2), for R (the residual), H (the hidden states), S (self).
_STATEMENTS = """
{R} = {H}
{H} = {S}.input_layernorm({H})
{H} = {R} + {H}
{R} = {H}
{H} = {S}.post_attention_layernorm({H})
{H} = {S}.mlp({H})
{H} = {R} + {H}
return {H}
"""

_FORMS: dict[tuple, LayerForm | None] = {}  # (class, its forward) -> its form


def plain_prenorm(cls: type) -> LayerForm | None:
    """The form of cls.forward if it is exactly the plain pre-norm decoder layer, else None:

        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(hidden_states=hidden_states, <param>=<param>, ..., **kwargs)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        hidden_states = residual + hidden_states
        return hidden_states

    whatever the variable and parameter names, with comments and a docstring ignored, and wrapped at
    most by transformers' deprecate_kwarg and GradientCheckpointingLayer wrappers. Checked once per class
    and forward (a forward patched onto the class later is read afresh).
    """
    forward = getattr(cls, "forward", None)
    key = (cls, forward)
    if key not in _FORMS:
        try:
            _FORMS[key] = _match(forward)
        except (OSError, TypeError, SyntaxError, ValueError, AttributeError):  # no source, unparsable, ...
            _FORMS[key] = None
    return _FORMS[key]


@functools.cache
def _wrapper_codes() -> dict:
    """code object -> kind, for the transformers wrappers a layer forward may carry (each wrapper a
    decorator makes shares its code object)."""
    codes = {}
    try:
        from transformers.utils.deprecation import deprecate_kwarg

        codes[deprecate_kwarg("old", "0.0.0", new_name="new")(lambda self, new=None: None).__code__] = "deprecate"
    except Exception:
        pass
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer

        class _Probe(GradientCheckpointingLayer):
            def forward(self, x):
                return x

        if hasattr(_Probe.forward, "__wrapped__"):  # versions that wrap forward (older ones override __call__)
            codes[_Probe.forward.__code__] = "checkpoint"
    except Exception:
        pass
    return codes


def _match(fn) -> LayerForm | None:
    codes, deprecated, checkpointing = _wrapper_codes(), [], False
    while isinstance(fn, types.FunctionType) and hasattr(fn, "__wrapped__"):
        kind = codes.get(fn.__code__)
        if kind == "deprecate":
            cells = dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__ or ())))
            deprecated.append(cells["old_name"])
        elif kind == "checkpoint":
            checkpointing = True
        else:
            return None
        fn = fn.__wrapped__
    if not isinstance(fn, types.FunctionType):
        return None
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.FunctionDef):
        return None
    fdef = tree.body[0]
    decorators = [d.func if isinstance(d, ast.Call) else d for d in fdef.decorator_list]
    if len(decorators) != len(deprecated) or not all(
            (d.id if isinstance(d, ast.Name) else getattr(d, "attr", None)) == "deprecate_kwarg" for d in decorators):
        return None
    args = fdef.args
    if args.vararg is not None or args.posonlyargs or len(args.args) < 2:
        return None
    names = [a.arg for a in args.args + args.kwonlyargs]
    var_kw = args.kwarg.arg if args.kwarg else None
    signature = inspect.signature(fn)
    if list(signature.parameters) != names + ([var_kw] if var_kw else []):  # the source is this code's
        return None
    this, hidden = names[0], names[1]
    body = fdef.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]  # the docstring
    if len(body) != 9 or not isinstance(body[0], ast.Assign) or not isinstance(body[0].targets[0], ast.Name):
        return None
    residual = body[0].targets[0].id
    if residual in names or residual == var_kw:
        return None
    expected = [ast.dump(s) for s in ast.parse(_STATEMENTS.format(R=residual, H=hidden, S=this)).body]
    if [ast.dump(s) for i, s in enumerate(body) if i != 2] != expected:
        return None
    attn = _attention_call(body[2], this, hidden, residual, set(names[2:]), var_kw)
    if attn is None:
        return None
    attn_keyword, passes, spread = attn
    return LayerForm(hidden, attn_keyword, passes, var_kw if spread else None, tuple(deprecated), checkpointing,
                     signature)


def _attention_call(stmt, this, hidden, residual, params, var_kw):
    """(keyword of the hidden states, ((keyword, parameter), ...), whether **var_kw is spread) of
    `hidden, _ = this.self_attn(<keyword>=hidden, <keyword>=<parameter>, ..., **var_kw)`, else None."""
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Tuple)):
        return None
    targets = stmt.targets[0].elts
    if len(targets) != 2 or not all(isinstance(t, ast.Name) for t in targets) or targets[0].id != hidden \
            or targets[1].id in (this, hidden, residual):
        return None
    call = stmt.value
    if not isinstance(call, ast.Call) or call.args or \
            ast.dump(call.func) != ast.dump(ast.parse(f"{this}.self_attn", mode="eval").body):
        return None
    attn_keyword, passes, spread = None, [], False
    for keyword in call.keywords:
        value = keyword.value.id if isinstance(keyword.value, ast.Name) else None
        if keyword.arg is None and value is not None and value == var_kw and not spread:
            spread = True
        elif keyword.arg is not None and value == hidden and attn_keyword is None:
            attn_keyword = keyword.arg
        elif keyword.arg is not None and value in params:
            passes.append((keyword.arg, value))
        else:
            return None
    return None if attn_keyword is None else (attn_keyword, tuple(passes), spread)


class _Stash:
    """A normed sum a layer computed for the norm that follows it, for that norm's next call only."""

    __slots__ = ("_normed", "_version", "_weight", "_weight_version", "_x")

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self._x = self._version = self._weight = self._weight_version = self._normed = None

    def put(self, x: torch.Tensor, normed: torch.Tensor, weight: torch.Tensor) -> None:
        if x.is_inference() or weight.is_inference():  # no version counter: a hit could not be proven fresh
            self.clear()
            return
        self._x, self._version, self._weight, self._weight_version = x, x._version, weight, weight._version
        self._normed = normed

    def take(self, x, weight) -> torch.Tensor | None:
        """The stashed result if x is the stashed tensor, unmodified, and weight the same, unmodified."""
        hit = (self._x is not None and x is self._x and x._version == self._version
               and weight is self._weight and weight._version == self._weight_version)
        normed = self._normed if hit else None
        self.clear()
        return normed


def _stashed_rms_forward(norm: nn.Module, stash: _Stash):
    """The fused RMSNorm forward, serving a stashed result for its input when there is one."""
    def forward(x, *args, **kwargs):
        normed = None if args or kwargs else stash.take(x, norm.weight)
        if normed is None:
            stash.clear()
            return ew._rms_forward(norm, x, *args, **kwargs)
        return normed
    return forward


def _fits(x, residual: torch.Tensor, norm: nn.Module, forward) -> bool:
    """Whether add_rms_norm(x, residual, norm's weight) can stand in for `residual + x` and norm's
    (attached, fused) forward of the sum."""
    w = norm.weight
    return (isinstance(x, torch.Tensor) and x.shape == residual.shape and x.dtype == residual.dtype
            and x.device == residual.device == w.device and x.shape[-1] == w.shape[0]
            and ew._usable(x, residual, w) and norm.__dict__.get("forward") is forward)


def _layer_forward(layer: nn.Module, form: LayerForm, post_forward, following: nn.Module | None,
                   following_forward, stash: _Stash | None):
    """The patched forward of one plain pre-norm decoder layer (see the module docstring)."""
    original = type(layer).forward

    def forward(*args, **kwargs):
        x, passes, spread = _bind(layer, form, args, kwargs)
        if x is None:
            return original(layer, *args, **kwargs)
        normed = layer.input_layernorm(x)
        hidden, _ = layer.self_attn(**{form.attn_keyword: normed}, **passes, **spread)
        post = layer.post_attention_layernorm
        if _fits(hidden, x, post, post_forward) and not has_hooks(post):
            total, normed = ew.add_rms_norm(hidden, x, post.weight, post.variance_epsilon)
        else:
            total = x + hidden
            normed = post(total)
        hidden = layer.mlp(normed)
        if (following is not None and not torch.is_inference_mode_enabled() and not following.weight.is_inference()
                and _fits(hidden, total, following, following_forward)):
            out, normed = ew.add_rms_norm(hidden, total, following.weight, following.variance_epsilon)
            stash.put(out, normed, following.weight)
            return out
        return total + hidden

    forward.__doc__ = f"{type(layer).__name__}.forward with its residual adds fused into the RMSNorms after them"
    return forward


def _bind(layer: nn.Module, form: LayerForm, args: tuple, kwargs: dict):
    """(hidden states, self_attn's keyword pass-throughs, its spread **kwargs) for a call, or
    (None, None, None) where the original forward must run."""
    if any(name in kwargs for name in form.deprecated) or (
            form.checkpointing and getattr(layer, "gradient_checkpointing", False) and layer.training
            and torch.is_grad_enabled()):
        return None, None, None
    try:
        bound = form.signature.bind(layer, *args, **kwargs)
    except TypeError:
        return None, None, None
    bound.apply_defaults()
    values = bound.arguments
    x, first, post = values[form.hidden], layer.input_layernorm, layer.post_attention_layernorm
    if not (ew._usable(x, first.weight, post.weight) and x.shape[-1] == first.weight.shape[0] == post.weight.shape[0]):
        return None, None, None
    passes = {keyword: values[name] for keyword, name in form.passes}
    return x, passes, (values[form.var_keyword] if form.var_keyword else {})


def fuse_residuals(model: nn.Module, fused) -> None:
    """Add to `fused` (an elementwise_fusion.FusedElementwise, before it attaches) a fused forward for
    every plain pre-norm decoder layer of `model` whose norms it patches, and a stash-serving
    forward for each norm that follows such a layer (the next layer's input norm, or the final norm)."""
    norms = {id(m): i for i, (m, f) in enumerate(fused._modules) if getattr(f, "__func__", None) is ew._rms_forward}
    checked: dict[tuple, bool] = {}

    def agrees(norm: nn.Module) -> bool:
        w = norm.weight
        key = (type(norm), w.dtype, w.device)
        if key not in checked:
            g = torch.Generator().manual_seed(0)
            x, r = (torch.randn(3, w.shape[0], generator=g).to(w.device, w.dtype) for _ in range(2))
            eps, original = norm.variance_epsilon, type(norm).forward
            checked[key] = ew._agrees(lambda a, b: ew.add_rms_norm(a, b, w, eps),
                                      lambda a, b: (b + a, original(norm, b + a)), x, r)
        return checked[key]

    following = {}  # id(layer) -> the norm its output goes to next, as the model's forward runs them
    for parent in model.modules():
        layers = getattr(parent, "layers", None)
        if isinstance(layers, nn.ModuleList):
            after = [getattr(layer, "input_layernorm", None) for layer in list(layers)[1:]]
            following.update(zip(map(id, layers), after + [getattr(parent, "norm", None)]))
    plans = []
    for layer in model.modules():
        if not all(hasattr(layer, a) for a in ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")):
            continue
        form = plain_prenorm(type(layer))
        first, post = layer.input_layernorm, layer.post_attention_layernorm
        if (form is None or "forward" in layer.__dict__ or id(first) not in norms or id(post) not in norms
                or not runs_on(post.weight.device) or not agrees(post)):
            continue
        after = following.get(id(layer))
        plans.append((layer, form, after if id(after) in norms and agrees(after) else None))
    stashes = {}
    for _, _, after in plans:
        if after is not None and id(after) not in stashes:
            stash = stashes[id(after)] = _Stash()
            fused._modules[norms[id(after)]] = (after, _stashed_rms_forward(after, stash))
            fused._stashes.append(stash)
    forwards = {id(m): f for m, f in fused._modules}
    for layer, form, after in plans:
        fused._modules.append((layer, _layer_forward(layer, form, forwards[id(layer.post_attention_layernorm)],
                                                     after, forwards.get(id(after)), stashes.get(id(after)))))
        fused.add_norms += 1 + (after is not None)
