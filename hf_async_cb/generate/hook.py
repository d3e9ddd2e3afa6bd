"""The hook: install() wraps GenerationMixin.generate so that `batching=` reaches the engine.

The wrapper takes `batching` and `batching_config` out of the call (stock generate would reject
them as unused model kwargs), reads `batching` from the call, else from the GenerationConfig passed
in, else from model.generation_config, and hands off to stock generate when it is None or "off".
Otherwise generate/call.py runs the call on the engine.
"""

from __future__ import annotations

import functools
import inspect

from hf_async_cb.config import BatchingConfig, resolve_mode
from hf_async_cb.model.prepared import model_guard

_original_generate = None


def install() -> None:
    """Make `batching=` available on every transformers generative model (idempotent)."""
    global _original_generate
    from transformers import GenerationMixin

    from hf_async_cb.model import attention

    attention.register()
    if _original_generate is not None:
        return
    _original_generate = GenerationMixin.generate
    GenerationMixin.generate = _make_generate(_original_generate)


def uninstall() -> None:
    """Restore stock generate."""
    global _original_generate
    from transformers import GenerationMixin

    if _original_generate is not None:
        GenerationMixin.generate = _original_generate
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
        mode = _resolve_call_mode(self, has_batching, batching, generation_config, batching_config)
        if mode is None:  # stock generate, after any engine call running on this model
            with model_guard(self).held("generate", kind="stock"):
                return original(self, *args, **kwargs)
        from hf_async_cb.generate.call import engine_generate

        return engine_generate(self, mode, batching_config, generation_config, bound.arguments)

    generate.__hf_async_cb__ = True
    return generate


def _resolve_call_mode(model, has_batching: bool, batching, generation_config, batching_config) -> str | None:
    if has_batching:
        return resolve_mode(batching)
    for source in (generation_config, getattr(model, "generation_config", None)):
        if source is not None and getattr(source, "batching", None) is not None:
            return resolve_mode(source.batching)
    config = batching_config
    if config is None and generation_config is not None:
        config = getattr(generation_config, "batching_config", None)
    return config.mode if isinstance(config, BatchingConfig) else None
