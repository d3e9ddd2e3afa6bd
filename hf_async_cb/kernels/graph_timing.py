"""Time GPU work as the engine runs it: replayed from a CUDA graph, with no Python launch cost.

Why: a decode step's kernels run from CUDA graphs, back to back. Timing a 10-20 us kernel from
Python (CUDA events around eager calls, or triton.testing.do_bench) measures its launch path
instead: a Triton launch costs ~20-50 us of CPU, so every small kernel looks that slow, and
cuBLAS, launched from C++, looks faster than it is beside it. Capturing `calls` calls in one
graph and timing its replays measures what a graph replay will cost, inter-kernel gaps included.

`fn(i)` is called with the call's index, so that the caller can rotate inputs (e.g. weight
copies that do not all fit in L2, as a decode step finds no weight in L2).
"""

from __future__ import annotations

from typing import Callable

import torch

L2_BYTES = 50 * 1024 * 1024  # the H200's L2


def cold_copies(nbytes: int, l2_bytes: int = L2_BYTES) -> int:
    """How many copies of an input to rotate through when timing, so that none is still in L2 from
    its last call (a decode step finds no weight, and no layer's K/V, in L2): one if the input is
    larger than L2, else enough to fill twice L2, at most 64."""
    return 1 if nbytes > l2_bytes else min(64, -(-2 * l2_bytes // max(1, nbytes)))


def graph_ms(fn: Callable[[int], object], calls: int = 20, replays: int = 7,
             device: torch.device | None = None) -> float:
    """Milliseconds per call of fn(i): `calls` calls captured in one CUDA graph (after a warm-up
    that compiles and allocates on a side stream), the median of `replays` timed replays."""
    device = device or torch.device("cuda", torch.cuda.current_device())
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for i in range(min(calls, 3)):
            fn(i)
    torch.cuda.current_stream(device).wait_stream(stream)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for i in range(calls):
            fn(i)
    graph.replay()  # the first replay uploads the graph
    torch.cuda.synchronize(device)
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    del graph
    return sorted(times)[len(times) // 2]


def eager_ms(fn: Callable[[int], object], calls: int = 20, device: torch.device | None = None) -> float:
    """Milliseconds per call of fn(i) launched eagerly, host time included (after 3 warm-up calls):
    what a step pays for work a CUDA graph cannot hold (e.g. bitsandbytes' LLM.int8() forward)."""
    for i in range(3):
        fn(i)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(device)
    start.record()
    for i in range(calls):
        fn(i)
    end.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(end) / calls
