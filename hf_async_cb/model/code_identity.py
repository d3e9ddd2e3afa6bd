"""The code a model's forward runs, by identity: what a patch of a class or of a modeling file changes.

`LlamaMLP.forward = f`, or a modeling file's function swapped (`modeling_llama.apply_rotary_pos_emb = f`,
as liger-kernel's `apply_liger_kernel_to_llama()` does), changes what every model of those classes
computes without touching any model: no weight, setting, module or instance attribute moves. What the
package keeps between calls would then be stale: the prepared model (its fusions check the code they
replace once), the prefix cache's K/V, the CUDA graphs (they replay no Python) and the parity verdict.
code_identity() lists, for each class of the model's modules (and their bases outside torch) and each
file that defines one, the functions it holds, as objects: a tuple compared with `==` compares them by
identity. The package's own wrappers (the fused rotary it sets in a modeling file for a prepared model)
read as the functions they wrap, so that its own patches are no change.
"""

from __future__ import annotations

import sys
import types

from torch import nn

_CODE = (types.FunctionType, staticmethod, classmethod, property)


def _function(value):
    """The function object a class or file attribute stands for (None: not code)."""
    if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    elif isinstance(value, property):
        return value.fget, value.fset
    elif not isinstance(value, types.FunctionType):
        return None
    if getattr(value, "__module__", "").startswith("hf_async_cb."):  # the package's own wrapper
        return getattr(value, "__wrapped__", None)
    return value


def owners(modules: list[nn.Module]) -> list:
    """The classes whose functions a forward of these modules runs and the files that define them,
    each once, in a fixed order: each module's class and its bases defined in the same files (a
    family's own; transformers' shared mixins, hundreds of functions that compute no K/V, and
    torch's own are left out)."""
    leaves = list(dict.fromkeys(type(m) for m in modules))
    files = {cls.__module__ for cls in leaves if not cls.__module__.startswith("torch.")}
    classes = dict.fromkeys(base for cls in leaves for base in cls.__mro__ if base.__module__ in files)
    return [*classes, *(sys.modules[name] for name in sorted(files) if name in sys.modules)]


def code_identity(modules: list[nn.Module], found: list | None = None) -> tuple:
    """The functions the owners of `modules` hold now (see the module docstring). `found`: owners(modules),
    where the caller keeps it (a serving loop, whose modules stay as they are)."""
    return tuple(tuple(f for v in vars(owner).values() if isinstance(v, _CODE) and (f := _function(v)) is not None)
                 for owner in (owners(modules) if found is None else found))
