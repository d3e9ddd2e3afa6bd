"""When the async serving loop should build its next step: as late as the step running allows.

The async loop launches step N+1 before it waits for step N, so a step is built while the one
before it still runs. Built right when step N finishes (as it used to be), step N+2 is fixed for
the whole of N+1's run: a request arriving meanwhile joins N+3, one step later than the sync loop
would take it. For an 8B model (~7 ms steps) that step is most of the async loop's TTFT gap to
sync at light load (docs/benchmarks.md). With BatchingConfig(late_admission=True), the default,
the loop holds the next build, after a step's tokens are out, until a margin before the running step
is expected to end, then builds: arrivals during most of the step join the next one, and the next
step is still queued before the device runs dry. A request that arrives during the hold is taken in
at once (its images merged), and the build still waits: that step cannot start before the running
one ends, so building it at the arrival gains the arrival nothing and shuts out the arrivals after
it (at 64 requests/s on an 8B model, an arrival each step, cutting the wait at each arrival left
async's TTFT p50 11.7 ms, about a step, above sync's with one eager step; docs/benchmarks.md). No wait while requests queue
for room (the running-request or token limits): an arrival would join the end of that queue, so
waiting gains it nothing (at 64 requests/s on an 8B model, waiting regardless cost 5% of TTFT and
E2E).

The expected end comes from the host's own clock: in a steady async loop, step() returns once per
step, at the completion of the step before, so the interval between two returns is one step's
duration, as long as the device never ran dry in between. An interval in which it did (the step in
flight had finished before the next was launched: the wait overshot, or steps run synchronously, as
on the CPU) says nothing of the device and empties the record, so that the loop stops waiting until
it has measured again.

Steps differ: a decode step takes about the same time as the last one, a step with a prefill chunk
takes longer the more prompt tokens it holds. An interval counts toward the kind of the step that
completed in it (step_kind: decode only, or a prefill of about so many tokens), and the wait reads
the kind of the step running: the median of the recent decode steps, or the shortest recent step of
its prefill size (conservative: a wait that overshoots leaves the device idle, which costs every
running request a step's gap, while one that ends early costs nothing but the new arrival's step).
Where the device ran dry all the same, the margin grows (by half, up to `max_share` of the step),
and it shrinks back toward its base step by step while none does: the cost of a wrong estimate is
paid once, not at every step. (At 16 requests/s on an 8B model, one median for every kind left the
device idle often enough to raise the mean inter-token latency by 10%: docs/benchmarks.md.)

The margin's base can be lowered below a quarter of the step where the host's recent builds
(schedule, build and launch of a step, timed by the pipeline) were short beside it: twice their
median, at least `min_share` of the step. An arrival in the margin joins a step later, so the margin
is what the async loop's first tokens pay over the sync loop's, which in turn pays the build between
every two steps (at 64 requests/s on an 8B model, a margin of a quarter of ~15 ms steps left async
4-7 ms behind). The floor stays at a quarter (no change): on an H200 (docs/benchmarks.md, tenth session)
`HF_ASYNC_CB_LATE_MIN_SHARE=0.08` left async 3 ms further behind sync at 64 requests/s and doubled the
TTFT p99 at 16: the gap is not the margin (net of the step the async loop launches ahead, its requests
join no later than sync's).
"""

from __future__ import annotations

import collections
import os
import statistics

MIN_SHARE_VARIABLE = "HF_ASYNC_CB_LATE_MIN_SHARE"
# The earlier rule, kept for A/B runs (benchmarks/serving_rates.py --arrivals-end-wait): an arrival
# ends the wait and the next step is built at once.
ARRIVALS_END_THE_WAIT = False


def step_kind(tokens: int, chunks: int) -> int:
    """What a step's duration goes with: 0 for a step of decode rows only (one token per chunk), else
    the bit length of its prompt tokens beyond one per chunk (prefills of 9-16 tokens alike, ...)."""
    return max(0, tokens - chunks).bit_length()


class StepCadence:
    """The recent step durations per kind of step, from the times the loop's step() returned with a
    step in flight, and how long to wait before building the next one."""

    def __init__(self, min_step_s: float = 3e-3, margin_s: float = 1.5e-3, margin_share: float = 0.25,
                 window: int = 8, max_share: float = 0.6, recovery: float = 0.97, min_share: float | None = None) -> None:
        self.min_step_s = min_step_s  # shorter steps: the margin would take all of it
        self.margin_s = margin_s  # at least this long before the expected end, for the build and launch
        self.base_share = margin_share  # and at least this share of the step
        self.margin_share = margin_share  # (grown where the device ran dry: see the module's docstring)
        self.max_share = max_share
        self.recovery = recovery  # the factor that brings the margin back toward its base per steady step
        self.window = window
        # The base share's floor where builds are short: a quarter (the base itself: builds never lower it;
        # HF_ASYNC_CB_LATE_MIN_SHARE=0.08 measured worse, the module's docstring).
        self.min_share = float(os.environ.get(MIN_SHARE_VARIABLE, margin_share)) if min_share is None else min_share
        self._builds: collections.deque[float] = collections.deque(maxlen=16)
        self._intervals: dict[int, collections.deque[float]] = {}
        self._last: float | None = None

    def _record(self, kind: int) -> collections.deque[float]:
        return self._intervals.setdefault(kind, collections.deque(maxlen=self.window))

    def expected_s(self, kind: int = 0) -> float | None:
        """The expected duration of a step of `kind`: the median of the recent decode steps, the
        shortest recent step of a prefill size; None before one was measured."""
        record = self._intervals.get(kind)
        if not record:
            return None
        return statistics.median(record) if kind == 0 else min(record)

    @property
    def step_s(self) -> float | None:
        """The expected duration of a decode step, or None."""
        return self.expected_s(0)

    def observe(self, now: float, steady: bool, idled: bool = False, kind: int = 0,
                build_s: float | None = None) -> None:
        """step() returned at `now`, having completed a step of `kind`; `steady`: a step was in flight
        before and after it (an interval between two such returns is that step's duration); `idled`:
        the device had finished the step in flight before the next was launched, so the interval is
        not one (the record is emptied, the margin grows). An unsteady return forgets the last time.
        `build_s`: how long the host took to build and launch the step it launched in that step()."""
        if build_s is not None:
            self._builds.append(build_s)
        if idled:
            self._intervals.clear()
            self.margin_share = min(self.max_share, self.margin_share * 1.5)
        elif steady and self._last is not None:
            self._record(kind).append(now - self._last)
            self.margin_share = max(self.base_share, self.margin_share * self.recovery)
        self._last = now if steady else None

    def delay(self, now: float, kind: int = 0) -> float:
        """Seconds to wait from `now` before building the next step, while a step of `kind` runs
        (0: build now)."""
        step = self.expected_s(kind)
        if step is None or self._last is None or step < self.min_step_s:
            return 0.0
        share = self.margin_share
        if self._builds and self.min_share < self.base_share:  # the base lowered to what builds need (growth kept)
            needed = max(self.min_share, 2 * statistics.median(self._builds) / step)
            share -= self.base_share - min(self.base_share, needed)
        margin = max(self.margin_s, share * step)
        return max(0.0, self._last + step - margin - now)
