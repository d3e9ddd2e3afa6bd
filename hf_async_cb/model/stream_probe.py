"""Which linear classes launch CUDA kernels off the current stream, found by running one of each.

model/graph_safety.py names the classes known to launch on the legacy default stream (read from their
libraries' sources). A library not read there, or a new version of one, could do the same: a CUDA
graph would not record its kernels (silent wrong tokens) and the engine's compute stream would not be
ordered with them. So, on CUDA, the engine runs one module of every such class once under the profiler,
on a stream of its own, with a marker kernel before it, and looks at the stream each kernel ran on: any
other than the marker's is off the current stream. The verdict is kept per (module class, weight class)
for the process; graph_safety reads it beside its list.

Only modules that can hold code of their own are probed: leaf modules with an `in_features`, whose
class comes from outside torch, transformers and this package, or whose weight is a tensor subclass
(torchao's, quanto's): plain torch operations always launch on the current stream. Each is run on one
and on 320 rows (a library may pick another kernel for a prefill step). A probe that cannot run (the
forward wants other inputs, a profiler is already running, no marker seen) decides nothing, and the
list stands alone. Kernels another thread of the process launches meanwhile are seen too: such a false
finding only costs speed (the engine computes on the default stream), never tokens.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch

logger = logging.getLogger("hf_async_cb")

_TRUSTED_PACKAGES = ("torch.", "transformers.", "hf_async_cb.")
_PROBE_ROWS = (1, 320)
_MARKER = "spin_kernel"  # torch.cuda._sleep's kernel: launched on the current stream
# (module class, weight class) -> names of the kernels it ran off the current stream (empty: none)
_VERDICTS: dict[tuple[type, type], tuple[str, ...]] = {}


def key(module: torch.nn.Module) -> tuple[type, type]:
    return type(module), type(getattr(module, "weight", None))


def verdict(module: torch.nn.Module) -> tuple[str, ...] | None:
    """The kernels a probe of `module`'s classes saw run off the current stream; None if none was probed."""
    return _VERDICTS.get(key(module))


def is_candidate(module: torch.nn.Module) -> bool:
    """Whether `module` may run kernels of a library's own (see the module docstring)."""
    if next(module.children(), None) is not None or not isinstance(getattr(module, "in_features", None), int):
        return False
    weight = getattr(module, "weight", None)
    subclass = isinstance(weight, torch.Tensor) and type(weight) not in (torch.Tensor, torch.nn.Parameter)
    foreign = not type(module).__module__.startswith(_TRUSTED_PACKAGES)
    return subclass or foreign


def off_stream_kernels(events: Iterable[tuple[str, int]]) -> tuple[str, ...] | None:
    """From (kernel name, stream) in launch order, the names of the kernels on another stream than the
    marker's (the first marker seen); None when no marker was seen (nothing can be said)."""
    events = list(events)
    marker = next((stream for name, stream in events if _MARKER in name), None)
    if marker is None:
        return None
    return tuple(dict.fromkeys(name for name, stream in events if stream != marker and _MARKER not in name))


def _device_events(module: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> list[tuple[str, int]]:
    """Run `module` on each probe size on a fresh stream under the profiler: (kernel name, stream) of
    every device event, the marker's first."""
    from torch.profiler import ProfilerActivity, profile

    stream = torch.cuda.Stream(device)
    inputs = [torch.randn(1, rows, module.in_features, dtype=dtype, device=device) for rows in _PROBE_ROWS]
    torch.cuda.synchronize(device)
    # (no_grad, not inference_mode: quanto's weight subclasses cannot be used under inference_mode)
    with profile(activities=[ProfilerActivity.CUDA]) as prof, torch.cuda.stream(stream), torch.no_grad():
        torch.cuda._sleep(1000)
        for x in inputs:
            module(x)
        torch.cuda.synchronize(device)
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    events.sort(key=lambda e: e.time_range.start)
    return [(e.name, e.device_resource_id) for e in events]


def probe(model: torch.nn.Module, dtype: torch.dtype, listed_too: bool = False) -> dict[str, tuple[str, ...]]:
    """Probe one CUDA module of every candidate class pair of `model` not probed yet (activations in
    `dtype`; `listed_too`: those graph_safety names as well, a check of the probe itself); returns
    {module name: off-stream kernels} of those it found running any."""
    from hf_async_cb.model.graph_safety import module_launches_off_stream

    if not torch.autograd.kineto_available() or torch.autograd.profiler._is_profiler_enabled:
        return {}
    found = {}
    for name, module in model.named_modules():
        if key(module) in _VERDICTS or not is_candidate(module) or (module_launches_off_stream(module)
                                                                    and not listed_too):
            continue  # (probed, nothing of its own, or listed already)
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.device.type != "cuda":
            continue
        try:
            kernels = off_stream_kernels(_device_events(module, dtype, weight.device))
        except Exception as error:  # a forward that wants other inputs: the list decides alone
            logger.debug("hf_async_cb: could not probe %s (%s): %s", name, type(module).__name__, error)
            continue
        if kernels is None:
            continue
        _VERDICTS[key(module)] = kernels
        if kernels:
            found[name] = kernels
            logger.info("hf_async_cb: %s (%s) runs kernels off the current stream: %s", name,
                        type(module).__name__, ", ".join(k[:60] for k in kernels[:3]))
    return found
