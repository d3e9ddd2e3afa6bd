"""Where a thread's wall time goes, sampled: every few milliseconds another thread reads the watched
thread's Python stack (sys._current_frames) and counts each function on it. Unlike cProfile it
costs the watched thread almost nothing and counts time spent waiting (joins, locks, GPU syncs)
where it is spent, which is what a first call's wall time is made of.

    with WallSampler() as sampler:
        model.generate(...)
    print(sampler.report())
"""

from __future__ import annotations

import collections
import os
import sys
import threading
import time

_MINE = ("hf_async_cb", "transformers", "triton", "torch", "concurrent", "threading")


class WallSampler:
    def __init__(self, interval: float = 0.005, thread_id: int | None = None) -> None:
        self.interval = interval
        self.thread_id = thread_id or threading.get_ident()
        self.inclusive: collections.Counter = collections.Counter()  # seconds per function on the stack
        self.innermost: collections.Counter = collections.Counter()
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="wall-sampler")

    def __enter__(self) -> "WallSampler":
        self._started = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.seconds = time.perf_counter() - self._started

    def _run(self) -> None:
        last = time.perf_counter()
        while not self._stop.wait(self.interval):
            frame = sys._current_frames().get(self.thread_id)
            now = time.perf_counter()
            weight, last = now - last, now  # the time since the last sample (a sample waits for the GIL)
            if frame is None:
                continue
            self.samples += 1
            seen = set()
            inner = None
            while frame is not None:
                code = frame.f_code
                path = code.co_filename
                label = _label(path, code.co_name, code.co_qualname if hasattr(code, "co_qualname") else code.co_name)
                if label is not None:
                    if inner is None:
                        inner = label
                    if label not in seen:
                        seen.add(label)
                        self.inclusive[label] += weight
                frame = frame.f_back
            self.innermost[inner or "(other)"] += weight

    def report(self, top: int = 40, package: str = "hf_async_cb") -> str:
        """The functions of `package` holding the most wall time (inclusive), then the innermost frames."""
        if not self.samples:
            return "no samples"
        lines = [f"{self.samples} samples over {self.seconds:.2f} s"]
        lines.append("inclusive (s):")
        for label, n in self.inclusive.most_common():
            if label.startswith(package):
                lines.append(f"  {n:7.3f}  {label}")
                if len(lines) > top:
                    break
        lines.append("innermost (s):")
        for label, n in self.innermost.most_common(top // 2):
            lines.append(f"  {n:7.3f}  {label}")
        return "\n".join(lines)


def _label(path: str, name: str, qualname: str) -> str | None:
    parts = path.replace(os.sep, "/").split("/")
    for i, part in enumerate(parts):
        if part in _MINE:
            module = "/".join(parts[i:])
            return f"{module}:{qualname}"
    return None
