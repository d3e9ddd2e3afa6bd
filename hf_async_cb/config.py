"""BatchingConfig: every knob of the engine in one validated dataclass."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

MODES = ("sync", "async")
OFF_MODES = (None, "off")
ATTENTION_BACKENDS = ("auto", "reference", "triton")


@dataclass
class BatchingConfig:
    """How the continuous-batching engine runs.

    mode: "sync" (the baseline loop: the CPU waits for every step) or "async" (the pipelined
        loop: the CPU prepares step N+1 while the device computes step N).
    page_size: tokens per KV-cache page.
    num_pages: pages in the KV pool. None sizes the pool from memory: `kv_memory_fraction` of
        the free GPU memory on CUDA, `cpu_kv_cache_bytes` on the CPU.
    max_batch_tokens: token budget of one step (decode tokens + prefill chunk tokens). Prompts
        longer than this are prefilled in chunks.
    max_running_requests: requests that hold KV pages at once.
    seed: the engine seed: a sampled request without a seed of its own gets one derived from it and
        from its index in the generate call (or its submission order online), so that its tokens
        do not depend on its batch mates. None: drawn from torch's global generator per call.
    attention: "auto" runs the Triton paged-attention kernels on CUDA (when Triton is installed)
        and the pure-torch reference elsewhere; "reference" forces the pure-torch one; "triton"
        forces the kernels (on the CPU only under Triton's interpreter, TRITON_INTERPRET=1).
    trust_untested_model: skip the parity check that a model family's logits on the engine match its
        own forward (engine/parity.py; docs/api.md).
    profile: record each step's CPU spans (and GPU spans on CUDA) into Engine.last_profile
        (see engine/profiling.py).
    fuse_projections: run each layer's q/k/v (and gate/up) projections as one GEMM over their
        concatenated weights (model/fusion.py; the model's own weights become views, nothing is copied
        twice). None: on CUDA only. Engine.close() restores the model.
    fuse_elementwise: run RMSNorm, rotary embeddings and the MLP's SiLU-mul as one Triton kernel
        each, rounding as torch does (kernels/elementwise.py). None: on CUDA only. Engine.close() restores.
    progress: a tqdm progress bar over the requests of generate()/Engine.generate (tokens/s beside).
    cuda_graphs: replay decode steps (greedy or seeded sampling, the engine's own logits processors
        included; user processors run eagerly) from CUDA graphs, one per (batch, context) bucket,
        captured on first use. None: on CUDA. On the CPU, True runs the same padded static-buffer
        path eagerly (for tests).
    prefill_graphs: with cuda_graphs, replay prefill and mixed steps from graphs too (up to
        16 buckets of token count, batch and context; on CUDA with the Triton attention only).
    """

    mode: str = "async"
    page_size: int = 16
    num_pages: int | None = None
    max_batch_tokens: int = 512
    max_running_requests: int = 256
    kv_memory_fraction: float = 0.5
    cpu_kv_cache_bytes: int = 512 * 1024**2
    seed: int | None = None
    attention: str = "auto"
    trust_untested_model: bool = False
    cuda_graphs: bool | None = None
    prefill_graphs: bool = True
    fuse_projections: bool | None = None
    fuse_elementwise: bool | None = None
    progress: bool = False
    profile: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field's type and range (a ValueError naming the field), so that a bad value
        fails here and not deep in the engine; integral numpy scalars become ints, fractions floats."""
        if not isinstance(self.mode, str) or self.mode not in MODES:
            raise ValueError(f"BatchingConfig.mode must be one of {MODES}, got {self.mode!r}.")
        for name in ("page_size", "max_batch_tokens", "max_running_requests", "cpu_kv_cache_bytes"):
            setattr(self, name, _positive_int(name, getattr(self, name)))
        if self.num_pages is not None:
            self.num_pages = _positive_int("num_pages", self.num_pages)
        fraction = self.kv_memory_fraction
        if not _is_real(fraction) or not 0.0 < fraction <= 1.0:
            raise ValueError(f"BatchingConfig.kv_memory_fraction must be a number in (0, 1], got {fraction!r}.")
        self.kv_memory_fraction = float(fraction)
        if self.seed is not None:
            if not _is_int(self.seed) or not 0 <= self.seed < 2**63:
                raise ValueError(f"BatchingConfig.seed must be None or an integer in [0, 2**63), got {self.seed!r}.")
            self.seed = int(self.seed)
        if not isinstance(self.attention, str) or self.attention not in ATTENTION_BACKENDS:
            raise ValueError(
                f"BatchingConfig.attention must be one of {ATTENTION_BACKENDS}, got {self.attention!r}."
            )
        for name in ("trust_untested_model", "prefill_graphs", "progress", "profile"):
            _bool(name, getattr(self, name), optional=False)
        for name in ("cuda_graphs", "fuse_projections", "fuse_elementwise"):
            _bool(name, getattr(self, name), optional=True)

    def with_mode(self, mode: str) -> "BatchingConfig":
        return replace(self, mode=mode)


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))


def _positive_int(name: str, value: Any) -> int:
    if not _is_int(value) or value <= 0:
        raise ValueError(f"BatchingConfig.{name} must be a positive integer, got {value!r}.")
    return int(value)


def _bool(name: str, value: Any, optional: bool) -> None:
    """A flag is True or False (None too where it means "decide from the device"): a string such as
    'no' would otherwise read as true."""
    if not (isinstance(value, bool) or (optional and value is None)):
        allowed = "True, False or None" if optional else "True or False"
        raise ValueError(f"BatchingConfig.{name} must be {allowed}, got {value!r}.")


def resolve_mode(value: Any) -> str | None:
    """Normalise a user's `batching=` value: None/"off" -> None, else "sync" or "async"."""
    if value in OFF_MODES:
        return None
    if isinstance(value, str) and value in MODES:
        return value
    valid = ", ".join(repr(v) for v in (None, "off", *MODES))
    raise ValueError(f"batching must be one of {valid}; got {value!r}.")
