"""A request's handle in the online API (Engine.add_request): its tokens as they come, blocking or
as an asyncio stream, its result, and callbacks once it is done.

The loop thread (engine/online.py) records each token and the end; callers read them from any
thread or from an event loop (astream).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import AsyncIterator, Iterator

from hf_async_cb.engine.requests import Request, RequestOutput, RequestStatus
from hf_async_cb.model.callback_forwards import user_code

logger = logging.getLogger(__name__)


class RequestHandle:
    """A request submitted to the background loop.

    Its tokens are kept (not consumed by a reader): every iterator and every astream() starts from
    the first token and keeps its own position, so any number of readers, concurrent or coming
    after the end, each see the whole stream, and each gets the request's error at its end.
    """

    def __init__(self, request: Request) -> None:
        self.request = request
        self.error: BaseException | None = None
        self._tokens: list[int] = []
        self._ended = False
        self._changed = threading.Condition()
        self._async_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        self._done = threading.Event()
        self._abort = False
        self._callbacks: list = []
        self._before_admission = None  # run on the loop thread before it is taken in (its images' merge)
        self._loop_thread: threading.Thread | None = None  # the thread of the loop serving it

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def done(self) -> bool:
        return self._done.is_set()

    # called on the loop thread
    def _on_token(self, request: Request, token: int) -> None:
        with self._changed:
            self._tokens.append(token)
            self._changed.notify_all()
            if self._async_waiters:
                self._wake_async()

    def add_done_callback(self, fn) -> None:
        """Call fn(handle) once the request has finished (or failed, or was cancelled): on the loop's
        thread as it ends, or here at once if it has already. As with concurrent.futures, an
        exception fn raises (KeyboardInterrupt and SystemExit included) is logged and does not reach the loop."""
        if not callable(fn):
            raise ValueError(f"add_done_callback takes a callable (handle), got {fn!r}.")
        with self._changed:
            if not self._ended:
                self._callbacks.append(fn)
                return
        _call_back(fn, self)

    def _finish(self, error: BaseException | None = None) -> None:
        with self._changed:
            if self._ended:
                return
            self.error = error
            self._ended = True
            self._changed.notify_all()
            self._wake_async()
            callbacks, self._callbacks = self._callbacks, []
        self._done.set()
        if callbacks:
            with user_code():  # (one may run the model, as a reward: model/callback_forwards.py)
                for fn in callbacks:
                    _call_back(fn, self)

    def _wake_async(self) -> None:
        """Wake the astream() readers waiting on their event loops (called holding the condition)."""
        for loop, waiter in self._async_waiters:
            try:
                loop.call_soon_threadsafe(_resolve, waiter)
            except RuntimeError:  # that event loop is closed: nobody waits there any more
                pass
        self._async_waiters.clear()

    def _failure(self) -> RuntimeError:
        return RuntimeError(f"request {self.request_id} failed: {self.error!r}")

    def _check_not_on_loop_thread(self) -> None:
        """A wait on the loop's own thread (from on_token or a done-callback) would stop the loop, the
        only thread that can end it: refused at once, never a hang."""
        if threading.current_thread() is self._loop_thread:
            raise RuntimeError(f"request {self.request_id} was waited for on the engine's loop thread (in on_token or a "
                               "done-callback): the loop would stop until the wait ended, and only the loop can "
                               "end it. Wait from another thread, or add_done_callback().")

    def _read_from(self, position: int) -> tuple[list[int], bool]:
        """The tokens from `position` on and whether the stream has ended; blocks until there is either."""
        with self._changed:
            if position >= len(self._tokens) and not self._ended:
                self._check_not_on_loop_thread()
            while position >= len(self._tokens) and not self._ended:
                self._changed.wait()
            return self._tokens[position:], self._ended

    # called by users
    def __iter__(self) -> Iterator[int]:
        position = 0
        while True:
            new, ended = self._read_from(position)
            if new:
                position += len(new)
                yield from new
            elif ended:
                if self.error is not None:
                    raise self._failure() from self.error
                return

    def astream(self) -> AsyncIterator[int]:
        """The tokens as an asyncio iterator. A cancelled wait for the next token (a timeout) takes
        nothing: the same iterator then goes on from where it was."""
        return _AsyncTokens(self)

    def result(self, timeout: float | None = None) -> RequestOutput:
        if not self._done.is_set():
            self._check_not_on_loop_thread()
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.request_id} did not finish within {timeout} s")
        if self.error is not None:
            raise self._failure() from self.error
        return self.request.to_output()


def _call_back(fn, handle: RequestHandle) -> None:
    try:
        fn(handle)
    except BaseException:  # noqa: BLE001 (the caller's callback must not stop the loop: KeyboardInterrupt and
        # SystemExit included, raised by the callback itself on this thread, never by the user's Ctrl-C)
        logger.exception("a done-callback of request %s raised", handle.request_id)


def recorder(handle: RequestHandle, on_token):
    """The request's token callback on the loop: the handle records the token, then the caller's
    own `on_token` (add_request's) sees it."""
    if on_token is None:
        return handle._on_token

    def record(request: Request, token: int) -> None:
        handle._on_token(request, token)
        on_token(request, token)

    return record


def _resolve(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)


class _AsyncTokens:
    """An iterator object rather than an async generator: a cancelled __anext__ leaves an async
    generator closed, while this one keeps its position and can be awaited again."""

    def __init__(self, handle: RequestHandle) -> None:
        self._handle = handle
        self._position = 0

    def __aiter__(self) -> "_AsyncTokens":
        return self

    async def __anext__(self) -> int:
        handle = self._handle
        while True:
            with handle._changed:
                if self._position < len(handle._tokens):
                    self._position += 1  # taken only here, where no await can cancel the return
                    return handle._tokens[self._position - 1]
                if handle._ended:
                    if handle.error is not None:
                        raise handle._failure() from handle.error
                    raise StopAsyncIteration
                loop = asyncio.get_running_loop()
                waiter = loop.create_future()
                entry = (loop, waiter)
                handle._async_waiters.append(entry)
            try:
                await waiter
            finally:
                if not waiter.done():  # cancelled: forget this waiter
                    with handle._changed:
                        if entry in handle._async_waiters:
                            handle._async_waiters.remove(entry)
