"""When the async serving loop should build its next step: as late as the step running allows.

The async loop launches step N+1 before it waits for step N, so a step is built while the one
before it still runs. Built right when step N finishes (as it used to be), step N+2 is fixed for
the whole of N+1's run: a request arriving meanwhile joins N+3, one step later than the sync loop
would take it. For an 8B model (~7 ms steps) that step is most of the async loop's TTFT gap to
sync at light load (docs/benchmarks.md). With BatchingConfig(late_admission=True) the loop waits,
after a step's tokens are out, until a margin before the running step is expected to end (or until
a request arrives), then builds: arrivals during most of the step join the next one, and the next
step is still queued before the device runs dry.

The expected end comes from the host's own clock: in a steady async loop, step() returns once per
step, at the completion of the step before, so the interval between two returns is one step's
duration, as long as the device never ran dry in between. An interval in which it did (the step in
flight had finished before the next was launched: the wait overshot, or steps run synchronously, as
on the CPU) says nothing of the device and empties the record, so that the loop stops waiting until
it has measured again. The estimate is the median of the last few intervals: a long prefill step
does not stretch the waits after it.
"""

from __future__ import annotations

import collections
import statistics


class StepCadence:
    """The recent step duration, from the times the loop's step() returned with a step in flight,
    and how long to wait before building the next one."""

    def __init__(self, min_step_s: float = 3e-3, margin_s: float = 1.5e-3, margin_share: float = 0.25,
                 window: int = 8) -> None:
        self.min_step_s = min_step_s  # shorter steps: the margin would take all of it
        self.margin_s = margin_s  # at least this long before the expected end, for the build and launch
        self.margin_share = margin_share  # and at least this share of the step
        self._intervals: collections.deque[float] = collections.deque(maxlen=window)
        self._last: float | None = None

    @property
    def step_s(self) -> float | None:
        """The expected duration of a step (the median of the recent intervals), or None."""
        return statistics.median(self._intervals) if self._intervals else None

    def observe(self, now: float, steady: bool, idled: bool = False) -> None:
        """step() returned at `now`; `steady`: a step was in flight before and after it (an interval
        between two such returns is one step's duration); `idled`: the device had finished the step
        in flight before the next was launched, so the interval is not one (the record is emptied).
        An unsteady return forgets the last time."""
        if idled:
            self._intervals.clear()
        elif steady and self._last is not None:
            self._intervals.append(now - self._last)
        self._last = now if steady else None

    def delay(self, now: float) -> float:
        """Seconds to wait from `now` before building the next step (0: build now)."""
        step = self.step_s
        if step is None or self._last is None or step < self.min_step_s:
            return 0.0
        margin = max(self.margin_s, self.margin_share * step)
        return max(0.0, self._last + step - margin - now)
