"""The online API: a background thread runs the loop; requests come and go while it runs.

    engine.start()
    handle = engine.add_request([1, 2, 3], max_new_tokens=32)     # or text, with a tokenizer
    for token in handle: ...                                       # blocking stream
    async for token in handle.astream(): ...                       # asyncio stream
    handle.result(timeout=10)                                      # the RequestOutput
    engine.abort(handle)
    engine.shutdown()                                              # bounded; queued requests end ABORTED

Requests join the running batches at the next step. Aborts and new requests are applied by the
loop thread between steps; a request aborted while a step computing it is in flight simply has
that token dropped. A request's own logits processor or stopping criterion raising fails that
request alone (its handle re-raises the error); an exception of the step itself fails the requests
in that step (running, or with a token in flight), those still queued are served after, and the
loop goes on. shutdown() from the loop's own thread (a callback) asks for the stop without waiting.
While the loop runs, the model's attention is routed to the engine: do not run the model elsewhere
meanwhile. An engine dropped without shutdown() is collected like any object: its loop then cancels
what it holds, gives the model its attention back and ends.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
import weakref

from hf_async_cb.config import BatchingConfig
from hf_async_cb.engine import late_admission
from hf_async_cb.engine.late_admission import StepCadence
from hf_async_cb.engine.pipeline import Pipeline
from hf_async_cb.engine.request_handle import RequestHandle, recorder
from hf_async_cb.engine.requests import FinishReason, RequestStatus
from hf_async_cb.engine.runner import ModelRunner
from hf_async_cb.engine.scheduler import Scheduler
from hf_async_cb.engine.stack_chunk import above_a_large_stack_chunk
from hf_async_cb.errors import explain_out_of_memory
from hf_async_cb.model.kv_fingerprint import WeightVersions
from hf_async_cb.model.model_guard import model_guard
from hf_async_cb.model.numeric_context import numeric_context
from hf_async_cb.model.vision_feature_cache import TowerOutputCache

logger = logging.getLogger(__name__)


class _Worker:
    """What the loop thread runs. It holds the pipeline, scheduler and runner but never the engine,
    so that an engine dropped without shutdown() can be collected; its finalizer then stops this."""

    def __init__(self, pipeline: Pipeline, scheduler: Scheduler, runner: ModelRunner,
                 config: BatchingConfig, tower_outputs: TowerOutputCache, device_type: str) -> None:
        self.pipeline = pipeline
        self.device_type = device_type
        self.scheduler = scheduler
        self.runner = runner
        self.config = config
        self.tower_outputs = tower_outputs
        self.claim: object | None = None  # the model claimed for this loop (Engine.start), until it holds it
        self.intake: queue.Queue[RequestHandle] = queue.Queue()
        self.active: dict[int, RequestHandle] = {}
        self.aborts: queue.SimpleQueue[RequestHandle] = queue.SimpleQueue()  # asked by abort(), not yet applied
        self.clears: queue.SimpleQueue[threading.Event] = queue.SimpleQueue()  # asked by clear_caches()
        self.wake = threading.Event()
        self.stopping = False
        self.cancel = False
        self.error: BaseException | None = None  # what ended the loop, if an error did
        self.lock = threading.Lock()
        self.thread_id: int | None = None
        late = config.late_admission and pipeline.overlap
        self.cadence = StepCadence() if late else None
        # Late admission's record: builds put off, and those not put off because requests queued, because
        # no duration of the running step's kind was known, or after a step the device had run dry at.
        self.late_waits = self.late_queued = self.late_unknown = self.late_idled = 0
        self._hold_until: float | None = None  # late admission: no step built before this time.perf_counter()
        # The model's guard, found now: a stop request may come from the collector's finalizer of a
        # dropped engine, on a thread in the middle of a guard lookup of its own.
        self.guard = model_guard(runner.model)

    def request_stop(self, cancel: bool) -> None:
        with self.lock:
            self.stopping = True
            self.cancel = self.cancel or cancel
        if self.thread_id is not None:  # a stopping loop is waited for, not refused (ModelGuard)
            self.guard.stop_serving(self.thread_id)
        self.wake.set()

    def run(self) -> None:
        """The loop; should it stop on an error outside a step (which _loop() reports to the step's
        requests and goes on from), every request it holds or has yet to take fails with that error
        and later submissions are refused: no caller waits on a loop that is gone."""
        self.thread_id = threading.get_ident()
        self.pipeline.track_idle = self.cadence is not None  # (the pipeline outlives the loop: generate's too)
        try:
            self._loop()
        except BaseException as error:  # noqa: BLE001 - reported to every waiting caller
            logger.exception("the background loop stopped")
            with self.lock:
                self.stopping = True
                self.error = error
            while not self.intake.empty():  # taken, not scheduled: they fail with the rest
                handle = self.intake.get_nowait()
                self.active[id(handle.request)] = handle
            try:
                self._fail_active(error)
            finally:
                for handle in self.active.values():  # (if failing them properly failed too)
                    handle._finish(error)
                self.active.clear()
        finally:
            self.pipeline.track_idle = False
            self.guard.release_reservation(self.claim)  # (if it ended before holding the model)

    def _loop(self) -> None:
        pipeline, scheduler = self.pipeline, self.scheduler
        with self.runner.prepared("the background loop", serving=True):
            self.guard.release_reservation(self.claim)  # (Engine.start's claim)
            if self.stopping:  # asked to stop before it held the model: it must not serve then
                self.guard.stop_serving(self.thread_id)
            weights = WeightVersions(self.runner.model)
            caching = scheduler.prefix_cache is not None
            seen = weights.read() if caching else None
            while True:
                if not self.intake.empty():  # (this thread alone takes from it: _admit will take them)
                    # The model checked before the new requests are taken in: their images' merges
                    # read the tower outputs kept by earlier ones (so the merges check nothing).
                    if pipeline.graphs is not None:  # this thread's arithmetic (model/numeric_context.py)
                        context = numeric_context(self.device_type)  # (and the user's hooks: captured afresh)
                        pipeline.graphs.keep_for((context, object()) if weights.runs_user_code else context)
                    if weights.restructured():
                        # A weight given another tensor, a module replaced, a hook added or removed: refused,
                        # with what to do, to every caller, where the engine runs a prepared copy; else the
                        # model runs as it is now, and what was cached before it changed is dropped.
                        self.runner.check_model_unchanged()
                        weights, seen = WeightVersions(self.runner.model), object()
                    # Weights written in place since (an optimizer step between rollouts): the new
                    # requests must not take pages of the old weights' K/V, nor tower outputs.
                    self._refresh_copies(versions_only=True)  # (HQQ 3-bit's 4-bit copies: a counter each)
                    now = weights.read() if caching else None
                    if caching and (now is None or now != seen):
                        scheduler.clear_prefix_cache()
                        self.tower_outputs.clear()
                        seen = now
                    self._admit()
                self._apply_aborts(cancel_all=self.cancel)
                self._apply_clears()
                if self._hold_until is not None:  # late admission: requests taken in as they come, the build held
                    left = self._hold_until - time.perf_counter()
                    if left > 0 and not self.stopping:
                        self.wake.wait(left)
                        self.wake.clear()
                        continue
                    self._hold_until = None
                self.runner.prepared_model.reclaim_attention()  # (a few config reads per pass)
                busy = scheduler.has_work or bool(pipeline.in_flight)
                if not busy:
                    if self.stopping and self.intake.empty():
                        break
                    self.wake.wait(0.05)
                    self.wake.clear()
                    continue
                steady = self.cadence is not None and bool(pipeline.in_flight)
                try:
                    finished = pipeline.step(isolate_faults=True)
                    returned = time.perf_counter()  # (before the callers' callbacks: a step's end, for late admission)
                except BaseException as error:  # noqa: BLE001 - reported to every affected caller
                    logger.exception("a step failed; failing its requests")
                    self._fail_step(explain_out_of_memory(error, self.config))
                    continue
                for req in finished:
                    handle = self.active.pop(id(req), None)
                    if handle is not None:
                        handle._finish(req.error)
                if self.cadence is not None:  # engine/late_admission.py
                    self._wait_for_late_admission(returned, steady and bool(pipeline.in_flight), pipeline.found_idle)

    def _wait_for_late_admission(self, returned: float, steady: bool, idled: bool) -> None:
        """Hold the next build until the step running is about to end; requests that arrive meanwhile
        are taken in at once (their images merged) and join it (the loop's top: `_hold_until`).
        `returned`: when the step that ended returned (its callers' callbacks since are not a step's time)."""
        pipeline = self.pipeline
        self.cadence.observe(returned, steady, idled, pipeline.completed_kind, pipeline.build_s)
        now = time.perf_counter()
        running = pipeline.in_flight[-1].kind if pipeline.in_flight else 0
        # Requests waiting for room: an arrival would queue behind them, so a wait would gain it nothing.
        waits = steady and not self.stopping and not self.scheduler.waiting
        if late_admission.ARRIVALS_END_THE_WAIT:
            waits = waits and self.intake.empty()
        delay = self.cadence.delay(now, running) if waits else 0.0
        self.late_idled += idled
        self.late_queued += steady and not waits
        self.late_unknown += waits and self.cadence.expected_s(running) is None
        if delay > 0:
            self.late_waits += 1
            if late_admission.ARRIVALS_END_THE_WAIT:  # (the earlier rule: an arrival ends the wait)
                self.wake.wait(delay)
                self.wake.clear()
            else:
                self._hold_until = now + delay

    def _admit(self) -> None:
        """Take the submitted requests in."""
        while True:
            try:
                handle = self.intake.get_nowait()
            except queue.Empty:
                return
            self.active[id(handle.request)] = handle
            try:
                if handle._before_admission is not None:  # its images merged (Engine.add_request(media=...))
                    streams = self.pipeline.streams
                    # On the compute stream, ordered with the steps that read them; by the stock model.
                    with streams.on(streams.compute), self.runner.prepared_model.set_aside():
                        handle._before_admission(self.runner.model, handle.request)
                self.scheduler.add(handle.request)
            except Exception as error:  # noqa: BLE001 - its inputs' failure (a merge, a refusal): its caller's
                self.active.pop(id(handle.request))
                handle._finish(error)
                continue
            if handle._abort:  # its abort() was drained before it was taken in
                self.aborts.put(handle)

    def _apply_clears(self) -> None:
        """Empty the prefix cache and the tower outputs for the callers of clear_caches() (here,
        between steps: the scheduler's tables are this thread's while it serves)."""
        done = _drained(self.clears)
        if done:
            self._refresh_copies()  # (a write through `.data`, which no counter sees, is what clears are for)
            if self.scheduler.prefix_cache is not None:
                self.scheduler.clear_prefix_cache()
            self.tower_outputs.clear()
            for event in done:
                event.set()

    def _refresh_copies(self, versions_only: bool = False) -> None:
        """Rebuild the decode GEMMs' copies of weights written since (model/hqq_four_bit_copy.py)."""
        gemms = self.runner.prepared_model.decode_gemms
        if gemms is not None and gemms.copies:
            gemms.refresh_copies(versions_only=versions_only)

    def _apply_aborts(self, cancel_all: bool) -> None:
        """Abort the handles abort() queued since the last pass (all those held on a cancel): a
        pass costs what was aborted, not a scan of the backlog, which it runs between every step."""
        handles = _drained(self.aborts)
        if cancel_all:
            handles = list(self.active.values())
        for handle in handles:
            req = handle.request
            if self.active.get(id(req)) is not handle:  # ended already, or not taken in yet (_admit)
                continue
            if not req.is_finished:
                self.scheduler.finish(req, RequestStatus.ABORTED)
                req.finish_reason = FinishReason.ABORTED
            del self.active[id(req)]
            handle._finish()

    def _fail_step(self, error: BaseException) -> None:
        """Fail the requests of the step that raised: those running and those with a token in flight
        (in the async loop, the step before it too; a request preempted since is queued again with
        its token pending). Those only queued were in no step: they stay, to be served after. An
        error no request explains fails all the loop holds, rather than coming back every step."""
        scheduler = self.scheduler
        in_step = [*scheduler.running, *(r for f in self.pipeline.in_flight for r in f.sample_requests),
                   *(r for r in scheduler.waiting if r.num_pending)]
        self.pipeline.abandon()
        scheduler.clear_prefix_cache()  # the failed step may not have written what it registered
        failed = {id(r): r for r in in_step if not r.is_finished}
        if not failed:
            self._fail_active(error)
            return
        for key, req in failed.items():
            scheduler.finish(req, RequestStatus.ABORTED)
            req.finish_reason = FinishReason.ABORTED
            req.num_pending = 0
            handle = self.active.pop(key, None)
            if handle is not None:
                handle._finish(error)
        # Requests the step's update ended before the error (a token, or their own fault): as usual.
        for key, handle in list(self.active.items()):
            if handle.request.is_finished:
                del self.active[key]
                handle._finish(handle.request.error)

    def _fail_active(self, error: BaseException) -> None:
        for handle in self.active.values():
            req = handle.request
            if not req.is_finished:
                self.scheduler.finish(req, RequestStatus.ABORTED)
                req.finish_reason = FinishReason.ABORTED
            req.num_pending = 0
            handle._finish(error)
        self.active.clear()


_RUNNING: "weakref.WeakSet[BackgroundLoop]" = weakref.WeakSet()  # loops whose thread runs


@atexit.register
def _stop_running_loops() -> None:
    """At interpreter exit, cancel and join the loops still running. A loop thread (a daemon) left
    in the middle of a step when the interpreter finalises takes torch's threads down with it
    (the process aborts: "terminate called without an active exception")."""
    for loop in list(_RUNNING):
        loop._worker.request_stop(True)
    for loop in list(_RUNNING):
        loop.thread.join(10)


def _drained(q: queue.SimpleQueue) -> list:
    """Everything queued on `q` now, in order (what other threads put later waits for the next pass)."""
    items = []
    while True:
        try:
            items.append(q.get_nowait())
        except queue.Empty:
            return items


class BackgroundLoop:
    """The engine's side of the loop thread: submit, abort, stop."""

    def __init__(self, engine, mode: str, claim: object) -> None:
        # No reference to the engine (it holds this): an engine dropped without shutdown() is then
        # collected at once, and its finalizer below stops the loop.
        self.pipeline = engine.pipeline(mode)
        self._worker = _Worker(self.pipeline, engine.scheduler, engine.runner, engine.config, engine.tower_outputs,
                               engine.device.type)
        self._worker.claim = claim  # (ModelGuard.reserve_serving's, given up once the loop holds the model)
        self.cache_before: dict | None = None  # the prefix cache's counters at the start (with profile=True)
        self.thread = threading.Thread(target=above_a_large_stack_chunk, args=(self._worker.run,), name="hf_async_cb-loop",
                                       daemon=True)  # (engine/stack_chunk.py)
        # The engine collected while the loop runs: cancel what it holds and end the thread.
        self._on_collected = weakref.finalize(engine, self._worker.request_stop, True)

    def start(self) -> None:
        # (The model is claimed by Engine.start already: another engine's loop is refused there, in
        # its caller's thread; one that is stopping is waited for here, ModelGuard.stop_serving.)
        self.thread.start()
        _RUNNING.add(self)

    def submit(self, handle: RequestHandle) -> None:
        worker = self._worker
        with worker.lock:
            if worker.error is not None:
                raise RuntimeError(f"the engine's loop stopped on an error ({type(worker.error).__name__}: "
                                   f"{worker.error}); shutdown() it, then start() again.") from worker.error
            if worker.stopping:
                raise RuntimeError("the engine's loop is shutting down (or a shutdown() timed out): wait for it "
                                   "with shutdown(), then start() it again to add requests.")
            handle.request.on_token = recorder(handle, handle.request.on_token)
            handle._loop_thread = self.thread
            worker.intake.put(handle)
        worker.wake.set()

    @property
    def stopping(self) -> bool:
        return self._worker.stopping

    @property
    def ended(self) -> bool:
        """Whether the loop's thread ran and is gone (stopped on an error, with no shutdown())."""
        return self.thread.ident is not None and not self.thread.is_alive()

    def abort(self, handle: RequestHandle) -> None:
        handle._abort = True
        self._worker.aborts.put(handle)
        self._worker.wake.set()

    def clear_caches(self) -> bool:
        """Have the loop empty the prefix cache and tower outputs between its steps, and wait for it;
        False where the caller must clear them itself (on the loop's thread, or the loop is gone)."""
        if self.on_loop_thread:
            return False
        done = threading.Event()
        self._worker.clears.put(done)
        self._worker.wake.set()
        while not done.wait(0.05):
            if not self.thread.is_alive():
                return done.is_set()
        return True

    @property
    def on_loop_thread(self) -> bool:
        """Whether the caller runs on the loop's thread (a token or done callback)."""
        return threading.current_thread() is self.thread

    def stop(self, cancel: bool, timeout: float | None) -> bool:
        """Ask the loop to stop and wait at most `timeout` for it; whether it has stopped. On the
        loop's own thread it only asks (a thread cannot wait for itself): a later stop() joins it."""
        self._worker.request_stop(cancel)
        if self.on_loop_thread:
            return False
        self.thread.join(timeout)
        stopped = not self.thread.is_alive()
        if stopped:
            self._on_collected.detach()
            _RUNNING.discard(self)
        return stopped
