"""The client side of a serving run, shared by both servers: each request submitted at its arrival
time from one thread, with the decoding every path runs (greedy, or bench's sampling).
"""

from __future__ import annotations

import time
from typing import Callable

from hf_async_cb.tools import bench
from hf_async_cb.tools.serving_metrics import Trace
from hf_async_cb.tools.serving_workload import Workload


def drive(workload: Workload, submit: Callable[[int, Trace], None]) -> tuple[list[Trace], float]:
    """Submit request i at its arrival time (from this thread, sleeping in between); returns the
    traces (arrival: the stamp taken just before the submission) and the client's largest lag
    behind the schedule, in seconds (a client that cannot keep up delays arrivals, not TTFT)."""
    traces = [Trace(len(p), 0.0) for p in workload.prompts]
    lag = 0.0
    start = time.perf_counter()
    for i, at in enumerate(workload.arrivals):
        wait = start + at - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        traces[i].arrival = now = time.perf_counter()
        lag = max(lag, now - start - at)
        submit(i, traces[i])
    return traces, lag


def decoding_options(sample: bool) -> dict:
    return bench.SAMPLING if sample else dict(do_sample=False)
