"""Parity verdicts that passed, kept on disk, so that a later process on the machine skips the check.

Why: the parity check (engine/parity.py) runs once per model family in a process, and a fresh
process's first call paid it again: on an H200, 0.36 s of a 1B model's 2.27 s first call with
Triton's disk cache warm (most of it the stock forward's first run); 0.05 s with the pass on disk. A pass is kept in a file named for
everything the check's outcome depends on, so it is as trustworthy as the process's own cache:

- the in-process key (model class, config, dtype, device type, numerics key, the engine's path);
- the device's name, and the versions of Python, torch, transformers and Triton;
- this package's own source (every .py file under it: any change in the engine checks afresh);
- the model's code: for each module class in the model, its methods' code, and the functions and
  classes its defining module holds (a patched forward or a replaced helper, as kernel libraries
  patch transformers' modeling modules, gives another key).

Only passes on whole probe prompts of models that run none of the user's code (hooks, patched
instance forwards) are kept; a refusal is always measured afresh. They are kept in the package's
cache folder (hf_async_cb/cache_folder.py: $HF_ASYNC_CB_CACHE, else ~/.cache/hf_async_cb), under
parity-passed/; HF_ASYNC_CB_KEEP_PARITY=0 turns the store off.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import sys
import types

import torch

logger = logging.getLogger(__name__)
KEEP_VARIABLE = "HF_ASYNC_CB_KEEP_PARITY"
_FOLDER = "parity-passed"


def folder() -> str | None:
    """Where passes are kept, or None when the store is off."""
    from hf_async_cb.cache_folder import cache_folder

    if os.environ.get(KEEP_VARIABLE, "1").strip().lower() in ("0", "off", "false", "no", ""):
        return None
    return str(cache_folder() / _FOLDER)


def path_for(key: tuple, model: torch.nn.Module, device: torch.device) -> str | None:
    """The file a pass under the parity check's `key` is kept in (see the module docstring), or None
    where none is kept: the store is off, or the key does not read the same in another process."""
    where = folder()
    if where is None:
        return None
    try:
        described = repr((_environment(device), _package_source(), _model_code(model), _plain_key(key)))
    except _NotPlain:
        return None
    except Exception as error:  # noqa: BLE001 (something unreadable: the check runs, as without the store)
        logger.debug("hf_async_cb: no name for a parity pass on disk (%s)", error)
        return None
    return os.path.join(where, hashlib.sha256(described.encode()).hexdigest())


def passed_before(path: str | None) -> bool:
    """Whether an earlier process kept a pass in `path` (path_for's)."""
    return path is not None and os.path.exists(path)


def keep_pass(path: str | None, model: torch.nn.Module) -> None:
    """Keep a pass in `path` for later processes (quietly not, where the folder cannot be written)."""
    if path is None:
        return
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(f"{type(model).__module__}.{type(model).__qualname__}\n")
    except OSError as error:
        logger.debug("hf_async_cb: parity pass not kept on disk (%s)", error)


class _NotPlain(Exception):
    """A key part that would not read the same in another process: nothing is kept for it."""


def _plain_key(key: tuple) -> tuple:
    """The in-process key with its classes named (the rest is plain data already: strings, numbers, dtypes)."""
    def plain(value):
        if value is None or isinstance(value, (bool, int, float, str, bytes)):
            return value
        if isinstance(value, type):
            return ("class", value.__module__, value.__qualname__)
        if isinstance(value, (torch.dtype, torch.device)):
            return str(value)
        if isinstance(value, (tuple, list)):
            return tuple(plain(v) for v in value)
        raise _NotPlain(type(value).__name__)  # (an object() standing for "no key": never shared)

    return plain(key)


def _environment(device: torch.device) -> tuple:
    import transformers

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.machine()
    return (sys.version_info[:3], torch.__version__, transformers.__version__, triton_version, device.type, name)


@functools.lru_cache(maxsize=1)
def _package_source() -> str:
    """A hash of this package's .py files (read once per process)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    digest = hashlib.sha256()
    for folder_, dirs, files in sorted(os.walk(root)):
        dirs.sort()
        for name in sorted(files):
            if name.endswith(".py"):
                with open(os.path.join(folder_, name), "rb") as f:
                    digest.update(name.encode() + f.read())
    return digest.hexdigest()


def _model_code(model: torch.nn.Module) -> str:
    """A hash of the code the model runs: its module classes' methods and the functions and classes of
    the modules that define them (as they are now, patches included)."""
    digest = hashlib.sha256()
    classes = {type(m) for m in model.modules()}
    for cls in sorted(classes, key=lambda c: (c.__module__, c.__qualname__)):
        digest.update(_code_of(cls).encode())
    modules = sorted({cls.__module__ for cls in classes})
    for name in modules:
        module = sys.modules.get(name)
        if module is None:
            continue
        for attr, value in sorted(vars(module).items()):
            if isinstance(value, (types.FunctionType, type)):
                digest.update(f"{name}.{attr}={_code_of(value)}".encode())
    return digest.hexdigest()


def _feed(digest, value) -> None:
    """A code object's bytecode, names and constants, nested code included, into `digest`, the same in
    every process (marshal's bytes depend on reference counts, a frozenset's order on the hash seed)."""
    if isinstance(value, types.CodeType):
        digest.update(b"<code>" + value.co_code)
        digest.update(repr((value.co_names, value.co_varnames, value.co_freevars, value.co_cellvars)).encode())
        for constant in value.co_consts:
            _feed(digest, constant)
        digest.update(b"</code>")
    elif isinstance(value, (frozenset, set)):
        digest.update(repr(sorted(map(repr, value))).encode())
    elif isinstance(value, tuple):
        digest.update(b"(")
        for item in value:
            _feed(digest, item)
        digest.update(b")")
    else:
        digest.update(repr(value).encode())


@functools.lru_cache(maxsize=None)
def _code_digest(code: types.CodeType) -> str:
    """A code object's digest (code objects are immutable: each is hashed once, however many classes
    inherit the function; a patched function brings another code object)."""
    digest = hashlib.sha256()
    _feed(digest, code)
    return digest.hexdigest()[:16]


def _code_of(value) -> str:
    """A function's code (its bytecode, constants and names, by hash) and where it comes from; for a
    class, the same for each function in its own namespace and its bases' (torch's own left out)."""
    if isinstance(value, types.FunctionType):
        return f"{value.__module__}.{value.__qualname__}:{_code_digest(value.__code__)}"
    if isinstance(value, type):
        parts = []
        for base in value.__mro__:
            if base is object or base.__module__.startswith("torch."):
                continue
            for attr, member in sorted(vars(base).items()):
                function = getattr(member, "__func__", member)  # (static and class methods)
                if isinstance(function, types.FunctionType):
                    parts.append(f"{attr}={_code_of(function)}")
        return f"{value.__module__}.{value.__qualname__}[{';'.join(parts)}]"
    return repr(value)
