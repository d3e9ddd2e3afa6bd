"""Where each step's time goes: CPU spans (schedule + build, launch, wait, update) per step, and
on CUDA the compute stream's spans from events, on one host timeline; the GPU-busy fraction; and
the timeline picture, sync and async one above the other.

    engine = Engine(model, BatchingConfig(profile=True)); engine.generate(...)
    profile = engine.pipeline("async").profile
    profile.summary()            # wall time, CPU share per lane, GPU-busy fraction
    plot_timelines({"sync": p1, "async": p2}, "timeline.png")

Overhead when off: one attribute test per span. On the CPU there is no separate device: the model
runs inside "launch", and the GPU lane is empty.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

CPU_LANES = ("schedule+build", "launch", "wait", "update")
GPU_LANE = "gpu compute"


@dataclass
class Span:
    lane: str
    step: int
    start: float  # seconds, host clock (time.perf_counter)
    end: float


class StepProfile:
    def __init__(self, streams) -> None:
        self.streams = streams
        self.spans: list[Span] = []
        self.prefix_cache: dict | None = None  # what the run took from the prefix cache (Engine.run sets it)
        self._events: list[tuple[int, object, object]] = []
        self._origin = None  # (host time, CUDA event) recorded together, to put events on the host clock
        if streams.is_cuda:
            import torch

            torch.cuda.synchronize(streams.device)
            origin = streams.event(timing=True)
            origin.record(streams.compute)
            origin.synchronize()
            self._origin = (time.perf_counter(), origin)

    @contextlib.contextmanager
    def cpu(self, lane: str, step: int):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.spans.append(Span(lane, step, start, time.perf_counter()))

    def gpu(self, step: int, began, ended) -> None:
        if self._origin is not None:
            self._events.append((step, began, ended))

    def finish(self) -> None:
        """Turn recorded CUDA events into spans on the host clock (waits for the last one)."""
        if not self._events:
            return
        host0, origin = self._origin
        self._events[-1][2].synchronize()
        for step, began, ended in self._events:
            self.spans.append(Span(GPU_LANE, step, host0 + origin.elapsed_time(began) / 1e3,
                                   host0 + origin.elapsed_time(ended) / 1e3))
        self._events.clear()

    def lanes(self) -> dict[str, list[Span]]:
        self.finish()
        out: dict[str, list[Span]] = {}
        for span in sorted(self.spans, key=lambda s: s.start):
            out.setdefault(span.lane, []).append(span)
        return out

    def summary(self) -> dict:
        lanes = self.lanes()
        if not self.spans:
            return {"wall_s": 0.0}
        start = min(s.start for s in self.spans)
        end = max(s.end for s in self.spans)
        wall = end - start
        report = {"wall_s": wall, "steps": len(lanes.get("launch", []))}
        for lane, spans in lanes.items():
            report[f"{lane}_share"] = sum(s.end - s.start for s in spans) / wall if wall else 0.0
        gpu = lanes.get(GPU_LANE)
        if gpu:
            span = gpu[-1].end - gpu[0].start
            report["gpu_busy"] = sum(s.end - s.start for s in gpu) / span if span > 0 else 0.0
        if self.prefix_cache is not None:
            report["prefix_cache"] = self.prefix_cache
        return report


def plot_timelines(profiles: dict[str, StepProfile], path: str, last_seconds: float | None = None) -> None:
    """One panel per loop (e.g. sync above async), one row per lane; writes a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lanes_order = (*CPU_LANES, GPU_LANE)
    colors = dict(zip(lanes_order, ("#4c72b0", "#55a868", "#c44e52", "#8172b2", "#dd8452")))
    fig, axes = plt.subplots(len(profiles), 1, figsize=(12, 1.6 + 1.1 * len(profiles) * 2), squeeze=False)
    for ax, (name, profile) in zip(axes[:, 0], profiles.items()):
        lanes = profile.lanes()
        if not profile.spans:
            continue
        t0 = min(s.start for s in profile.spans)
        t_end = max(s.end for s in profile.spans)
        if last_seconds is not None:
            t0 = max(t0, t_end - last_seconds)
        rows = [lane for lane in lanes_order if lane in lanes]
        for y, lane in enumerate(rows):
            bars = [((s.start - t0) * 1e3, (s.end - s.start) * 1e3) for s in lanes[lane] if s.end >= t0]
            ax.broken_barh(bars, (y - 0.4, 0.8), color=colors[lane])
        ax.set_yticks(range(len(rows)), rows)
        ax.set_xlim(0, (t_end - t0) * 1e3)
        ax.set_xlabel("ms")
        busy = profile.summary().get("gpu_busy")
        ax.set_title(name + (f"  (GPU busy {100 * busy:.1f}%)" if busy is not None else ""))
        ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
