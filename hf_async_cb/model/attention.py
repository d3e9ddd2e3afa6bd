"""Our attention implementation, registered with transformers' AttentionInterface.

Models call registered attention functions as fn(module, query, key, value, attention_mask,
scaling=..., dropout=..., **forward_kwargs). Ours receives the layer's whole page pool as key and
value (from PagedKVCache.update, as [1, heads, slots, dim] views) and the step's StepMetadata
through the forward kwargs. Some modeling code (StableLM, Nemotron) does not pass its kwargs on to
the attention function: the step is then read from `current_step`, which the runner sets around
every forward. Per-layer options arrive as keywords: `sliding_window`, `softcap` (Gemma 2's
attention-logit softcapping), `s_aux` / `sinks` (gpt-oss's attention sinks) and `alibi_slopes`
(Bloom's and MPT's ALiBi, from model/adapters.py). Where a layer's `sliding_window` keyword and its
stock mask disagree, the mask's window wins (model/mask_semantics.py).

No mask function is registered on purpose: transformers skips building a dense mask for an
attention implementation that has none, and the paged attention derives causality (and sliding
windows) from the step metadata instead.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

import torch
from transformers import PretrainedConfig

from hf_async_cb.interrupts import deferred_interrupts
from hf_async_cb.kernels.paged_attention_reference import paged_attention_reference
from hf_async_cb.model.kv_cache import PagedKVCache
from hf_async_cb.model.mask_semantics import config_tree, window_override
from hf_async_cb.model.step_metadata import StepMetadata

ATTENTION_NAME = "hf_async_cb_paged"
METADATA_KWARG = "hf_async_cb_step"

# The step of the forward running in this thread (or task): what the attention reads when the
# modeling code drops the forward kwargs on the way.
_current_step: contextvars.ContextVar[StepMetadata | None] = contextvars.ContextVar("hf_async_cb_step", default=None)
# Set on the thread of an engine call for its whole run (PreparedModel.using): a forward outside its steps
# there is the call's own user code (a processor, a criterion, a streamer) running the model.
_in_call: contextvars.ContextVar[bool] = contextvars.ContextVar("hf_async_cb_call", default=False)


@contextlib.contextmanager
def engine_call() -> Iterator[None]:
    token = _in_call.set(True)
    try:
        yield
    finally:
        _in_call.reset(token)


def current_metadata() -> StepMetadata | None:
    """The step of the forward running in this thread, if any (what modules other than attention
    read of it: the LLM.int8() projections, StepMetadata.real_tokens)."""
    return _current_step.get()


@contextlib.contextmanager
def current_step(meta: StepMetadata) -> Iterator[None]:
    token = _current_step.set(meta)
    try:
        yield
    finally:
        _current_step.reset(token)


_SHARED_CONFIG = ("models that share one config object switch their attention together while an engine runs "
                  "one of them: give each model its own config (copy.deepcopy(model.config)) to run them side by side")


def check_probed(module, probed: set[int], what: str) -> None:
    """In an attention that stands in for a check's forward: refuse a module of another model (one
    sharing the probed model's config object, run meanwhile), which would get the check's zeros."""
    if id(module) not in probed:
        raise RuntimeError(f"{type(module).__name__} of another model ran while hf_async_cb {what}: {_SHARED_CONFIG}.")


def paged_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    meta: StepMetadata | None = kwargs.get(METADATA_KWARG) or _current_step.get()
    if meta is None:
        if _in_call.get():
            raise RuntimeError(
                f"{type(module).__name__} ran a forward inside an engine call, outside its steps, which the engine "
                "could not hand the stock model: its callbacks' forwards of the model, its base model or from its "
                "input embeddings get it (model/callback_forwards.py), but this one started below them (a layer "
                "called on its own), ran outside a callback, or ran a model another thread's engine call holds (a "
                "DataParallel thread replica's callback running the original model). Call the model itself, run "
                "the forward on a copy (copy.deepcopy(model)), or generate without batching.")
        raise RuntimeError(
            f"{type(module).__name__} called the {ATTENTION_NAME!r} attention outside an engine step: its model is "
            "held by an engine right now (a serving loop: call the model after shutdown(); a generate call in another "
            f"thread: after it returns), or it shares its config object with one that is ({_SHARED_CONFIG})."
        )
    if kwargs.get("alibi") is not None or kwargs.get("position_bias") is not None:
        raise ValueError(f"{type(module).__name__} adds a dense position-bias tensor to its attention scores, which "
                         "hf_async_cb does not support (ALiBi runs through model/adapters.py, as slopes).")
    meta.attention_calls += 1
    options = {}
    if kwargs.get("softcap"):
        options["softcap"] = float(kwargs["softcap"])
    sinks = kwargs.get("s_aux", kwargs.get("sinks"))
    if sinks is not None:
        options["sinks"] = sinks
    if kwargs.get("alibi_slopes") is not None:  # model/adapters.py: Bloom, MPT
        options["alibi_slopes"] = kwargs["alibi_slopes"]
    window = window_override(module, kwargs.get("sliding_window"))  # the mask's, where the keyword differs
    key_pool, value_pool = PagedKVCache.pool_of(key), PagedKVCache.pool_of(value)
    # This layer's new K/V, which PagedKVCache.update left to the attention kernel to store.
    pending = meta.pending_kv.pop(key_pool.data_ptr(), None)
    if meta.kv_gathered:
        meta = meta.gathered_view()["meta"]
    if pending is not None and (meta.backend != "triton" or pending[3].data_ptr() != value_pool.data_ptr()):
        from hf_async_cb.kernels.store_kv import store_kv  # (not a pair of pools the kernel can take)

        store_kv(pending[2], pending[3], pending[0], pending[1], meta.slot_mapping)
        pending = None
    if meta.backend == "triton":
        from hf_async_cb.kernels.paged_attention import paged_attention_triton

        new_kv = None if pending is None else pending[:2]
        out = paged_attention_triton(query, key_pool, value_pool, meta, scaling, window, new_kv=new_kv, **options)
    else:
        out = paged_attention_reference(query, key_pool, value_pool, meta, scaling, window, **options)
    return out, None


_MISSING = object()


class _Switched(str):
    """The engine's attention name as a config holds it while an engine call or serving loop has
    switched it, knowing the config's own setting. A copy of the config made meanwhile (a
    `copy.deepcopy(model)` or `torch.save(model)` from another thread while a call runs, or while a
    loop serves) takes the config's own setting instead: the copy is no model an engine runs, and it
    used to keep the engine's attention for good, every later forward or generate of it raising."""

    stock: str | dict | None

    def __new__(cls, name: str, stock):
        switched = super().__new__(cls, name)
        switched.stock = None if stock is _MISSING else stock
        return switched

    def __deepcopy__(self, memo):
        return self.stock

    def __copy__(self):
        return self.stock

    def __reduce__(self):
        return (_stock_setting, (self.stock,))


def _stock_setting(value):  # (what an unpickled _Switched is: the config's own setting)
    return value


def _switch(saved: list, name: str) -> None:
    """Each config of `saved` (as implementation() records them) set to `name`, marked as switched."""
    for c, value in saved:
        if c.__dict__.get("_attn_implementation_internal", _MISSING) == name:
            c._attn_implementation_internal = _Switched(name, value)


@contextlib.contextmanager
def implementation(config, name: str, model: torch.nn.Module | None = None) -> Iterator[None]:
    """`name` as the attention implementation of `config` (and, through transformers' setter, its
    sub-configs) for a block; with `model`, also of the configs its modules hold of their own (a
    layer deep-copied into it keeps a copy of its model's config, which its attention reads). Each
    config's own setting is given back after: setting the saved top-level value back would spread
    it over sub-configs that had settings of their own."""
    roots = [config, *(own_configs(model, config) if model is not None else ())]
    saved = [(c, c.__dict__.get("_attn_implementation_internal", _MISSING)) for c in _trees(roots)]
    for root in roots:
        root._attn_implementation = name
    _switch(saved, name)  # (what the setter above spread, marked: see _Switched)
    try:
        yield saved
    finally:
        with deferred_interrupts():  # a config left on the engine's attention fails every later forward
            _put_back(saved)


@contextlib.contextmanager
def given_back(saved: list) -> Iterator[None]:
    """Inside implementation() (what it yielded): each config's own setting for a block, for a
    forward of the stock model's own (a served request's images merged), then the engine's again."""
    current = [(c, c.__dict__.get("_attn_implementation_internal", _MISSING)) for c, _ in saved]
    _put_back(saved)
    try:
        yield
    finally:
        with deferred_interrupts():
            _put_back(current)


def own_configs(model: torch.nn.Module, config, modules: list | None = None) -> list:
    """The configs `model`'s modules (`modules`: `list(model.modules())`, if walked already) hold
    outside `config`'s tree (modules deep-copied from another model, or built on a config of their
    own), each once."""
    tree = {id(c) for c in config_tree(config)} if isinstance(config, PretrainedConfig) else set()
    found = {}
    for m in model.modules() if modules is None else modules:
        c = m.__dict__.get("config")
        if isinstance(c, PretrainedConfig) and id(c) not in tree:
            found[id(c)] = c
    return list(found.values())


def switched_configs(model: torch.nn.Module, modules: list | None = None) -> list:
    """Every config implementation(model.config, name, model) switches: the model's config (if it
    is one) and those its modules hold of their own, with their sub-configs, each once (the model's
    guard indexes them: model/model_guard.py)."""
    config = getattr(model, "config", None)
    roots = [config] if isinstance(config, PretrainedConfig) else []
    return _trees(roots + own_configs(model, config, modules))


def _trees(roots: list) -> list:
    """Each root config's tree (mask_semantics.config_tree), each config once."""
    return list({id(c): c for root in roots for c in config_tree(root)}.values())


def reclaim(saved: list, name: str) -> list:
    """Inside implementation() (`saved`: what it yielded): the configs set to another implementation
    since (the user's `set_attn_implementation` while a serving loop holds the model), set to `name`
    again, each keeping the user's setting as the one given back at the block's end. Returns them."""
    taken = []
    for i, (c, _) in enumerate(saved):
        current = c.__dict__.get("_attn_implementation_internal", _MISSING)
        if current != name:
            saved[i] = (c, current)
            c._attn_implementation_internal = _Switched(name, current)
            taken.append(c)
    return taken


def _put_back(saved: list) -> None:
    for c, value in saved:
        if value is _MISSING:
            c.__dict__.pop("_attn_implementation_internal", None)
        else:
            c._attn_implementation_internal = value


def resolve_backend(choice: str, device: torch.device) -> str:
    """BatchingConfig.attention -> the kernel the engine runs: "auto" takes the Triton kernels on
    CUDA when Triton is installed, the pure-torch reference otherwise."""
    if choice == "reference":
        return "reference"
    try:
        from hf_async_cb.kernels.paged_attention import runs_on
    except ImportError as e:
        if choice == "triton":
            raise ValueError(f"BatchingConfig(attention='triton') needs Triton: {e}") from e
        return "reference"
    if choice == "triton":
        if not runs_on(device):
            raise ValueError(
                "BatchingConfig(attention='triton') on the CPU runs only in Triton's interpreter: set "
                "TRITON_INTERPRET=1 before triton is first imported."
            )
        return "triton"
    return "triton" if device.type == "cuda" else "reference"


def register() -> None:
    """Register the attention function (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)


def unregister() -> None:
    from transformers import AttentionInterface

    AttentionInterface._global_mapping.pop(ATTENTION_NAME, None)


__all__ = ["ATTENTION_NAME", "METADATA_KWARG", "StepMetadata", "current_step", "implementation", "paged_attention_forward",
           "paged_attention_reference", "register", "resolve_backend", "unregister"]
