"""Compiled forwards, set aside while the engine runs the model.

Users compile a model for stock generate in three ways: `model.compile()` (nn.Module keeps the
compiled call in `_compiled_call_impl`), `model.forward = torch.compile(model.forward)` (a forward
on the instance, wrapped by dynamo) and a submodule replaced by `torch.compile(submodule)` (an
OptimizedModule holding the original as `_orig_mod`). Dynamo would then trace the engine's packed
steps, whose shapes change at every step: it recompiles until its limit and falls back to eager,
seconds of tracing per call for nothing, since the engine's own path (its CUDA graphs and kernels)
is the fast one. So while the engine runs the model (its probes and its steps), each wrapper is
set aside and the eager forward it wraps runs; they are put back afterwards, so that stock
generate and plain forwards run compiled as before. Callers hold the model's guard meanwhile.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import weakref
from typing import Iterator

from torch import nn

from hf_async_cb.interrupts import deferred_interrupts

logger = logging.getLogger(__name__)

_LOGGED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()  # models whose wrappers were reported


def _dynamo_wrapped(fn) -> bool:
    return callable(fn) and hasattr(fn, "_torchdynamo_orig_callable")


def unwrapped(fn):
    """The callable under dynamo's wrappers (torch.compile of a compiled function wraps twice)."""
    while _dynamo_wrapped(fn):
        fn = fn._torchdynamo_orig_callable
    return fn


def _is_optimized_module(m: nn.Module) -> bool:
    dynamo = sys.modules.get("torch._dynamo.eval_frame")
    return dynamo is not None and isinstance(m, dynamo.OptimizedModule)


def compiled_wrappers(model: nn.Module, modules: list[tuple[str, nn.Module]] | None = None) -> list[tuple[str, str]]:
    """(module name, how it is compiled) for every compiled wrapper in `model`, in module order.
    `modules`: `list(model.named_modules())` where the caller has it."""
    if "torch._dynamo" not in sys.modules:  # nothing can have been compiled in this process
        return []
    found = []
    dynamo = sys.modules.get("torch._dynamo.eval_frame")
    optimized = dynamo.OptimizedModule if dynamo is not None else ()
    for name, m in (model.named_modules() if modules is None else modules):
        if isinstance(m, optimized):  # counted as its parent's child below, set aside as a whole
            continue
        state = vars(m)
        if state.get("_compiled_call_impl") is not None:
            found.append((name, "module.compile()"))
        if _dynamo_wrapped(state.get("forward")):
            found.append((name, "forward = torch.compile(forward)"))
        for child_name, child in m._modules.items():
            if isinstance(child, optimized):
                found.append((f"{name}.{child_name}" if name else child_name, "torch.compile(module)"))
    return found


@contextlib.contextmanager
def uncompiled(model: nn.Module) -> Iterator[None]:
    """`model` with every compiled wrapper set aside (see the module docstring), put back on exit."""
    if "torch._dynamo" not in sys.modules:
        yield
        return
    undo: list = []  # (restore function), applied in reverse
    try:
        for m in list(model.modules()):
            if _is_optimized_module(m):  # its parent gets its original module instead, below
                continue
            state = vars(m)
            compiled_call = state.get("_compiled_call_impl")
            if compiled_call is not None:
                m._compiled_call_impl = None
                undo.append(lambda m=m, c=compiled_call: setattr(m, "_compiled_call_impl", c))
            forward = state.get("forward")
            if _dynamo_wrapped(forward):
                state["forward"] = unwrapped(forward)
                undo.append(lambda state=state, f=forward: state.__setitem__("forward", f))
            for child_name, child in list(m.named_children()):
                if _is_optimized_module(child):
                    setattr(m, child_name, child._orig_mod)
                    undo.append(lambda m=m, n=child_name, c=child: setattr(m, n, c))
        if undo and model not in _LOGGED:
            _LOGGED.add(model)
            logger.info("hf_async_cb: %s has a compiled forward (torch.compile); the engine runs its own uncompiled "
                        "path, with %d compiled wrapper%s set aside during its calls (stock generate still runs "
                        "compiled).", type(model).__name__, len(undo), "s" * (len(undo) > 1))
        yield
    finally:
        with deferred_interrupts():  # half put back, stock generate would run partly uncompiled
            for restore in reversed(undo):
                restore()

