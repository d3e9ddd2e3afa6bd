"""Streams and events, real on CUDA and stand-ins on the CPU, so one loop serves both.

On the CPU every operation runs when it is issued, so a stand-in stream is a no-op context and a
stand-in event is always complete: the async loop's slots, carry-over and lagged update still run
the same code, which is what lets CI test them without a GPU.
"""

from __future__ import annotations

import contextlib
import functools

import torch


@functools.lru_cache(maxsize=8)
def num_sms(device: torch.device) -> int | None:
    """The GPU's streaming multiprocessors (what kernels size their grids by); None off CUDA."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else None


def synchronize(device: torch.device) -> None:
    """Wait for everything queued on `device` (nothing to wait for off CUDA): around a timed call."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _NoEvent:
    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other) -> float:
        return 0.0


class Streams:
    """Three streams: h2d (inputs up), compute (forward + sampling), d2h (tokens down), each its own
    non-default stream, but for `compute_on_default`: compute on the device's default (legacy) stream,
    for models whose kernels launch there whatever stream is current (model/graph_safety.py)."""

    def __init__(self, device: torch.device, compute_on_default: bool = False) -> None:
        self.device = device
        self.is_cuda = device.type == "cuda"
        if self.is_cuda:
            self.h2d = torch.cuda.Stream(device)
            self.compute = torch.cuda.default_stream(device) if compute_on_default else torch.cuda.Stream(device)
            self.d2h = torch.cuda.Stream(device)
        else:
            self.h2d = self.compute = self.d2h = None

    def on(self, stream):
        """Context that issues work on `stream` (a no-op on the CPU)."""
        return torch.cuda.stream(stream) if self.is_cuda else contextlib.nullcontext()

    def event(self, timing: bool = False):
        return torch.cuda.Event(enable_timing=timing) if self.is_cuda else _NoEvent()

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.pin_memory() if self.is_cuda else tensor
