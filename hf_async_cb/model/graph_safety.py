"""Quantized weights whose kernels ignore the current stream or a capture: where they run, and how.

A CUDA graph records the kernels launched on the stream it captures. optimum-quanto's 2- and 4-bit
weights (WeightQBitsTensor, and its AWQ form) unpack and multiply with CUDA kernels launched on
the legacy default stream, whichever stream is current: a capture does not record them, and a
replay skips them and reads whatever the captured buffers hold. On an H200, quanto int4 gave other
tokens than stock's from the first one with the engine's graphs, and stock's tokens without them
(its forward outside a graph is right, so the parity check, which runs eagerly, passed it). The
engine runs such a model without CUDA graphs, and says so.

bitsandbytes' LLM.int8() linears with an outlier threshold (its default) cannot be captured at all:
each call sizes its outlier tensors on the host. On the H200 an 8B model's first decode capture
failed, and the failed capture left torch's CUDA generator marked as capturing, so that every later
random draw of the process raised (engine/captured_graph.py now also repairs that). Where the engine
routes such linears through kernels/llm_int8.py (their steps of up to 256 rows: model/decode_gemm.py),
those steps are captured and larger ones run eagerly (`graph_token_cap`); other such models run
without CUDA graphs from the start. quanto's plain 4- and 2-bit linears and its AWQ ones that the engine
routes through the skinny GEMM's grouped form (model/quanto_grouped.py) are alike: their steps of up to
256 rows run the kernel on the current stream and are captured, larger ones run quanto's forward eagerly.

gptqmodel's ExLlamaV2 linears (GPTQ and AWQ) and its AWQ GEMM and fast-GEMV linears launch their kernels
on the legacy stream too (read from its CUDA sources, 7.7); its Marlin, Machete, Triton and torch linears
use the current stream. A class on neither list is checked by running it (model/stream_probe.py: the
engine probes one module of each class from outside torch and transformers, or with a tensor-subclass
weight, on CUDA), and the verdict counts here beside the lists.

A kernel on the legacy stream is not ordered with the engine's compute stream either (torch's streams do
not wait for the legacy one, nor it for them): run eagerly, it could read an activation not yet written,
or write a buffer the caching allocator handed out while queued work still read it. So an engine whose
model holds any such module computes on the legacy default stream itself (`holds_off_stream_kernels`;
devices.Streams), where they are ordered with everything else of the step, as in stock generate.
"""

from __future__ import annotations

from collections.abc import Collection

import torch

from hf_async_cb.model import stream_probe

# (module prefix, class names) of weight classes whose CUDA kernels ignore the current stream.
_OFF_STREAM_WEIGHTS = (("optimum.quanto", ("WeightQBitsTensor", "AWQWeightQBitsTensor")),)
# (module prefix, class names) of module classes whose CUDA kernels ignore the current stream.
_OFF_STREAM_MODULES = (("gptqmodel.nn_modules.qlinear", ("ExllamaV2Linear", "AwqExllamaV2Linear", "AwqGEMMLinear",
                                                          "AwqGEMVFastLinear", "LLMAwqLinear")),)


def _listed(cls: type, listing) -> bool:
    return any(cls.__module__.startswith(prefix) and cls.__name__ in names for prefix, names in listing)


def launches_off_stream(weight: torch.Tensor) -> bool:
    """Whether `weight`'s class runs CUDA kernels on the legacy stream rather than the current one."""
    return _listed(type(weight), _OFF_STREAM_WEIGHTS)


def _off_stream_class(module: torch.nn.Module) -> str | None:
    """The class (the module's, or its weight's) that makes `module`'s own forward run CUDA kernels on
    the legacy stream (listed, or seen by a probe of its class: model/stream_probe.py), or None."""
    if _listed(type(module), _OFF_STREAM_MODULES) or stream_probe.verdict(module):
        return type(module).__name__
    weight = getattr(module, "weight", None)
    return type(weight).__name__ if isinstance(weight, torch.Tensor) and launches_off_stream(weight) else None


def module_launches_off_stream(module: torch.nn.Module) -> bool:
    """Whether `module`'s own forward runs CUDA kernels on the legacy stream (its class's, or its
    weight's)."""
    return _off_stream_class(module) is not None


def _on_cuda(module: torch.nn.Module) -> bool:
    """Whether `module` holds a tensor of its own (parameter or buffer) on a CUDA device."""
    return any(t.device.type == "cuda" for t in (*module.parameters(recurse=False), *module.buffers(recurse=False)))


def holds_off_stream_kernels(model: torch.nn.Module) -> list[str]:
    """Names of the modules on CUDA whose own forward launches kernels on the legacy stream (routed
    or not: a routed one still runs its own forward for larger steps)."""
    return [name for name, module in model.named_modules() if _on_cuda(module) and module_launches_off_stream(module)]


def splits_outliers_on_host(module: torch.nn.Module) -> bool:
    """Whether `module` is bitsandbytes' LLM.int8() linear with an outlier threshold (its default,
    6.0): each call finds the activation columns above it and sizes tensors by their count, which
    waits for the GPU, which a capture does not allow."""
    cls = type(module)
    return (cls.__module__.startswith("bitsandbytes") and cls.__name__ == "Linear8bitLt"
            and float(getattr(getattr(module, "state", None), "threshold", 0.0) or 0.0) > 0.0)


def graph_unsafe_weights(model: torch.nn.Module, routed: Collection[torch.nn.Module] = ()) -> list[tuple[str, str]]:
    """(name, class) of the CUDA modules whose kernels a CUDA graph would not record or cannot capture
    (the class that makes them so: the module's or its weight's); `routed`: modules whose small steps
    run kernels a graph holds (not counted)."""
    routed_ids = {id(m) for m in routed}
    unsafe = []
    for name, module in model.named_modules():
        if id(module) in routed_ids or not _on_cuda(module):
            continue
        why = _off_stream_class(module) or (type(module).__name__ if splits_outliers_on_host(module) else None)
        if why is not None:
            unsafe.append((name, why))
    return unsafe


def graph_token_cap(routed: Collection[torch.nn.Module]) -> int | None:
    """The most tokens a captured step may hold: where some of `routed` split outliers on the host, or
    run kernels off the stream, in their own forward, which they run over the kernels' rows
    (kernels/skinny_gemm.MAX_M) and no graph may hold, that many; else None (no cap)."""
    if not any(splits_outliers_on_host(m) or module_launches_off_stream(m) for m in routed):
        return None
    from hf_async_cb.kernels.skinny_gemm import MAX_M  # (imports Triton: only for such models)

    return MAX_M
