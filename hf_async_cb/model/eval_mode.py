"""The engine runs a model as in eval mode, whatever mode the model is in.

Stock generate runs a model in the mode it finds it: in train mode its dropout drops at random, so
the tokens change from call to call. The engine does not reproduce that: its paged attention has
no dropout, so a model in train mode ran half-dropped (module dropouts on, attention dropout off),
and K/V pages computed so stayed in the prefix cache and were served to later eval-mode calls. So
every engine call (generate, Engine.run, a serving loop, the checks that run the stock forward)
turns `training` off on the modules that have it on, and turns it back on after: the tokens are the
eval-mode tokens, the same in every call, and what is cached is what an eval call computes. A model
in train mode whose dropout would act gets one warning. (RL loops that keep the policy in train mode
are the usual case: LLM configs mostly set dropout to 0, where the two modes give the same tokens.)

Calls of several threads on one model nest: the first turns the modes off, the last gives them back.
A stock call that another thread runs on the same model meanwhile sees eval mode too (module modes
are the model's, not a thread's): stock calls wait for an engine call's steps, not for its set-up.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from typing import Iterator

from torch import nn

logger = logging.getLogger(__name__)

_LOCK = threading.Lock()
_HELD: "weakref.WeakKeyDictionary[nn.Module, list]" = weakref.WeakKeyDictionary()  # model -> [calls, modules]
_WARNED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()
# A module's own rates of what acts in training only, by name: dropout layers' and functional dropout's
# (`residual_dropout`, `embedding_dropout`), drop-path's, a router's jitter noise (`jitter_noise`).
_RANDOM_IN_TRAINING = ("drop", "jitter", "noise")


@contextlib.contextmanager
def as_in_eval(model: nn.Module, warn: bool = True) -> Iterator[None]:
    """`model`'s modules with `training` off for the block (those that had it on get it back)."""
    with _LOCK:
        held = _HELD.get(model)
        if held is None:
            training = [m for m in model.modules() if m.training]
            held = _HELD[model] = [0, training]
            for m in training:
                m.training = False
            if warn and training and model not in _WARNED and _drops(training):
                _WARNED.add(model)
                logger.warning("hf_async_cb: %s is in training mode with dropout; the engine generates as in eval mode "
                               "(no dropout: the same tokens every call), where stock generate would drop at random. "
                               "Call model.eval() to say so, or batching='off' for stock's dropout.",
                               type(model).__name__)
        held[0] += 1
    try:
        yield
    finally:
        with _LOCK:
            held[0] -= 1
            if held[0] == 0:
                del _HELD[model]
                for m in held[1]:
                    m.training = True


def _drops(modules: list[nn.Module]) -> bool:
    """Whether any of these modules would act at random in train mode: a dropout layer, or a rate of
    its own > 0 (see _RANDOM_IN_TRAINING)."""
    for m in modules:
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0:
            return True
        if any(type(value) is float and value > 0 and any(word in name for word in _RANDOM_IN_TRAINING)
               for name, value in vars(m).items()):
            return True
    return False
