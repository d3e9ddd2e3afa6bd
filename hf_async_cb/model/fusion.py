"""Fuse sibling projections (q/k/v, gate/up) of a loaded model into one GEMM each, reversibly.

Decode steps multiply a few dozen rows by each weight matrix. Such skinny GEMMs run far below
memory bandwidth when q, k and v (or an MLP's gate and up) are separate nn.Linear calls, and near
it when they are one GEMM over the concatenated weights. fuse_projections() concatenates each
group's weights once and turns the original parameters into views of the fused tensor, so no
second copy of the weights exists. Each member attribute is replaced by a FusedPart; the first
part called computes the whole group's output, and its siblings, called with the same input
tensor, take their slices from a short-lived cache. Model forward code is left untouched.

Fusion is for inference: the fused GEMM does not propagate gradients to the original parameters.
detach() puts the original Linears back while their weights stay views of the fused tensors, so
between engine calls the model is stock to every observer (forward, training, state_dict, .to())
at no cost, and attach() swaps the fused parts in again for the next call; intact() says whether
the views are still the model's weights (a `.to()` or a reassigned `.data` breaks them).
restore() gives every weight its own storage back.
"""

from __future__ import annotations

import copy
import logging
import threading
import weakref

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as _module

from hf_async_cb.model.weight_kinds import is_plain_floating, storage_key, storage_ref

GROUPS = {"qkv": ("q_proj", "k_proj", "v_proj"), "gate_up": ("gate_proj", "up_proj")}
logger = logging.getLogger(__name__)
_LIVE: "weakref.WeakSet[FusedProjections]" = weakref.WeakSet()  # every fusion not yet garbage

# The weights our fusions gave new storage (fusing: a view of the fused tensor; restore(): a copy of
# their own), each with the storage it had before the first such move: per id(weight), (a reference
# to it, a weak reference to the storage given, its storage key before). A held Engine built before another
# preparation of the same model fused (or gave back) its weights reads them as unchanged (moved_from),
# where a `p.data = ...` of the user's still counts as a change.
_MOVED: dict[int, tuple[weakref.ref, object, tuple]] = {}
_MOVED_LOCK = threading.Lock()
_MOVED_SWEEP = [4096]  # the record's size above which entries of collected weights are dropped


def moved_from(t: torch.Tensor) -> tuple:
    """t's storage key (weight_kinds.storage_key); while t holds the storage one of our fusions gave
    it, the key it had before the package first moved it."""
    entry = _MOVED.get(id(t))
    if entry is not None and entry[0]() is t and entry[1] is not None and entry[1]() is not None \
            and entry[1] == storage_ref(t):  # (the storage given, alive: not one at its address since)
        return entry[2]
    return storage_key(t)


def _move(t: torch.Tensor, data: torch.Tensor) -> None:
    """`t.data = data`, recorded (see _MOVED)."""
    before = moved_from(t)
    t.data = data
    with _MOVED_LOCK:
        _MOVED[id(t)] = (weakref.ref(t), storage_ref(t), before)
        if len(_MOVED) > _MOVED_SWEEP[0]:
            for key in [k for k, (ref, _, _) in _MOVED.items() if ref() is None]:
                del _MOVED[key]
            _MOVED_SWEEP[0] = max(4096, 2 * len(_MOVED))


def _joined(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors concatenated along their first dimension. Where they already are consecutive
    blocks of one storage (members an earlier preparation fused, which another Engine or the
    generate() runtime still runs on), that storage itself: a copy would give the weights new
    storage under the engine that fused them first."""
    first = tensors[0].detach()
    storage, offset = first.untyped_storage(), first.storage_offset()
    for t in tensors:
        if not (t.is_contiguous() and t.dtype == first.dtype and t.device == first.device
                and t.untyped_storage().data_ptr() == storage.data_ptr() and t.storage_offset() == offset):
            return torch.cat(tensors)
        offset += t.numel()
    rows = sum(t.shape[0] for t in tensors)
    return first.new_empty(0).set_(storage, first.storage_offset(), (rows, *first.shape[1:]))


class _Group:
    """One fused weight (and bias) shared by a group's parts, with a per-input output cache."""

    def __init__(self, linears: list[nn.Linear]):
        self.sizes = [m.out_features for m in linears]
        has_bias = linears[0].bias is not None
        with torch.no_grad():
            self.weight = _joined([m.weight for m in linears])
            self.bias = _joined([m.bias for m in linears]) if has_bias else None
            start = 0
            for m, size in zip(linears, self.sizes):  # the old storages are freed here
                _move(m.weight, self.weight[start:start + size])
                if has_bias:
                    _move(m.bias, self.bias[start:start + size])
                start += size
        self.linear = None  # a replacement for F.linear(x, weight, bias) (model/decode_gemm.py), or None
        self._drop()

    def release(self) -> None:
        """Drop the fused tensors (restore() has given every member its own storage or left it to
        another fusion of the same weights): their memory goes with the last view of them."""
        self.weight = self.bias = self.linear = None
        self._drop()

    def _drop(self) -> None:
        self._x, self._version, self._outputs, self._pending = None, None, None, ()

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """The whole group's output for x (every member's, concatenated)."""
        return F.linear(x, self.weight, self.bias) if self.linear is None else self.linear(x)

    def output(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Member `index`'s projection of x: from the cache if a sibling just computed it for x."""
        if x.is_inference():  # no version counter: a cache hit could not be proven fresh
            start = sum(self.sizes[:index])
            bias = None if self.bias is None else self.bias[start:start + self.sizes[index]]
            return F.linear(x, self.weight[start:start + self.sizes[index]], bias)
        if not (x is self._x and x._version == self._version and index in self._pending):
            outputs = torch.split(self.project(x), self.sizes, dim=-1)
            self._x, self._version, self._outputs = x, x._version, outputs
            self._pending = set(range(len(self.sizes)))
        out = self._outputs[index]
        self._pending.discard(index)
        if not self._pending:  # every member has its output: hold no activations across layers
            self._drop()
        return out


def _itself(x):  # (what an unpickled FusedPart is: the Linear it stood in for)
    return x


class FusedPart(nn.Module):
    """Stands in for one member Linear of a fused group; keeps its parameters under the same names."""

    def __init__(self, group: _Group, index: int, linear: nn.Linear):
        super().__init__()
        self.group, self.index = group, index
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        object.__setattr__(self, "_stock", linear)  # (not a submodule: the parameters are this part's)

    # A copy of the model made while a part stands in for its Linear (a `copy.deepcopy(model)` or
    # `torch.save(model)` from another thread while an engine call or serving loop runs) takes the
    # Linear: a part copied out of its engine would stay in the copy for good, its forward computing
    # through the fused tensor, which no gradient reaches from the member's own weight.
    def __deepcopy__(self, memo):
        return copy.deepcopy(self._stock, memo)

    def __reduce_ex__(self, protocol):
        return (_itself, (self._stock,))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.output(self.index, x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, part={self.index}"


class FusedProjections:
    """The fusions applied to one model; restore() (or leaving a `with` block) undoes them."""

    def __init__(self):
        self._members: list[tuple[nn.Module, str, nn.Linear]] = []
        self._parts: list[FusedPart] = []  # one per member, in the same order
        self.counts = {kind: 0 for kind in GROUPS}

    @property
    def num_groups(self) -> int:
        return sum(self.counts.values())

    def summary(self) -> str:
        """One line for logging, e.g. "fused 2 qkv and 2 gate_up groups"."""
        return "fused " + " and ".join(f"{n} {kind}" for kind, n in self.counts.items()) + " groups"

    def members(self) -> list[nn.Linear]:
        """The original Linears the fused parts stand in for."""
        return [linear for _, _, linear in self._members]

    def groups(self) -> list[_Group]:
        """The fused groups, each once."""
        return list({id(part.group): part.group for part in self._parts}.values())

    def attach(self) -> None:
        """Swap the fused parts in (the engine's forward) where the original Linears still are."""
        for (parent, name, linear), part in zip(self._members, self._parts):
            if getattr(parent, name, None) is linear:
                setattr(parent, name, part)

    def detach(self) -> None:
        """Put the original Linears back; their weights stay views of the fused tensors (no copy).
        Only where a fused part is in place: a module the user has put there since stays."""
        for (parent, name, linear), part in zip(self._members, self._parts):
            if getattr(parent, name, None) is part:
                setattr(parent, name, linear)

    def intact(self) -> bool:
        """Whether every member's weight (and bias) is still the view of its fused tensor."""
        for (_, _, linear), part in zip(self._members, self._parts):
            group, start = part.group, sum(part.group.sizes[:part.index])
            if linear.weight.data_ptr() != group.weight[start].data_ptr() or linear.weight.dtype != group.weight.dtype:
                return False
            if linear.bias is not None and (group.bias is None or linear.bias.data_ptr() != group.bias[start:].data_ptr()):
                return False
        return True

    def restore(self) -> None:
        """Put the original Linears back, each with its own storage again (idempotent). While another
        fusion of the same weights lives (another Engine's), they stay views for it: it restores last."""
        others = [f for f in _LIVE if f is not self and f._members and
                  {id(m) for m in f.members()} & {id(m) for m in self.members()}]
        left = {}  # per group, its members not yet given their own storage
        for part in self._parts:
            left[id(part.group)] = left.get(id(part.group), 0) + 1
        # A weight that a tensor outside the model holds meanwhile (another model's, given it by
        # `load_state_dict(..., assign=True)` between calls) stays a view: a copy would cut the link
        # that stock keeps (decided before any copy changes the counts).
        known = _known_holders(nn.ModuleList(self.members()))
        shared = [_shared_elsewhere([linear], known) for linear in self.members()]
        with torch.no_grad():
            for (parent, name, linear), part, keep in zip(self._members, self._parts, shared):
                if getattr(parent, name, None) is part:
                    setattr(parent, name, linear)
                if not others and not keep:
                    _move(linear.weight, linear.weight.data.clone(memory_format=torch.contiguous_format))
                    if linear.bias is not None:
                        _move(linear.bias, linear.bias.data.clone(memory_format=torch.contiguous_format))
                left[id(part.group)] -= 1
                if not left[id(part.group)]:  # its fused tensor goes now: a copy of one group at a time
                    part.group.release()
        self._members.clear()
        self._parts.clear()

    def __enter__(self) -> "FusedProjections":
        return self

    def __exit__(self, *exc) -> None:
        self.restore()


def hook_module(hook) -> str:
    """The module a hook's function was defined in (seen through a functools.partial)."""
    return getattr(getattr(hook, "func", hook), "__module__", "") or ""


def _users(hooks: dict) -> tuple:
    """The keys of the hooks in `hooks` that are not transformers' own (the output-capturing hooks
    it installs for good once hidden states or attentions are asked for, gradient checkpointing's
    input hook: no-ops outside those features) nor this package's (put there for a call, as
    model/callback_forwards.py's, which change no value)."""
    return tuple(key for key, hook in hooks.items() if not hook_module(hook).startswith(_NOT_USERS))


_NOT_USERS = ("transformers.", "hf_async_cb.")


def user_hooks(m: nn.Module) -> tuple:
    """m's own forward hooks and pre-hooks, transformers' own left out: (hook keys, pre-hook keys)."""
    return _users(m._forward_hooks), _users(m._forward_pre_hooks)


def global_hooks() -> tuple:
    """The keys of the forward hooks and pre-hooks registered for every module."""
    return tuple(_module._global_forward_hooks), tuple(_module._global_forward_pre_hooks)


def has_hooks(m: nn.Module) -> bool:
    """Whether calling m runs forward hooks or pre-hooks of the user's (its own or global ones): a
    fusion that bypasses the module's call would silently drop them."""
    return any(user_hooks(m)) or any(global_hooks())


def _storage_holders(t: torch.Tensor) -> int:
    """How many tensors hold t's storage (the storage object this call makes left out); 1 where the
    count cannot be read (then nothing is taken for an alias)."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    if count is None:
        return 1
    storage = t.untyped_storage()
    return count(storage._cdata) - 1


def _known_holders(model: nn.Module) -> dict[int, int]:
    """Per storage (its data pointer), the tensors that the model itself (its parameters and buffers)
    and the live fusions (their fused tensors) hold on it."""
    known: dict[int, int] = {}
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}
    for fused in list(_LIVE):
        for group in fused.groups():
            for t in (group.weight, group.bias):
                if t is not None:
                    tensors[id(t)] = t
    for t in tensors.values():
        if t.device.type != "meta" and is_plain_floating(t):  # (tensor subclasses have no storage of their own)
            ptr = t.untyped_storage().data_ptr()
            known[ptr] = known.get(ptr, 0) + 1
    return known


def _shared_elsewhere(members: list, known: dict[int, int]) -> bool:
    """Whether a member's weight or bias shares its storage with a tensor outside the model (another
    model's weight, as `load_state_dict(..., assign=True)` or a tied reference model leaves it; a view
    the user keeps). Fusing gives the weight new storage, which would silently cut that link: the
    other tensor would stop seeing the model's training steps, and the model its writes, where stock
    keeps them one tensor. Such a group is left unfused (its tokens are the same)."""
    for m in members:
        for t in (m.weight, m.bias):
            if t is not None and _storage_holders(t) > known.get(t.untyped_storage().data_ptr(), 1):
                return True
    return False


def _fusable(members: list) -> bool:
    if not all(type(m) is nn.Linear for m in members) or len({id(m) for m in members}) != len(members):
        return False  # quantized module classes (bitsandbytes, quanto, HQQ, ...) run their own forward
    if not all(is_plain_floating(m.weight) and (m.bias is None or is_plain_floating(m.bias)) for m in members):
        return False  # a tensor subclass (torchao) or float8 / integer data: only its own forward reads it
    if any(has_hooks(m) or "forward" in m.__dict__ for m in members):  # a fused part never calls the member
        return False
    first = members[0]
    return all(m.in_features == first.in_features and m.weight.dtype == first.weight.dtype
               and m.weight.device == first.weight.device
               and (m.bias is None) == (first.bias is None) for m in members)


def fuse_projections(model: nn.Module) -> FusedProjections:
    """Fuse every q/k/v and gate/up group of plain nn.Linears in `model`, in place.

    Groups whose members differ in type, in_features, dtype, device or bias presence are left
    alone, as are groups with a member whose call runs hooks or a forward of its own, groups with
    a quantized member (a module class other than nn.Linear, or a weight that is not a plain
    floating tensor: model/weight_kinds.py), and models whose projections are already fused.
    Returns the handle that restores.
    """
    known = _known_holders(model)  # (before this fusion's own tensors exist)
    fused = FusedProjections()
    _LIVE.add(fused)
    shared = 0
    for _, parent in list(model.named_modules()):
        for kind, names in GROUPS.items():
            members = [getattr(parent, name, None) for name in names]
            if not _fusable(members):
                continue
            if _shared_elsewhere(members, known):
                shared += 1
                continue
            group = _Group(members)
            for index, (name, linear) in enumerate(zip(names, members)):
                part = FusedPart(group, index, linear)
                fused._members.append((parent, name, linear))
                fused._parts.append(part)
                setattr(parent, name, part)
            fused.counts[kind] += 1
    if shared:  # (the same tokens, unfused: a user who wonders why those layers run slower can see why)
        logger.info("hf_async_cb: %d projection groups left unfused: their weights share storage with tensors outside "
                    "the model (another model's weights, a view kept)", shared)
    return fused
