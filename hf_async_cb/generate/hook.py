"""The hook: install() wraps GenerationMixin.generate so that `batching=` reaches the engine.

The wrapper takes `batching` and `batching_config` out of the call (stock generate would reject
them as unused model kwargs), reads `batching` from the call, else from the GenerationConfig passed
in, else from model.generation_config, and hands off to stock generate when it is None or "off".
Otherwise generate/call.py runs the call on the engine.

uninstall() puts back stock generate behind a guard that only watches: a call that still asks for
batching (a `batching` set on a GenerationConfig would otherwise be ignored without a word) gets a
warning, once, and stock's result.
"""

from __future__ import annotations

import functools
import inspect
import logging
from dataclasses import fields
from typing import Any

from hf_async_cb.config import OFF_MODES, BatchingConfig, resolve_mode
from hf_async_cb.model.model_guard import model_guard

logger = logging.getLogger(__name__)

_original_generate = None  # stock generate while the hook is installed, else None
_BATCHING_KEYS = ("batching", "batching_config")


def install() -> None:
    """Make `batching=` available on every transformers generative model (idempotent)."""
    global _original_generate
    from transformers import GenerationMixin

    from hf_async_cb.model import attention

    attention.register()
    if _original_generate is not None:
        return
    current = GenerationMixin.generate
    stock = getattr(current, "__hf_async_cb_stock__", current)  # the guard left by uninstall() steps aside
    _original_generate = stock
    GenerationMixin.generate = _make_generate(stock)


def uninstall() -> None:
    """Restore stock generate, behind a guard that warns (once) when a call still asks for batching."""
    global _original_generate
    from transformers import GenerationMixin

    if _original_generate is not None:
        GenerationMixin.generate = _make_guard(_original_generate)
        _original_generate = None


def is_installed() -> bool:
    return _original_generate is not None


def _make_generate(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def generate(self, *args, **kwargs):
        has_batching = "batching" in kwargs
        batching = kwargs.pop("batching", None)
        batching_config = kwargs.pop("batching_config", None)
        bound = signature.bind(self, *args, **kwargs)
        generation_config = bound.arguments.get("generation_config")
        config = resolve_batching_config(batching_config, generation_config, self)
        mode = _resolve_call_mode(self, has_batching, batching, generation_config, config)
        if mode is None:  # stock generate, after any engine call running on this model
            with model_guard(self).held("generate", kind="stock"):
                return original(self, *args, **kwargs)
        from hf_async_cb.generate.call import engine_generate

        return engine_generate(self, mode, config, generation_config, bound.arguments)

    generate.__hf_async_cb__ = True
    return generate


def resolve_batching_config(batching_config: Any, generation_config, model) -> BatchingConfig | None:
    """The call's BatchingConfig: the `batching_config=` argument, else the one on the GenerationConfig
    passed in, else on model.generation_config. A dict is read as BatchingConfig(**dict); anything
    else is a ValueError, so that a config is never dropped for a silent stock run."""
    sources = [("batching_config", batching_config)]
    for where, gc in (("generation_config", generation_config), ("model.generation_config",
                                                                  getattr(model, "generation_config", None))):
        if gc is not None:
            sources.append((f"{where}.batching_config", getattr(gc, "batching_config", None)))
    for where, value in sources:
        if value is not None:
            return _as_batching_config(where, value)
    return None


def _as_batching_config(where: str, value: Any) -> BatchingConfig:
    if isinstance(value, BatchingConfig):
        return value
    if isinstance(value, dict):
        known = {f.name for f in fields(BatchingConfig)}
        unknown = sorted(map(str, set(value) - known))
        if unknown:
            raise ValueError(f"{where} has unknown keys {unknown}; BatchingConfig's fields are {sorted(known)}.")
        return BatchingConfig(**value)
    raise ValueError(f"{where} must be a hf_async_cb.BatchingConfig, a dict of its fields or None, "
                     f"got {type(value).__name__}.")


def _resolve_call_mode(model, has_batching: bool, batching, generation_config,
                       config: BatchingConfig | None) -> str | None:
    if has_batching:
        return resolve_mode(batching)
    for source in (generation_config, getattr(model, "generation_config", None)):
        if source is not None and getattr(source, "batching", None) is not None:
            return resolve_mode(source.batching)
    return config.mode if config is not None else None


def _make_guard(original):
    """Stock generate, warning once when a call asks for batching while the hook is uninstalled."""
    signature = inspect.signature(original)
    warned = False

    @functools.wraps(original)
    def generate(self, *args, **kwargs):
        nonlocal warned
        if not warned:
            asked = _asks_for_batching(self, signature, args, kwargs)
            if asked:
                warned = True
                logger.warning("hf_async_cb is uninstalled: %s is ignored and stock generate runs. Call "
                               "hf_async_cb.install() to batch again.", asked)
        for key in _BATCHING_KEYS:  # ignored, as the warning says (stock would refuse them as unknown)
            kwargs.pop(key, None)
        return original(self, *args, **kwargs)

    generate.__hf_async_cb_stock__ = original
    return generate


def _asks_for_batching(model, signature: inspect.Signature, args: tuple, kwargs: dict) -> str | None:
    """Where this call asks for batching, in words; None when it does not."""
    for key in _BATCHING_KEYS:
        if kwargs.get(key) not in OFF_MODES:
            return f"generate({key}=...)"
    try:
        generation_config = signature.bind(model, *args, **kwargs).arguments.get("generation_config")
    except TypeError:
        return None  # stock explains the bad call itself
    for where, gc in (("generation_config", generation_config),
                      ("model.generation_config", getattr(model, "generation_config", None))):
        for key in _BATCHING_KEYS:
            if gc is not None and getattr(gc, key, None) not in OFF_MODES:
                return f"{where}.{key}"
    return None
