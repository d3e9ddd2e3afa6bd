"""The model guard: one engine call at a time on a model, and on every model sharing a part of it.

An engine call switches the attention implementation of every config its modules hold
(attention.switched_configs) and swaps fused modules into them; a preparation fuses weights in place.
Two models that share a module (a policy and a value head on one backbone, `b.model = a.model`, a
PEFT wrapper and its base model) or a config object are one model to such a call: they share one
guard. `model_guard(model)` finds the guard from the model's modules and configs (the model's own
entry, else any of its parts' entries) and merges the guards of models found to share parts; the
index holds the parts weakly, so models are still garbage-collected.

All guards share one lock: waits are checked for deadlock against every guard (a wait-for graph of
threads), and merged guards are one exclusion scope even while held.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Iterator

import torch

from hf_async_cb.model.attention import switched_configs

# Every guard's state, the index and the waits. Reentrant: the collector may finalize a dropped serving
# Engine on a thread inside this lock, and its loop's stop request takes it again (stop_serving).
_COND = threading.Condition(threading.RLock())
_OWNERS: dict[int, tuple[weakref.ref, "ModelGuard"]] = {}  # id(module or config) -> (a ref to it, its guard)
_WAITING: dict[int, tuple["ModelGuard", str, str]] = {}  # thread -> (the guard it waits for, the kind, its name)
_SWEEP = [1024]  # the index's size above which entries of collected parts are dropped

# Kinds of hold that nest on the owning thread, under holds without an "engine" one: a generate call's
# whole run ("outer") or a build ("build") runs only the package's code, an engine run ("engine") also
# the user's (processors, streamers, hooks), which must not start another call on the model.
_NESTING = ("engine", "build")
_SERVING = ("the model (or one sharing its modules or config) is serving an Engine's background loop; "
            "shutdown() it first.")


class ModelGuard:
    """One engine call at a time on a model (and on the models sharing its modules or configs, merged
    into one guard): others wait their turn; a model busy serving a background loop refuses at once
    (that loop runs until shutdown()); a call made from inside an engine call on the same thread (a
    processor or streamer calling generate) is refused, never a deadlock; a wait that would deadlock
    with another thread's (each thread's call generating with the model the other holds, from a
    logits processor) is refused at once, naming both.

    Stock generate calls ("stock" holds) share the model with each other, from any thread, as in
    stock transformers: they only wait for an engine call to end, and an engine call waits for them.
    Holds nest on the owning thread: a generate call holds the guard across its whole run ("outer"),
    a build ("build": an Engine's, a preparation) across its own; "engine" and "build" holds nest in
    them, and nothing nests in an "engine" hold but a stock generate of one of its callbacks, for
    which the call sets its model aside (model/callback_forwards.py)."""

    def __init__(self, name: str = "the model") -> None:
        self.name = name  # the model's class, for messages
        self._into: ModelGuard | None = None  # the guard this one was merged into
        self._members: list[ModelGuard] = [self]  # a root's: every guard merged into it, itself first
        self._owner: int | None = None  # the thread of the engine call holding the model
        self._holds: list[str] = []  # the owner's nested holds, outermost first
        self._serving = False
        self._reserved: object | None = None  # a background loop started whose thread has yet to hold the model
        self._stock: dict[int, int] = {}  # thread -> its stock calls in progress

    # -- the group (under _COND) ---------------------------------------------------------------
    def _root(self) -> "ModelGuard":
        guard = self
        while guard._into is not None:
            guard = guard._into
        return guard

    def _group(self) -> list["ModelGuard"]:
        return self._root()._members

    def _owned_by(self, thread: int) -> "ModelGuard | None":
        return next((g for g in self._group() if g._owner == thread), None)

    def _blockers(self, thread: int, kind: str) -> set[int]:
        """The threads a hold of `kind` by `thread` waits for: the owner, and for an engine hold the
        threads in stock calls."""
        found = {g._owner for g in self._group() if g._owner is not None}
        if kind != "stock":
            found.update(t for g in self._group() for t in g._stock)
        found.discard(thread)
        return found

    def _serving_by_other(self, thread: int) -> bool:
        return any(g._serving and g._owner != thread for g in self._group())

    @staticmethod
    def _busy(what: str) -> RuntimeError:
        return RuntimeError(f"{what} was called from inside a generate call on the same model (or one sharing its "
                            "modules or config; a logits processor, stopping criterion or streamer?): the model is "
                            "busy on this thread. (A stock generate, batching='off', runs from an engine call's "
                            "callbacks.)")

    # -- holds ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def held(self, what: str, kind: str = "engine", serving: bool = False) -> Iterator[None]:
        """The model held for a block: `kind` "outer", "build", "engine" or "stock" (see the class
        docstring), `serving` for a background loop's; `what` names the caller in refusals."""
        me = threading.get_ident()
        # Every change of the state is made inside a `with` block, and recorded in `taken` in the same
        # block, so that a Ctrl-C landing anywhere cannot leave the model held (every later call waiting).
        taken: list = []
        try:
            with _COND:
                self._enter(me, what, kind, serving, taken)
            if kind == "stock" and taken and taken[0][1] == "nested":  # a stock generate of an engine call's callback
                _set_aside_for_callback()  # (outside the lock: it swaps the model's modules)
            yield
        finally:
            if taken:
                with _COND:
                    guard, how = taken[0]
                    if how == "nested":
                        guard._holds.pop()
                    elif how == "stock":
                        left = guard._stock.pop(me) - 1
                        if left:
                            guard._stock[me] = left
                    elif guard._owner == me:
                        guard._owner, guard._serving, guard._holds = None, False, []
                    _COND.notify_all()

    def _enter(self, me: int, what: str, kind: str, serving: bool, taken: list) -> None:
        while True:
            root = self._root()  # (merged with another model's guard while this call waited)
            # Checked again after every wait: a merge may have made a guard this thread holds part of
            # this one (the models turned out to share parts), which is then a call inside its own.
            mine = root._owned_by(me)
            if mine is not None:
                nests = kind in _NESTING and "engine" not in mine._holds
                if not nests and not (kind == "stock" and "engine" in mine._holds and _in_callback()):
                    raise self._busy(what)
                mine._holds.append(kind)
                taken.append((mine, "nested"))
                return
            if kind != "stock" and any(g._stock.get(me) for g in root._group()):  # inside a stock call of this thread
                raise self._busy(what)
            if root._serving_by_other(me):
                raise RuntimeError(f"{what}: {_SERVING}")
            blockers = root._blockers(me, kind)
            if not blockers:
                break
            cycle = _waits_for(me, root, blockers)
            if cycle is not None:
                raise RuntimeError(f"{what} would deadlock: {cycle} Each call holds a model another one waits "
                                   "for (a logits processor, stopping criterion or streamer generating with another "
                                   "model?): this call is refused, the others go on. Stock generate "
                                   "(batching='off' for all of them) shares models between threads.")
            _WAITING[me] = (root, kind, threading.current_thread().name)
            try:
                _COND.wait()
            finally:
                del _WAITING[me]
        if kind == "stock":
            root._stock[me] = root._stock.get(me, 0) + 1
            taken.append((root, "stock"))
        else:
            root._owner, root._serving, root._holds = me, serving, [kind]
            taken.append((root, "owner"))
            if serving:  # waiting calls are refused now, not kept waiting for the loop's end
                _COND.notify_all()

    # -- state read by the engine's serving API ------------------------------------------------
    def held_elsewhere(self) -> bool:
        """Whether another thread holds the model now (its modules may be swapped for that call)."""
        me = threading.get_ident()
        with _COND:
            return any(g._owner is not None and g._owner != me for g in self._group())

    def serving_elsewhere(self) -> bool:
        """Whether another thread holds the model for a background loop that is not stopping."""
        with _COND:
            return self._serving_by_other(threading.get_ident())

    def reserve_serving(self, loop: object) -> bool:
        """Claim the model for background loop `loop` as it starts (its own thread holds the model
        later): False if another loop serves it or claimed it first, so that of two engines started
        at once on one model, one is refused in its caller's thread."""
        with _COND:
            if self._serving_by_other(threading.get_ident()) or \
                    any(g._reserved not in (None, loop) for g in self._group()):
                return False
            self._root()._reserved = loop
            return True

    def release_reservation(self, loop: object) -> None:
        """`loop` holds the model now (or ended without): its claim is done."""
        with _COND:
            for g in self._group():
                if g._reserved is loop:
                    g._reserved = None

    def stop_serving(self, owner: int) -> None:
        """The background loop on thread `owner` is stopping: from now on other calls wait for it to
        end, as for any call, instead of being refused (it releases the model once it has stopped)."""
        with _COND:
            for g in self._group():
                if g._owner == owner:
                    g._serving = False


def _waits_for(me: int, target: ModelGuard, blockers: set[int]) -> str | None:
    """If `me` waiting for `blockers` (the holders of `target`) closes a cycle of waits, each thread
    waiting for a model another one holds, the cycle in words; else None. Under _COND."""
    stack, seen = [(t, ()) for t in blockers], set()
    while stack:
        thread, path = stack.pop()
        if thread == me:
            words, held = [], target
            for t in path:
                waited, _, name = _WAITING[t]
                words.append(f"{held.name} is held by thread {name!r}, which waits for {waited.name}")
                held = waited
            return ", ".join(words) + f", held by this thread ({threading.current_thread().name!r})."
        if thread in seen or thread not in _WAITING:
            continue
        seen.add(thread)
        guard, kind, _ = _WAITING[thread]
        stack.extend((t, (*path, thread)) for t in guard._blockers(thread, kind))
    return None


def _parts(model: torch.nn.Module) -> list:
    """What a call on `model` touches: its modules and the configs its attention switch sets."""
    modules = list(model.modules())
    return [*modules, *switched_configs(model, modules)]


def _guard_of(part) -> ModelGuard | None:
    entry = _OWNERS.get(id(part))
    return entry[1] if entry is not None and entry[0]() is part else None


def _merge(into: ModelGuard, other: ModelGuard) -> ModelGuard:
    """One guard for both (their roots' groups joined; holds in progress count for the whole group)."""
    a, b = into._root(), other._root()
    if a is b:
        return a
    b._into = a
    a._members.extend(b._members)
    b._members = []
    _COND.notify_all()  # (waiters look at the larger group again)
    return a


def model_guard(model: torch.nn.Module, create: bool = True) -> ModelGuard | None:
    """The model's guard, which every model sharing a module or config object with it shares (made on
    first use; None when `create` is False and the model has none yet)."""
    me = threading.get_ident()
    with _COND:
        own = _guard_of(model)
        if own is not None and own._owned_by(me) is not None:  # inside this thread's hold: as found then
            return own._root()
    if own is None and not create:
        return None
    parts = _parts(model)  # (outside the lock: a walk of the modules)
    with _COND:
        guard, unindexed = None, []
        for part in (model, *parts):
            entry = _OWNERS.get(id(part))
            if entry is None or entry[0]() is not part:
                unindexed.append(part)
            elif guard is None:
                guard = entry[1]._root()
            elif entry[1] is not guard:
                guard = _merge(guard, entry[1])
        guard = guard or ModelGuard(type(model).__name__)
        for part in unindexed:
            _OWNERS[id(part)] = (weakref.ref(part), guard)
        if len(_OWNERS) > _SWEEP[0]:  # entries of collected parts dropped, now and then
            for key in [k for k, (ref, _) in _OWNERS.items() if ref() is None]:
                del _OWNERS[key]
            _SWEEP[0] = max(1024, 2 * len(_OWNERS))
        return guard


def _in_callback() -> bool:
    """Whether this thread runs a callback of its engine call (model/callback_forwards.py)."""
    from hf_async_cb.model.callback_forwards import in_callback  # (it imports the attention; this is lower)

    return in_callback()


def _set_aside_for_callback() -> None:
    """The engine call's model stock for its callback's stock generate, until the callback returns."""
    from hf_async_cb.model.callback_forwards import stock_now

    stock_now()
