"""Cleanup that a Ctrl-C cannot cut in half.

A KeyboardInterrupt is raised wherever the main thread happens to be when SIGINT arrives: in the
middle of the code that gives a model back its modules and attention setting, or releases its
guard, it would leave the model routed to the engine (every later forward failing) or the guard
held for good (every later call waiting forever). Such cleanup runs under deferred_interrupts():
a SIGINT that arrives meanwhile is delivered, as the handler that was installed would have it, once
the block is done.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator


@contextlib.contextmanager
def deferred_interrupts() -> Iterator[None]:
    """Hold SIGINT off for the block (main thread only: signals are delivered there alone)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received = []
    try:
        previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(frame))
    except (ValueError, OSError, TypeError):  # handlers cannot be set here (an embedding interpreter)
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if received:
            if callable(previous):
                previous(signal.SIGINT, received[0])
            elif previous == signal.SIG_DFL:
                signal.raise_signal(signal.SIGINT)
