"""Timing one call as the benchmarks do: the device synced on both sides of the clock, and, where
the call must meet its prompts for the first time, the prefix cache emptied before the clock starts.

A benchmark that runs a workload twice (a warm-up for the captures and compiles, then the timed
call) would otherwise time the second call on prompts the engine has cached: `timed(...,
unseen=model)` empties the cache first, so that the timed call prefills its prompts as a first
sight of them would (what it shares within itself still hits).
"""

from __future__ import annotations

import time
from typing import Callable, TypeVar

import torch

T = TypeVar("T")


def sync(device: torch.device) -> None:
    """Wait for the work queued on `device` (CUDA); elsewhere there is nothing to wait for."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(call: Callable[[], T], device: torch.device, unseen=None) -> tuple[float, T]:
    """Seconds `call()` takes and what it returns, `device` synced before the clock starts and
    before it stops. `unseen`: an Engine, or a model whose generate runtime holds one: its prefix
    cache is emptied first, outside the clock."""
    if isinstance(unseen, torch.nn.Module):
        import hf_async_cb

        hf_async_cb.clear_prefix_cache(unseen)
    elif unseen is not None:
        unseen.clear_prefix_cache()
    sync(device)
    start = time.perf_counter()
    out = call()
    sync(device)
    return time.perf_counter() - start, out
