"""What, beyond its class, config, dtype and device, decides how a model computes.

A parity verdict (engine/parity.py) is kept for models that compute alike, so whatever changes a
model's numerics must be in the key it is kept under, or a verdict measured on one model would be
borrowed by another that the engine gets wrong (a torchao `quantize_` applied after loading leaves
class, config and dtype as they were). numerics_key() reads, without looking at any weight's values:

- every parameter's and buffer's kind: its tensor class, dtype and shape, and for a tensor subclass
  (torchao's Int8Tensor / Float8Tensor, bitsandbytes' Int8Params / Params4bit, quanto's tensors)
  its layout: the attributes it carries (quantization scheme, granularity, block size, packing)
  and its inner tensors' kinds;
- every module's class (quantized linears: bitsandbytes, quanto, HQQ, transformers' FP8 ones;
  PEFT's adapter layers) and the settings it holds on its instance (a LoRA layer's active adapter,
  scaling, disabled and merged state; HQQ's bits and group size; bitsandbytes' threshold), the
  model's PEFT adapter configs among them;
- the compiled wrappers on the model (model/compiled.py).

Values are reduced to plain, comparable data: numbers, strings, dtypes, tuples; tensors by kind,
objects by class and their own attributes, two levels deep; configs (the key has the model's
own) and submodules (each has its own entry) are left out.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import types

import torch
from torch import nn

from hf_async_cb.model.compiled import compiled_wrappers
from hf_async_cb.model.weight_kinds import is_plain, is_transformers_config, scratch_attributes

_DEPTH = 4  # levels of objects inside objects read
_LONGEST = 64  # items of a sequence or mapping read (and its length)
# nn.Module's own bookkeeping, and transformers' flags that change no forward: a model's output-capturing
# hooks are installed at its first forward (a VLM's tower at its first image, inside a call: read in the
# key, the flag made every VLM's second call drop the prefix cache and the tower outputs of its first).
_MODULE_BASICS = frozenset(vars(nn.Module())) | {"training", "_output_capturing_hooks_installed", "_is_hf_initialized"}


def _name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


_SCALARS = (bool, int, float, str, bytes, type(None))


def _leave_out(value) -> bool:
    """Objects the key reads elsewhere or that do not change a forward: submodules, configs."""
    if type(value) in _SCALARS:  # (most of a module's attributes: read at once)
        return False
    return isinstance(value, nn.Module) or is_transformers_config(value)


def tensor_kind(t: torch.Tensor, depth: int = 0) -> tuple:
    """A tensor's class, dtype and shape; for a subclass also its layout (see the module docstring)."""
    kind = (_name(type(t)), str(t.dtype), tuple(t.shape))
    if is_plain(t) or depth >= _DEPTH:
        return kind
    layout = []
    flatten = getattr(t, "__tensor_flatten__", None)
    if callable(flatten):
        try:
            names, context = flatten()
            layout.append(("inner", tuple((n, _plain(getattr(t, n, None), depth + 1)) for n in names)))
            layout.append(("context", _plain(context, depth + 1)))
        except Exception:  # noqa: BLE001 - the attributes below still describe it
            pass
    layout.append(("attributes", _attributes(vars(t), depth + 1, private=False)))
    return kind + tuple(layout)


def _attributes(state: dict, depth: int, private: bool, skip=frozenset()) -> tuple:
    kept = sorted(k for k in state if k not in skip and (private or not k.startswith("_")))  # (names are unique)
    return tuple((k, _plain(state[k], depth)) for k in kept if not _leave_out(state[k]))


def _sequence(values, depth: int) -> tuple:
    values = list(values)
    head = tuple(_plain(v, depth) for v in values[:_LONGEST])
    return head if len(values) <= _LONGEST else head + (("length", len(values)),)


def _plain(value, depth: int = 0):
    """`value` as plain comparable data (see the module docstring)."""
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    if isinstance(value, enum.Enum):
        return (_name(type(value)), _plain(value.value, depth))
    if isinstance(value, (torch.dtype, torch.device, torch.Size, torch.layout, torch.memory_format)):
        return str(value)
    if isinstance(value, torch.Tensor):
        return tensor_kind(value, depth)
    if depth >= _DEPTH:
        return _name(type(value))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, _sequence(value, depth + 1))
    if isinstance(value, (set, frozenset)):
        return ("set", tuple(sorted(_sequence(value, depth + 1), key=repr)))
    if isinstance(value, dict):
        items = [(str(k), v) for k, v in sorted(value.items(), key=lambda kv: repr(kv[0])) if not _leave_out(v)]
        head = tuple((k, _plain(v, depth + 1)) for k, v in items[:_LONGEST])
        return ("dict", head if len(items) <= _LONGEST else head + (("length", len(items)),))
    if isinstance(value, functools.partial):
        return ("partial", _plain(value.func, depth + 1), _plain(value.args, depth + 1),
                _plain(value.keywords, depth + 1))
    if isinstance(value, types.MethodType):
        return ("method", _name(type(value.__self__)), _plain(value.__func__, depth + 1))
    if isinstance(value, (types.FunctionType, types.BuiltinFunctionType, type)):
        return ("function", getattr(value, "__module__", None), getattr(value, "__qualname__", repr(value)))
    if dataclasses.is_dataclass(value):  # (less what each forward writes for itself: LLM.int8()'s outlier columns)
        scratch = scratch_attributes(value)
        return (_name(type(value)), tuple((f.name, _plain(getattr(value, f.name, None), depth + 1))
                                          for f in dataclasses.fields(value) if f.name not in scratch))
    state = getattr(value, "__dict__", None)
    if isinstance(state, dict):
        return (_name(type(value)), _attributes(state, depth + 1, private=False, skip=scratch_attributes(value)))
    return _name(type(value))


def numerics_key(model: nn.Module, modules: list[tuple[str, nn.Module]] | None = None) -> tuple:
    """The key part that sets apart models of one class, config, dtype and device that compute differently.
    `modules`: `list(model.named_modules())` where the caller has it (one walk of the model for all its reads)."""
    modules = list(model.named_modules()) if modules is None else modules
    parameters, buffers = [], []
    for prefix, m in modules:  # (as named_parameters(remove_duplicate=False): a tied weight under each name)
        dot = prefix + "." if prefix else ""
        parameters += [(dot + name, tensor_kind(t)) for name, t in m._parameters.items() if t is not None]
        buffers += [(dot + name, tensor_kind(t)) for name, t in m._buffers.items() if t is not None]
    settings = tuple((name, _name(type(m)), _attributes(vars(m), 0, private=True, skip=_MODULE_BASICS))
                     for name, m in modules)
    return tuple(parameters + buffers), settings, tuple(compiled_wrappers(model, modules))
