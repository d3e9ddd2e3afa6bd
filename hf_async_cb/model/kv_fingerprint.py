"""What the K/V of a cached prefix depends on beyond its tokens, read cheaply once per call.

The prefix cache (engine/prefix_cache.py) must never hand out K/V that the model would no longer
compute. A call compares this fingerprint with the last one and empties the cache on a change:

- the weights' version counters: an optimizer step, `load_state_dict`, `copy_`, any in-place write
  through autograd's view of a parameter or buffer bumps them (one attribute per tensor);
- with `content=True` (once per engine call), the weights' contents (model/weight_kinds.content_sums:
  one pass over them, a wrapping sum of their bits): writes through `.data`, a collective
  into a parameter (`broadcast`, `all_reduce`: an RL trainer's weight sync) or a NumPy view bump no
  counter. A serving loop (engine/online.py) reads the counters alone, at each pass (a pass over
  the weights there would cost every request arriving at an idle server its time):
  `Engine.clear_prefix_cache()` is for a write that bumps none while it serves;
- the storages (a reassigned `.data`, `.to()`); the runtime rebuilds on those anyway;
- each adapter layer's state (PEFT: the active adapters, disabled, merged), which switches without
  touching a weight;
- every module's own settings, as the parity verdict's key reads them (model/numerics_key.py): a
  LoRA layer's scaling (PEFT's `rescale_adapter_scale`, `set_scale`), a parametrization's or a
  custom module's attributes (a few ms for an 8B model);
- tensors that modules of other code than transformers' hold as plain attributes (not parameters or
  buffers: a steering vector a custom module adds), by identity, storage and version counter;
- the call's arithmetic (model/numeric_context.py): autocast, the matmul precisions.

Tensors made under `torch.inference_mode()` keep no version counter (HQQ quantizes into such
tensors): with `content=True` their values are read as every weight's are, so a write to one (only
possible under inference_mode) is seen at the next call; a serving loop's reading of the counters
alone cannot see it, so there the fingerprint of such a model is None. Forward hooks of the user's,
or a forward of the user's patched onto a module instance, may hold anything (a steering vector
changed in place between calls), and torch.ao's quantized Linears keep their weights in TorchScript
objects that no tensor read reaches (`set_weight_bias()`): for such a model the fingerprint is None,
"unknown", and the cache lives for one call only.
"""

from __future__ import annotations

import torch

from hf_async_cb.model.code_identity import code_identity, owners
from hf_async_cb.model.compiled import unwrapped
from hf_async_cb.model.config_snapshot import config_snapshot
from hf_async_cb.model.fusion import global_hooks, moved_from, user_hooks
from hf_async_cb.model.numeric_context import numeric_context
from hf_async_cb.model.numerics_key import numerics_key
from hf_async_cb.model.weight_kinds import content_sums, held_tensors, is_plain, storage_key, storage_ref, versions


def kv_fingerprint(model: torch.nn.Module, content: bool = False) -> tuple | None:
    """A value that changes whenever the K/V `model` computes for given tokens may have; None when
    that cannot be told (inference tensors, forward hooks of the user's). `content`: read the
    weights' values too (a pass over them), for writes that bump no version counter.
    The modules are walked once; every read below goes over that list (a walk through nn.Module's
    nested generators costs about a millisecond for an 8B model's 423 modules)."""
    named = list(model.named_modules())
    modules = [m for _, m in named]
    if runs_user_code(model, modules) or holds_opaque_weights(modules):
        return None
    tensors = model_tensors(model, modules)
    counters = versions(tensors)
    if counters is None:  # inference tensors: none kept; their values are read below (content) or nothing is known
        if not content:
            return None
        counters = [0 if t.is_inference() else t._version for t in tensors]
    try:
        settings = hash(numerics_key(model, named))
    except Exception:  # noqa: BLE001 - settings it cannot read: unknown
        return None
    storages = tuple(storage_key(t) for t in tensors)  # (a quantized subclass's inner tensors')
    fingerprint = (sum(counters), hash(storages), adapter_states(modules), settings,
                   numeric_context(tensors[0].device.type if tensors else "cpu"))
    return fingerprint + (content_sums(tensors),) if content else fingerprint


def model_tensors(model: torch.nn.Module, modules: list[torch.nn.Module] | None = None) -> list[torch.Tensor]:
    """Every tensor the model computes from: parameters, buffers, the attributes of modules of other
    code than transformers', and what each of those holds inside (weight_kinds.held_tensors: a
    quantized weight's inner data and scales, which a write can change without bumping any counter
    of the weight itself)."""
    modules = list(model.modules()) if modules is None else modules
    listed = [*parameters_of(modules), *_unique(t for m in modules for t in m._buffers.values()),
              *attribute_tensors(model, modules)]
    seen = {id(t) for t in listed}
    return listed + [inner for t in listed for inner in held_tensors(t, seen=seen)]


def parameters_of(modules: list[torch.nn.Module]) -> list[torch.Tensor]:
    """model.parameters()'s list, from `list(model.modules())` (no second walk)."""
    return _unique(t for m in modules for t in m._parameters.values())


def _unique(tensors) -> list[torch.Tensor]:
    """The tensors once each (a tied weight is one tensor), None left out: model.parameters()'s list."""
    seen: set[int] = set()
    return [t for t in tensors if t is not None and id(t) not in seen and not seen.add(id(t))]


def runs_user_code(model: torch.nn.Module, modules: list[torch.nn.Module] | None = None) -> bool:
    """Whether a forward of `model` runs forward hooks of the user's (global ones included), or a
    forward of the user's patched onto a module instance. `modules`: `list(model.modules())` where
    the caller has it."""
    return any(global_hooks()) or any(_hooked(m) or _patched(m) for m in (modules or model.modules()))


def holds_opaque_weights(modules: list[torch.nn.Module]) -> bool:
    """Whether a module keeps weights in an object no tensor read reaches: a TorchScript object (the
    packed parameters of torch.ao's quantized and dynamically quantized Linears, which
    `set_weight_bias()` rewrites). The fingerprint is then unknown."""
    return any(isinstance(v, torch.ScriptObject) for m in modules for v in vars(m).values())


# Instance forwards whose state is the model's own: this package's swaps, accelerate's device hooks
# (device_map), torch.compile's wrappers (set aside while the engine runs).
_KNOWN_FORWARDS = ("hf_async_cb.", "accelerate.", "torch._dynamo.", "torch.nn.")


def _patched(module: torch.nn.Module) -> bool:
    """Whether a forward set on this module instance (`module.forward = f`) is the user's own code."""
    forward = module.__dict__.get("forward")
    if forward is None or getattr(module, "_hf_hook", None) is not None:  # (accelerate's, whatever it wraps)
        return False
    forward = unwrapped(forward)  # torch.compile's wrapper (it copies the metadata of what it wraps)
    if getattr(forward, "__self__", None) is module and getattr(forward, "__func__", None) is getattr(
            type(module).forward, "__func__", type(module).forward):
        return False  # (its own class's forward, bound: stored by some wrappers)
    origin = getattr(forward, "__func__", None) or getattr(forward, "func", None) or forward
    where = getattr(origin, "__module__", None) or type(origin).__module__ or ""
    return not where.startswith(_KNOWN_FORWARDS)


def attribute_tensors(model: torch.nn.Module, modules: list[torch.nn.Module] | None = None) -> list[torch.Tensor]:
    """Tensors the modules of other code than transformers' hold as plain attributes, or inside the
    containers and objects they hold (HQQ's `meta` dict of scales and zeros); parameters and buffers
    are kept apart, in their own tables. transformers' own modules hold none that their numerics
    read, only what a forward leaves for the next (Qwen2-VL's `rope_deltas`)."""
    found: list[torch.Tensor] = []
    for m in (modules or model.modules()):
        if type(m).__module__.startswith("transformers."):
            continue
        for name, v in vars(m).items():
            if isinstance(v, torch.Tensor):
                found.append(v)
            elif name not in _MODULE_TABLES and not isinstance(v, (str, int, float, bool, type(None))):
                found += held_tensors(v)
    return found


_MODULE_TABLES = frozenset(vars(torch.nn.Module()))  # nn.Module's own: parameters, buffers, children, hooks


def _hooked(module: torch.nn.Module) -> bool:
    """Whether the module runs forward hooks of the user's (those that only mark outputs as needing
    gradients, for gradient checkpointing with frozen embeddings, change no value)."""
    keys = user_hooks(module)
    hooks = (module._forward_hooks, module._forward_pre_hooks)
    return any(getattr(hooks[i][k], "__name__", "") != "make_inputs_require_grad" for i in (0, 1) for k in keys[i])


def adapter_states(modules: list[torch.nn.Module]) -> tuple:
    return _states(m for m in modules if "_active_adapter" in m.__dict__)  # (PEFT tuner layers)


def _states(adapters) -> tuple:
    """Each adapter layer's active, disabled and merged adapters, and its scaling (LoRA's)."""
    return tuple((id(m), str(m.__dict__["_active_adapter"]), m.__dict__.get("_disable_adapters"),
                  tuple(m.__dict__.get("merged_adapters", ())), _scaling(m.__dict__.get("scaling")))
                 for m in adapters)


def _scaling(scaling) -> tuple | None:
    return tuple(sorted((str(k), float(v)) for k, v in scaling.items())) if isinstance(scaling, dict) else None


class WeightVersions:
    """The weights' version counters and the adapter layers' states (scaling included) of a model
    whose modules stay as they are (a serving loop's): the tensors and adapter layers listed once, so
    that a read costs one attribute per tensor (about 25 us for an 8B model), cheap enough for every
    admission. Views share their base's counter, so writes through the user's parameters are seen
    while fused modules are attached. None: inference tensors, which keep no counter, and forward
    hooks of the user's. The reading thread's arithmetic is part of it (model/numeric_context.py).
    Other module settings are read per call (kv_fingerprint), not here."""

    def __init__(self, model: torch.nn.Module) -> None:
        modules = list(model.modules())
        self._tensors = model_tensors(model, modules)
        self._device_type = self._tensors[0].device.type if self._tensors else "cpu"
        self._adapters = [m for m in modules if "_active_adapter" in m.__dict__]
        self._slots = [(table, name, t) for m in modules for table in (m._parameters, m._buffers)
                       for name, t in table.items() if t is not None]
        listed = {id(t) for t in self._tensors}  # (the attribute tensors among them, in their modules' dicts)
        self._slots += [(vars(m), name, t) for m in modules if not type(m).__module__.startswith("transformers.")
                        for name, t in vars(m).items() if isinstance(t, torch.Tensor) and id(t) in listed]
        self.runs_user_code = runs_user_code(model, modules)
        self._hooked = self.runs_user_code or holds_opaque_weights(modules)  # (either: nothing known)
        # The modules' structure, for restructured(): each tensor and child in its table, the tensors held
        # in containers (HQQ's meta dict: its scales and zeros) by identity, where every tensor's data
        # live (`.data = ...` keeps the tensor: fusion.moved_from, so that the package's own fusions are
        # no change), and the hook tables.
        self._holders = [m for m in modules if not type(m).__module__.startswith("transformers.")
                         and attribute_tensors(model, [m])]
        self._held = self._held_ids()
        # (a data pointer with a weak reference to its storage: another storage can take a freed one's address)
        self._storages = [(t, t.data_ptr() if is_plain(t) else None, storage_ref(t) if is_plain(t) else None,
                           moved_from(t)) for t in self._tensors]
        self._children = [(m._modules, name, child) for m in modules for name, child in m._modules.items()]
        self._hook_tables = [table for m in modules for table in (m._forward_hooks, m._forward_pre_hooks)]
        self._hooks = self._hook_keys()
        self._config = model.config
        self._settings = config_snapshot(model.config)
        self._owners = owners(modules)  # (the classes and files whose functions the forward runs)
        self._code = code_identity(modules, self._owners)

    def restructured(self) -> bool:
        """Whether a parameter or buffer was replaced by another tensor (a new nn.Parameter,
        `load_state_dict(..., assign=True)`) or given other data (`p.data = ...`), a tensor a module
        holds in a container replaced (HQQ's `meta["scale"] = ...`), a module replaced, or a forward hook added or removed
        (the model's own or a global one), its config edited (model/config_snapshot.py) or the code its
        classes run patched (model/code_identity.py) since: a model this loop can no longer run as it
        was built. About 200 us for a 32-layer Llama's 423 modules and its config (on this project's
        CPU), read at each admission."""
        return (self._hook_keys() != self._hooks
                or any(table.get(name) is not t for table, name, t in self._slots)
                or self._held_ids() != self._held
                or any((ptr is None or t.data_ptr() != ptr or ref is None or ref() is None) and moved_from(t) != key
                       for t, ptr, ref, key in self._storages)
                or any(table.get(name) is not child for table, name, child in self._children)
                or config_snapshot(self._config) != self._settings
                or code_identity([], self._owners) != self._code)

    def _held_ids(self) -> list[int]:
        return [id(t) for t in attribute_tensors(None, self._holders)] if self._holders else []

    def _hook_keys(self) -> tuple:
        tables = [t for t in self._hook_tables if t]  # (mostly empty: a handle's key is unique for the process)
        return tuple(k for t in tables for k in t), global_hooks()

    def read(self) -> tuple | None:
        if self._hooked:  # forward hooks of the user's may hold anything: unknown
            return None
        counters = versions(self._tensors)
        return None if counters is None else (sum(counters), _states(self._adapters),
                                                numeric_context(self._device_type))
