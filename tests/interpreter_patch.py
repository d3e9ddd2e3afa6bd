"""Triton's interpreter (the CPU runs every kernel of the tests in it) re-patches triton.language on
every call of a nested @triton.jit helper: in Triton 3.9 `InterpretedFunction.__call__` runs
`_patch_lang`, an `inspect.getmembers` over the language modules (~0.2 ms), even though the kernel's
launch (`GridExecutor.__call__`) patched the same modules for its whole grid already and restores
them only at its end. A kernel that calls helpers inside its loops spent most of its time there
(286,863 patches, 62 s of the 100 s of one sampling test).

`skip_nested_patches()` makes such a nested patch a no-op while a launch holds the patch of every
language module the helper sees; anything else patches as before. The result of each kernel is
unchanged: the helper runs on the same patched modules either way."""

from __future__ import annotations

import functools
import inspect

_held: list[frozenset] = []  # the language modules the launch in progress patched (kernels launch no kernels)


class _Nothing:
    def restore(self) -> None:
        pass


def skip_nested_patches() -> bool:
    """Install the shortcut; whether this Triton's interpreter has the function it wraps."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    original = getattr(interpreter, "_patch_lang", None)
    if original is None or getattr(original, "_skips_nested", False):
        return original is not None

    @functools.lru_cache(maxsize=None)  # (a jit function's module imports its language modules once)
    def languages(fn) -> frozenset:
        return frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))

    def patch_lang(fn):
        langs = languages(fn)
        if _held and langs <= _held[-1]:
            return _Nothing()
        scope = original(fn)
        if _held:  # a nested helper seeing other modules (triton.language's own helpers see its core):
            _held[-1] |= langs  # patched as before and, as before, never restored: patched for the rest of the launch
            return scope
        restore = scope.restore  # a launch's patch, restored at its end
        _held.append(langs)

        def restored() -> None:
            _held.pop()
            restore()

        scope.restore = restored
        return scope

    patch_lang._skips_nested = True
    interpreter._patch_lang = patch_lang
    return True


def cache_np_dtypes() -> bool:
    """Triton's interpreter maps a Triton dtype to numpy's in `_get_np_dtype`, building a dict of every
    type at each call (~11 us; 374,540 calls and 4.2 s of one attention test's 94 s): the same mapping,
    kept per dtype. Whether this Triton's interpreter has the function it wraps."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    original = getattr(interpreter, "_get_np_dtype", None)
    if original is None or getattr(original, "_cached", False):
        return original is not None
    known: dict = {}
    block, pointer = tl.block_type, tl.pointer_type

    def get_np_dtype(tt_dtype):
        # A block's numpy dtype is its element's, and every pointer's the same (blocks and pointers are
        # not hashable; the other element types are).
        key = tt_dtype.element_ty if isinstance(tt_dtype, block) else tt_dtype
        key = pointer if isinstance(key, pointer) else key
        try:
            return known[key]
        except KeyError:
            known[key] = found = original(tt_dtype)
            return found
        except TypeError:  # (an unhashable type: as before)
            return original(tt_dtype)

    get_np_dtype._cached = True
    interpreter._get_np_dtype = get_np_dtype
    return True
