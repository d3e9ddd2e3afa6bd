"""Fuse sibling projections (q/k/v, gate/up) of a loaded model into one GEMM each, reversibly.

Decode steps multiply a few dozen rows by each weight matrix. Such skinny GEMMs run far below
memory bandwidth when q, k and v (or an MLP's gate and up) are separate nn.Linear calls, and near
it when they are one GEMM over the concatenated weights. fuse_projections() concatenates each
group's weights once and turns the original parameters into views of the fused tensor, so no
second copy of the weights exists. Each member attribute is replaced by a FusedPart; the first
part called computes the whole group's output, and its siblings, called with the same input
tensor, take their slices from a short-lived cache. Model forward code is left untouched.

Fusion is for inference: the fused GEMM does not propagate gradients to the original parameters,
and the model should not be moved (`.to()`) while fused. restore() puts everything back.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

GROUPS = {"qkv": ("q_proj", "k_proj", "v_proj"), "gate_up": ("gate_proj", "up_proj")}


class _Group:
    """One fused weight (and bias) shared by a group's parts, with a per-input output cache."""

    def __init__(self, linears: list[nn.Linear]):
        self.sizes = [m.out_features for m in linears]
        has_bias = linears[0].bias is not None
        with torch.no_grad():
            self.weight = torch.cat([m.weight for m in linears])
            self.bias = torch.cat([m.bias for m in linears]) if has_bias else None
            start = 0
            for m, size in zip(linears, self.sizes):  # the old storages are freed here
                m.weight.data = self.weight[start:start + size]
                if has_bias:
                    m.bias.data = self.bias[start:start + size]
                start += size
        self._drop()

    def _drop(self) -> None:
        self._x, self._version, self._outputs, self._pending = None, None, None, ()

    def output(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Member `index`'s projection of x: from the cache if a sibling just computed it for x."""
        if x.is_inference():  # no version counter: a cache hit could not be proven fresh
            start = sum(self.sizes[:index])
            bias = None if self.bias is None else self.bias[start:start + self.sizes[index]]
            return F.linear(x, self.weight[start:start + self.sizes[index]], bias)
        if not (x is self._x and x._version == self._version and index in self._pending):
            outputs = torch.split(F.linear(x, self.weight, self.bias), self.sizes, dim=-1)
            self._x, self._version, self._outputs = x, x._version, outputs
            self._pending = set(range(len(self.sizes)))
        out = self._outputs[index]
        self._pending.discard(index)
        if not self._pending:  # every member has its output: hold no activations across layers
            self._drop()
        return out


class FusedPart(nn.Module):
    """Stands in for one member Linear of a fused group; keeps its parameters under the same names."""

    def __init__(self, group: _Group, index: int, linear: nn.Linear):
        super().__init__()
        self.group, self.index = group, index
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.output(self.index, x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, part={self.index}"


class FusedProjections:
    """The fusions applied to one model; restore() (or leaving a `with` block) undoes them."""

    def __init__(self):
        self._members: list[tuple[nn.Module, str, nn.Linear]] = []
        self.counts = {kind: 0 for kind in GROUPS}

    @property
    def num_groups(self) -> int:
        return sum(self.counts.values())

    def summary(self) -> str:
        """One line for logging, e.g. "fused 2 qkv and 2 gate_up groups"."""
        return "fused " + " and ".join(f"{n} {kind}" for kind, n in self.counts.items()) + " groups"

    def restore(self) -> None:
        """Put the original Linears back, each with its own storage again (idempotent)."""
        with torch.no_grad():
            for parent, name, linear in self._members:
                setattr(parent, name, linear)
                linear.weight.data = linear.weight.data.clone(memory_format=torch.contiguous_format)
                if linear.bias is not None:
                    linear.bias.data = linear.bias.data.clone(memory_format=torch.contiguous_format)
        self._members.clear()

    def __enter__(self) -> "FusedProjections":
        return self

    def __exit__(self, *exc) -> None:
        self.restore()


def _fusable(members: list) -> bool:
    if not all(type(m) is nn.Linear for m in members) or len({id(m) for m in members}) != len(members):
        return False
    first = members[0]
    return all(m.in_features == first.in_features and m.weight.dtype == first.weight.dtype
               and m.weight.device == first.weight.device
               and (m.bias is None) == (first.bias is None) for m in members)


def fuse_projections(model: nn.Module) -> FusedProjections:
    """Fuse every q/k/v and gate/up group of plain nn.Linears in `model`, in place.

    Groups whose members differ in type, in_features, dtype, device or bias presence are left
    alone, as are models whose projections are already fused. Returns the handle that restores.
    """
    fused = FusedProjections()
    for _, parent in list(model.named_modules()):
        for kind, names in GROUPS.items():
            members = [getattr(parent, name, None) for name in names]
            if not _fusable(members):
                continue
            group = _Group(members)
            for index, (name, linear) in enumerate(zip(names, members)):
                fused._members.append((parent, name, linear))
                setattr(parent, name, FusedPart(group, index, linear))
            fused.counts[kind] += 1
    return fused
