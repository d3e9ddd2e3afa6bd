"""Where a first call's time goes: seconds spent inside named functions of the package (preparing
the model, compiling ahead, the parity check and its stock forward, graph captures), for the
benchmarks that report a first call (benchmarks/gpu_compile_census.py, benchmarks/gpu_quantized.py).

`time_phases()` wraps each function once in its module (a name imported into another module is
patched there too); `PHASE_SECONDS` sums each phase's seconds until cleared. Nested phases count in
both."""

from __future__ import annotations

import functools
import importlib
import time

# (module, attribute path) of each phase.
PHASES = [
    ("hf_async_cb.model.prepared", "PreparedModel.__init__"),
    ("hf_async_cb.model.mask_semantics", "apply_masks"),
    ("hf_async_cb.model.prepared", "apply_masks"),
    ("hf_async_cb.model.prepared", "embeddings_refusal"),
    ("hf_async_cb.model.prepared", "fuse_projections"),
    ("hf_async_cb.model.elementwise_fusion", "fuse_elementwise"),
    ("hf_async_cb.model.decode_gemm", "DecodeGemms.__init__"),
    ("hf_async_cb.model.decode_gemm", "DecodeGemms.tune"),
    ("hf_async_cb.engine.engine", "Engine._build"),
    ("hf_async_cb.engine.engine", "measured_layout"),
    ("hf_async_cb.engine.engine", "allocate_pool"),
    ("hf_async_cb.engine.engine", "precompile"),
    ("hf_async_cb.kernels.precompile", "Precompile.wait"),
    ("hf_async_cb.engine.engine", "check_parity"),
    ("hf_async_cb.engine.parity", "_reference_logits"),  # the stock forward inside the parity check
    ("hf_async_cb.engine.captured_graph", "CapturedGraph._capture"),  # the two below
    ("hf_async_cb.engine.captured_graph", "CapturedGraph._warm_up"),
    ("hf_async_cb.engine.captured_graph", "CapturedGraph._record"),
]
PHASE_SECONDS: dict[str, float] = {}
PHASE_SPANS: list[tuple[str, float, float]] = []  # (phase, start, end) in perf_counter seconds, for a timeline
_installed = False


def time_phases() -> None:
    """Wrap every phase of PHASES that exists in this version (once per process)."""
    global _installed
    if _installed:
        return
    _installed = True
    for module_name, path in PHASES:
        try:
            owner = importlib.import_module(module_name)
            *parents, attr = path.split(".")
            for p in parents:
                owner = getattr(owner, p)
            original = getattr(owner, attr)
        except (ImportError, AttributeError):
            continue
        if isinstance(original, type):  # a class called by name: not timed
            continue
        setattr(owner, attr, _timed(original, path))


def _timed(fn, label: str):
    @functools.wraps(fn)
    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            end = time.perf_counter()
            PHASE_SECONDS[label] = PHASE_SECONDS.get(label, 0.0) + end - start
            PHASE_SPANS.append((label, start, end))
    return timed


def taken() -> dict[str, float]:
    """The phases' seconds so far, rounded, and the sums cleared."""
    found = {k: round(v, 3) for k, v in PHASE_SECONDS.items()}
    PHASE_SECONDS.clear()
    PHASE_SPANS.clear()
    return found


def timeline(since: float) -> list[tuple[str, float, float]]:
    """The phases recorded so far as (phase, start, end) in seconds after `since`, in order of start
    (what ran one after the other and what overlapped, where the sums of taken() cannot say)."""
    return sorted(((label, round(a - since, 3), round(b - since, 3)) for label, a, b in PHASE_SPANS),
                  key=lambda span: span[1])
