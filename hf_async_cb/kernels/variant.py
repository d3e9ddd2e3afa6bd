"""A compiled variant of a Triton kernel, named without running it: the kernel, its arguments as a
launch would pass them (tensors by dtype, scalars by value), its constexprs and launch options.

Why: a first call should compile every variant the model can need, at once and in parallel
(kernels/precompile.py), and the census should time each one (benchmarks/compile_census_cpu.py).
Both need the variants before any step runs, so each kernel module lists its own (`variants(...)`
beside its launch), and model_variants.py puts a model's together.

`Variant.warmup()` goes through the kernel's own JIT (`JITFunction.warmup`), so the variant lands
in the JIT's in-process cache, and in Triton's disk cache, under the very key a launch with the same
arguments looks up: no copy of Triton's specialisation rules to drift from it. Pointers are taken
as 16-byte aligned (what `MockTensor` assumes): launches pass aligned tensors, or pointers that are
`do_not_specialize_on_alignment`.

`TargetDriver` lets the JIT compile for a GPU that is not there (the census on a CPU machine, the
compile workers, which must not touch CUDA) and name a launch's key on the CPU (`jit_key`, where
the kernels run in Triton's interpreter and no JIT cache exists).
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch


@dataclass(frozen=True)
class Variant:
    kernel: Any  # a triton JITFunction (an InterpretedFunction under TRITON_INTERPRET)
    args: tuple  # the runtime arguments, in order: torch dtypes stand for tensors
    constexprs: dict = field(default_factory=dict)
    options: dict = field(default_factory=dict)  # num_warps, num_stages, enable_fp_fusion

    @property
    def name(self) -> str:
        """module.kernel, as compiled_keys() names it (e.g. "draw_sampled._resolve_kernel")."""
        fn = getattr(self.kernel, "fn", self.kernel)
        return f"{fn.__module__.rsplit('.', 1)[-1]}.{fn.__name__}"

    def describe(self) -> str:
        """The values that make this variant one of its own: constexprs and launch options."""
        items = {**self.constexprs, **self.options}
        return ", ".join(f"{k}={v}" for k, v in items.items())

    def identity(self) -> tuple:
        """What tells two listed variants apart (the same kernel, arguments, constexprs and options
        are one variant), without asking Triton for its key."""
        return (id(self.kernel), repr(self.args), repr(sorted(self.constexprs.items())),
                repr(sorted(self.options.items())))

    def warmup(self):
        """Compile (or load from Triton's disk cache) into the kernel's JIT cache; launch nothing."""
        return self.kernel.warmup(*self.args, grid=(1,), **self.constexprs, **self.options)

    def pickled(self) -> tuple:
        """(module, kernel name, args, constexprs, options): what a compile worker rebuilds it from."""
        fn = getattr(self.kernel, "fn", self.kernel)
        return fn.__module__, fn.__name__, self.args, self.constexprs, self.options


def from_pickled(module: str, name: str, args: tuple, constexprs: dict, options: dict) -> Variant:
    import importlib

    return Variant(getattr(importlib.import_module(module), name), args, constexprs, options)


class TargetDriver:
    """The part of a Triton driver the JIT asks before it compiles: a device, a stream and the
    target. Set as the active driver, it lets the JIT compile for `target` with no GPU (nor CUDA
    call) in the process."""

    def __init__(self, target, device: int = 0) -> None:
        self.target = target
        self.device = device

    def get_current_device(self) -> int:
        return self.device

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_current_target(self):
        return self.target

    def get_active_torch_device(self):
        return torch.device("cpu")


_DRIVER_LOCK = threading.Lock()


@contextlib.contextmanager
def compiling_for(target) -> Iterator[None]:
    """Triton's active driver is a TargetDriver for `target` inside the block (one block at a time)."""
    from triton.runtime.driver import driver

    with _DRIVER_LOCK:
        saved = driver._active
        driver.set_active(TargetDriver(target))
        try:
            yield
        finally:
            driver._active = saved


def sm90():
    """The H200's target (what the GPU machine compiles for)."""
    from triton.backends.compiler import GPUTarget

    return GPUTarget("cuda", 90, 32)


_TWINS: dict[int, Any] = {}


def _twin(kernel):
    """A JITFunction of `kernel`'s function with its decorator's arguments, used only to name keys:
    its own cache stays empty, so Triton's cache hook sees every launch it is asked about (the
    kernel itself may hold the variant already; under the interpreter it is no JITFunction)."""
    from triton.runtime import jit

    twin = _TWINS.get(id(kernel))
    if twin is None:
        if isinstance(kernel, jit.JITFunction):
            decorated = dict(do_not_specialize=kernel.do_not_specialize, debug=kernel.debug, noinline=kernel.noinline,
                             do_not_specialize_on_alignment=kernel.do_not_specialize_on_alignment)
        else:
            decorated = dict(getattr(kernel, "kwargs", {}))
        registry = getattr(jit, "_triton_jit_function_registry", {})
        name = f"{kernel.fn.__module__}:{kernel.fn.__qualname__}"
        registered = registry.get(name)
        twin = _TWINS[id(kernel)] = jit.JITFunction(kernel.fn, **decorated)
        if registered is not None:  # the kernel, not its twin, stays the one Triton finds by name
            registry[name] = registered
    return twin


def jit_key(kernel, args: tuple, kwargs: dict, target=None) -> str:
    """The JIT cache key (compiled_keys()'s strings) of launching `kernel` with these arguments
    (tensors, or dtypes standing for aligned tensors) and keyword arguments (constexprs and options)
    on `target` (sm_90 unless given), found without compiling: Triton's own binder names it and its
    cache hook, which can skip the compile, reads it. Works under the interpreter too."""
    from triton import knobs

    twin = _twin(kernel)
    found: list[str] = []

    def hook(*, key, **_):
        found.append(key)
        return True  # name it, compile nothing

    with compiling_for(target or sm90()):
        saved = knobs.runtime.jit_cache_hook
        knobs.runtime.jit_cache_hook = hook
        try:
            twin.warmup(*args, grid=(1,), **kwargs)
        finally:
            knobs.runtime.jit_cache_hook = saved
    return found[0]


def variant_key(variant: Variant, target=None) -> str:
    return jit_key(variant.kernel, variant.args, {**variant.constexprs, **variant.options}, target)


def settle_cache_keys(kernels) -> None:
    """Compute the Triton cache key of each of `kernels` and of every JIT function it calls, callees
    first.

    Why: up to Triton 3.6 a function's key counts the global constants of the functions it calls only
    if their keys were computed before its own, so a kernel with nested helpers (the sampler's resolve
    kernel) gets a key that depends on which kernel a process keyed first. A forked compile worker and
    the serving process then filed one variant under two keys, and the serving process compiled it
    again (2-3 s of a first call on an H200). Callees first, every process computes the complete key,
    and a worker forked afterwards inherits it. Newer Triton computes it so already: nothing changes."""
    try:
        from triton.runtime import jit
    except ImportError:
        return
    callable_type = getattr(jit, "JITCallable", jit.JITFunction)
    done: set[int] = set()

    def settle(fn) -> None:
        if not isinstance(fn, callable_type) or id(fn) in done:
            return
        done.add(id(fn))
        code, scope = fn.fn.__code__, fn.fn.__globals__
        for name in code.co_names:  # the globals it reads, and attributes of the modules among them
            value = scope.get(name)
            if isinstance(value, type(jit)):
                for attribute in code.co_names:
                    settle(getattr(value, attribute, None))
            settle(value)
        fn.cache_key  # noqa: B018 (computed and kept by the function)

    for kernel in kernels:
        settle(kernel)  # (an interpreted kernel is no JIT function: nothing to key)

