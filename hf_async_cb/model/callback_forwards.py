"""Forwards of the model run by the call's own callbacks, as stock generate runs them.

A logits processor for self-guidance or contrastive decoding, a stopping criterion or a streamer
that scores the text so far: stock generate lets such code call the model it is generating with.
An engine call holds that model for its whole run (fused modules swapped in, its configs on the
paged attention, which needs a step's metadata), so such a forward could not run there as it was.

The engine runs the caller's callbacks (processors, criteria, token and done callbacks, streamers)
inside `user_code()`. Forward pre-hooks on the model, its base model and its input embeddings (which
every forward of the model's own runs first), put there for the call by `PreparedModel.using`, see a
forward start inside a callback and set the prepared model aside (the stock modules and attention:
the forward runs as in stock generate) until the callback returns, when it is attached again. A
stock `generate` the callback runs on the model does the same from the model's guard, before stock
reads the model's attention setting. A callback that runs no forward costs a context variable; one
that does, a detach and an attach of the fused modules per callback call.

Not seen: a forward of a part of the model below its embeddings (a decoder layer called on its
own), or of a model another thread's engine call holds (a DataParallel thread replica's callback
running the original model); its attention then refuses it, saying what to do.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from typing import Callable, Iterator

import torch

from hf_async_cb.model.attention import current_metadata

# Inside user_code(): the set-aside contexts a callback's forwards opened (none until one runs).
_opened: ContextVar[list | None] = ContextVar("hf_async_cb_user_code", default=None)
# During an engine call, on its thread: its PreparedModel.set_aside, and the ids of the modules hooked
# for it (a hook of another thread's call, on a model that call holds, must not set this one's aside).
_set_aside: ContextVar[Callable | None] = ContextVar("hf_async_cb_set_aside", default=None)
_hooked: ContextVar[frozenset] = ContextVar("hf_async_cb_hooked", default=frozenset())


@contextlib.contextmanager
def user_code() -> Iterator[None]:
    """Around the caller's callbacks that run inside an engine call (processors, criteria, token
    callbacks and streamers): a forward of the model they run gets the stock model."""
    opened: list = []
    token = _opened.set(opened)
    try:
        yield
    finally:
        _opened.reset(token)
        while opened:
            opened.pop().__exit__(None, None, None)


@contextlib.contextmanager
def stock_for_callbacks(model: torch.nn.Module, set_aside: Callable) -> Iterator[None]:
    """For one engine call on `model` (PreparedModel.using): a forward the call's callbacks run gets
    the stock model from `set_aside()`, opened at the forward's start (a pre-hook on the model, its
    base model and its input embeddings, which a wrapper calling the model's `.forward` directly, as
    PEFT's do, still reaches) or at a stock generate's (`stock_now`, from the model's guard)."""
    entries = [model]
    base = getattr(model, "base_model", None)  # (the decoder below a task head, called on its own)
    if isinstance(base, torch.nn.Module) and base is not model:
        entries.append(base)
    try:
        embeddings = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        embeddings = None
    if isinstance(embeddings, torch.nn.Module):
        entries.append(embeddings)
    hooks = [m.register_forward_pre_hook(_stock_model_for_callbacks) for m in entries]
    token, hooked = _set_aside.set(set_aside), _hooked.set(frozenset(map(id, entries)))
    try:
        yield
    finally:
        _set_aside.reset(token)
        _hooked.reset(hooked)
        for hook in hooks:
            hook.remove()


def in_callback() -> bool:
    """Whether this thread runs a callback of its engine call, outside the call's steps."""
    return _opened.get() is not None and _set_aside.get() is not None and current_metadata() is None


def stock_now() -> bool:
    """Inside a callback of an engine call, outside its steps: the call's model set aside until the
    callback returns (once per callback), and True; else False."""
    if not in_callback():
        return False
    opened = _opened.get()
    if not opened:
        aside = _set_aside.get()()
        aside.__enter__()
        opened.append(aside)
    return True


def _stock_model_for_callbacks(module, args) -> None:
    if id(module) in _hooked.get():  # (a module-level function: a model copied or pickled meanwhile keeps it)
        stock_now()
