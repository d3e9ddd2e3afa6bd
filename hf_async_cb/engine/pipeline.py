"""The decode loop, with the CPU/GPU overlap behind one switch.

    overlap=False (batching="sync", the baseline): launch step N, wait for its tokens, update.
        CPU  | sched+build N |   wait   | update N | sched+build N+1 |   wait   | ...
        GPU  |               |  step N  |          |                 | step N+1 |

    overlap=True (batching="async"): build and launch step N+1 before waiting for step N.
        CPU  | build N+1 | launch N+1 | wait N | update N | build N+2 | launch N+2 | wait N+1 | ...
        GPU  |   step N               |  step N+1                    |  step N+2 ...

    (build: schedule + build.) N is waited for between the build and the launch of N+1 instead
    where launching first would only make N's tokens wait (`_hand_out_first`):
        CPU  | build N+1 | wait N | update N | launch N+1 | build N+2 | ...
        GPU  |   step N  |                  |  step N+1 ...
    - N has finished already: the device is idle, launching first would overlap nothing;
    - N samples some request's first token and N+1 runs eagerly: that time to first token would
      take the whole eager launch;
    - N+1 captures a graph: recording it takes the host far longer than N's GPU time, so launching
      first would keep N's tokens waiting for the whole capture and overlap at most one step.
    On the CPU stand-ins every step has finished when the next one is built, so the async loop
    hands each step's tokens out after as many steps as the sync loop does, while it still builds
    the next step with carried-over tokens.

Each step: the builder packs the inputs into an IOSlot (two, alternating) and uploads them on the
H2D stream; the compute stream waits for that upload, gathers carried-over tokens, runs the
forward and samples; the D2H stream waits for the compute and copies the tokens into the slot's
pinned host buffer. The CPU blocks once per step, on that copy's event, for the step before the
one it just built.

The CPU's view of requests lags one step: while building N+1 it knows how many tokens N will
sample but not their values (they are carried over on the device). A request that finished in N
(EOS) may run once more in N+1; that token is dropped, never emitted or counted. Its pages are
freed when N's tokens are processed; only steps queued after that can reuse them, and those run
after N+1 on the compute stream, so no queued step reads a page after it changed hands.

A request's own code (its logits processor, stopping criterion or token callback) raising fails
that request alone: it ends ABORTED with the error in `request.error` (noted with its id) and its
pages freed, the step's other requests are updated as usual, and then step() raises that error,
unless the caller isolates faults (the online loop), which gets the request back among the
finished ones instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections import deque
from dataclasses import dataclass

import torch

from hf_async_cb.devices import Streams
from hf_async_cb.engine.batch import BatchBuilder
from hf_async_cb.engine.cuda_graphs import DecodeGraphs
from hf_async_cb.engine.io_slots import Download, IOSlot
from hf_async_cb.engine.late_admission import step_kind
from hf_async_cb.engine.profiling import StepProfile
from hf_async_cb.engine.requests import FinishReason, Request, RequestStatus
from hf_async_cb.engine.runner import ModelRunner
from hf_async_cb.engine.scheduler import Scheduler
from hf_async_cb.model.callback_forwards import user_code
from hf_async_cb.sampling.sampler import INVALID_TOKEN, invalid_scores_error


@dataclass
class InFlight:
    sample_requests: list[Request]
    sampled: torch.Tensor  # device [2, S] tokens + log-probabilities, kept alive until downloaded
    download: Download
    keep_rows: list[int]
    # device (raw logits, processed scores) of keep_rows, and {kept row index: processed scores} of
    # those whose logits processor returned another dtype than float32, in that dtype
    kept: tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]] | None
    faults: dict[int, BaseException] | None  # row -> what its request's logits processor raised
    first_tokens: bool = False  # some request samples its first token here (its user waits for it)
    kind: int = 0  # what its duration goes with (engine/late_admission.step_kind): 0 decode only


class Pipeline:
    def __init__(self, scheduler: Scheduler, builder: BatchBuilder, runner: ModelRunner, streams: Streams,
                 overlap: bool, graphs: DecodeGraphs | None = None) -> None:
        self.scheduler = scheduler
        self.builder = builder
        self.runner = runner
        self.streams = streams
        self.overlap = overlap
        self.found_idle = False  # see step(); asked only where track_idle (a serving loop with late admission)
        self.track_idle = False
        self.build_s: float | None = None  # where track_idle: the last step's build and launch, in seconds
        self.completed_kind = 0  # the kind of the step last completed (engine/late_admission.py)
        self.graphs = graphs
        self.slots = (IOSlot(streams), IOSlot(streams))
        self.in_flight: deque[InFlight] = deque()
        self.num_steps = 0
        self.num_discarded = 0
        self.record_step_times = False  # CUDA events around each step's compute (benchmarks)
        self.stamp_first_builds = False  # Request.first_build_s (the serving benchmark)
        self.step_times: list[tuple[bool, object, object]] = []
        self.profile: StepProfile | None = None  # BatchingConfig(profile=True)
        self.faults: list[Request] = []  # requests failed by their own code since the last step() returned

    def step(self, isolate_faults: bool = False) -> list[Request]:
        """Build the next step if there is one and launch it (processing the step in flight first
        where `_hand_out_first` says so), then process the oldest step that must be; return the
        requests that finished. A request failed by its own code is among them with its
        `error` set when `isolate_faults`; otherwise that error is raised once the step is processed."""
        finished: list[Request] = []
        began = time.perf_counter() if self.track_idle else 0.0
        with self._span("schedule+build"):
            inputs = self._prepare()
        launched = inputs is not None
        # Whether the device had finished the step in flight before this one was launched (it then ran
        # dry: engine/late_admission.py reads this, to tell a step's duration from its own waits).
        if self.track_idle:
            self.found_idle = launched and bool(self.in_flight) and bool(self.in_flight[-1].download.done.query())
        if launched and self.in_flight and self._hand_out_first(self.in_flight[-1], inputs[3]):
            finished.extend(self._complete(self.in_flight.popleft()))
        if launched:
            with self._span("launch"):
                self._enqueue(*inputs)
            if self.track_idle:  # what late admission's margin must leave the host before a step's expected end
                self.build_s = time.perf_counter() - began
        keep = 1 if (self.overlap and launched) else 0
        completed = bool(finished) or len(self.in_flight) > keep
        while len(self.in_flight) > keep:
            finished.extend(self._complete(self.in_flight.popleft()))
        if self.faults:
            self._report_faults(isolate_faults)
        if not launched and not completed and self.scheduler.has_work:
            raise RuntimeError(
                "the scheduler made no progress: no request fits in the KV pool "
                f"({self.scheduler.allocator.num_free}/{self.scheduler.allocator.num_pages} pages free)"
            )
        return finished

    def drain(self, isolate_faults: bool = False) -> list[Request]:
        finished: list[Request] = []
        while self.in_flight:
            finished.extend(self._complete(self.in_flight.popleft()))
        if self.faults:
            self._report_faults(isolate_faults)
        return finished

    def _report_faults(self, isolate: bool) -> None:
        faults, self.faults = self.faults, []
        if not isolate:
            raise faults[0].error

    def decode_busy_fraction(self) -> tuple[float | None, float | None]:
        """(busy fraction, ms per step) of the compute stream over the recorded decode-only steps:
        time inside steps over the time from the first such step's start to the last one's end."""
        decode = [(b, e) for d, b, e in self.step_times if d]
        if len(decode) < 2:
            return None, None
        decode[-1][1].synchronize()
        busy = sum(b.elapsed_time(e) for b, e in decode)
        span = decode[0][0].elapsed_time(decode[-1][1])
        return busy / span, span / len(decode)

    def abandon(self) -> None:
        """After an error: wait for the queued device work, forget its results."""
        for flight in self.in_flight:
            flight.download.done.synchronize()
        self.in_flight.clear()

    def _span(self, lane: str):
        return self.profile.cpu(lane, self.num_steps) if self.profile is not None else contextlib.nullcontext()

    def _hand_out_first(self, flight: InFlight, key) -> bool:
        """Whether to wait for the step in flight before launching the one just built (see the
        module's docstring): when that costs no overlap, or when its first tokens would otherwise
        wait for a long launch. Its tokens are then out before the launch, carried over all the same."""
        eager = key is None
        captures = not eager and key not in self.graphs
        return captures or (flight.first_tokens and eager) or flight.download.done.query()

    def _prepare(self):
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return None
        slot = self.slots[self.num_steps % 2]
        previous = self.in_flight[-1] if self.in_flight else None
        carry_rows = {id(r): i for i, r in enumerate(previous.sample_requests)} if previous else {}
        key = self.graphs.key_for(plan) if self.graphs is not None else None
        inputs = self.builder.build(plan, slot, carry_rows, (key.batch, key.context, key.tokens) if key else None,
                                    sampled=key is not None and key.sampled)
        if key is not None and inputs.meta.group_start is not None:  # rows that share prefixes: their own graph
            key = dataclasses.replace(key, shared=True)
        for chunk in plan.chunks:
            chunk.request.num_computed += chunk.num_tokens
        first_tokens = False
        built = time.perf_counter() if self.stamp_first_builds else None
        for req in inputs.sample_requests:
            first = not (req.num_pending or req.output_token_ids)
            first_tokens = first_tokens or first
            if first and built is not None:
                req.first_build_s = built
            req.num_pending += 1
        return plan, slot, previous, key, inputs, first_tokens

    def _enqueue(self, plan, slot, previous, key, inputs, first_tokens: bool = False) -> None:
        computed = self.streams.event()
        timing = self.record_step_times or self.profile is not None
        with self.streams.on(self.streams.compute):
            slot.uploaded.wait()
            if plan.page_copies:
                self.runner.copy_pages(plan.page_copies)
            if timing:
                began = self.streams.event(timing=True)
                began.record()
            previous_tokens = previous.sampled[0] if previous else None
            if key is not None:
                sampled = self.graphs.step(key, inputs, previous_tokens)
            else:
                sampled = self.runner.step(inputs, previous_tokens)
            computed.record()
            if timing:
                ended = self.streams.event(timing=True)
                ended.record()
            if self.record_step_times:
                decode_only = all(c.num_tokens == 1 for c in plan.chunks)
                self.step_times.append((decode_only, began, ended))
            if self.profile is not None:
                self.profile.gpu(self.num_steps, began, ended)
        self.in_flight.append(InFlight(inputs.sample_requests, sampled, slot.download(sampled, computed),
                                       inputs.keep_rows, inputs.kept, inputs.faults, first_tokens,
                                       step_kind(plan.num_tokens, len(plan.chunks))))
        self.num_steps += 1

    def _complete(self, flight: InFlight) -> list[Request]:
        self.completed_kind = flight.kind
        with self._span("wait"):
            tokens, logprobs = flight.download.tolist()
        with self._span("update"):
            return self._update(flight, tokens, logprobs)

    def _update(self, flight: InFlight, tokens: list[int], logprobs: list[float]) -> list[Request]:
        finished: list[Request] = []
        if flight.faults:  # their tokens are dropped below, as those of any request that ended
            for row, error in flight.faults.items():
                req = flight.sample_requests[row]
                if not req.is_finished:
                    self._fail(req, error, "logits processor", finished)
        if flight.kept is not None:
            with self.streams.on(self.streams.d2h):  # after the step's compute: the event above fired
                raw, processed, own = flight.kept
                raw, processed, own = raw.cpu(), processed.cpu(), {i: t.cpu() for i, t in own.items()}
            for i, row in enumerate(flight.keep_rows):
                req = flight.sample_requests[row]
                if not req.is_finished:
                    req.output_logits.append(raw[i])
                    req.output_scores.append(own[i] if i in own else processed[i])  # (own: the processor's dtype)
        with user_code():  # (a criterion or token callback may run the model: model/callback_forwards.py)
            for req, token, logprob in zip(flight.sample_requests, tokens, logprobs):
                req.num_pending -= 1
                if req.is_finished:
                    self.num_discarded += 1  # it ended in the step before; this token was speculative
                    continue
                if token == INVALID_TOKEN:  # NaN / inf / nothing kept in a sampled row: stock raises too
                    self._fail(req, invalid_scores_error(req.request_id, len(req.output_token_ids)), "scores",
                               finished)
                    continue
                source = "stopping criterion"
                try:  # free on 3.11+ when nothing raises
                    if req.append_token(token, logprob):
                        self.scheduler.finish(req)
                        finished.append(req)
                    if req.on_token is not None:
                        source = getattr(getattr(req.on_token, "__self__", None), "raised_by", "token callback")
                        req.on_token(req, token)
                # The request's stopping criterion or callback: fail it alone. BaseException too: one
                # request's SystemExit must not take the loop's other requests down (a foreground run
                # re-raises it after the step, so a KeyboardInterrupt still stops the call).
                except BaseException as error:  # noqa: BLE001
                    self._fail(req, error, source, finished)
        return finished

    def _fail(self, req: Request, error: BaseException, source: str, finished: list[Request]) -> None:
        """End `req` (ABORTED, pages freed: no queued step reads them, as for EOS) with `error`."""
        error.add_note(f"hf_async_cb: raised by the {source} of request {req.request_id}, which was aborted")
        req.error = error
        if not req.is_finished:
            self.scheduler.finish(req, RequestStatus.ABORTED)
            finished.append(req)
        else:  # its last token's callback raised, after the token had ended it: aborted all the same
            req.status = RequestStatus.ABORTED
        req.finish_reason = FinishReason.ABORTED
        self.faults.append(req)
