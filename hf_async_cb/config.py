"""BatchingConfig: every knob of the engine in one validated dataclass."""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

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
        the GPU memory free after the weights and the steps' activations on CUDA,
        `cpu_kv_cache_bytes` on the CPU. (generate() sizes its pool to each call instead.)
    max_batch_tokens: token budget of one step (decode tokens + prefill chunk tokens). Prompts
        longer than this are prefilled in chunks. None: sized to the device (`for_device`): on
        CUDA 8192 tokens with 70 GiB of memory or more, 4096 with 32 GiB or more, 2048 below;
        512 on the CPU.
    kv_memory_fraction: the share of free GPU memory the KV pool may take. None: 0.9 (the pool
        always leaves room for the activations of the widest step, see Engine).
    mixed_prefill_tokens: at most this many prompt tokens in a step that also decodes (None: the
        whole budget). Lower values keep decoding requests' inter-token latency steady while long
        prompts arrive, at the cost of their time to first token.
    max_running_requests: requests that run at once (a request whose last token is still being
        sampled gives its place to a waiting one before its pages are freed).
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
    skinny_gemm: run decode-step projections (at most 256 rows) through the skinny GEMM kernel
        (kernels/skinny_gemm.py) for each shape where the GPU measured it faster than cuBLAS
        (model/decode_gemm.py). None: on CUDA, with the choices already recorded (on disk, at
        $HF_ASYNC_CB_CACHE or ~/.cache/hf_async_cb/gemm_choices.json); shapes never measured run
        cuBLAS. True: also measure the model's shapes not yet recorded, at warm-up (seconds per
        shape, once per GPU and Triton version). False: cuBLAS only.
    progress: a tqdm progress bar over the requests of generate()/Engine.generate (tokens/s beside);
        a string turns it on and is its label (e.g. which run it is), "hf_async_cb" otherwise.
    cuda_graphs: replay decode steps (greedy or seeded sampling, the engine's own logits processors
        included; user processors run eagerly) from CUDA graphs, one per (batch, context) bucket,
        captured on first use. None: on CUDA. On the CPU, True runs the same padded static-buffer
        path eagerly (for tests).
    prefill_graphs: with cuda_graphs, replay prefill and mixed steps from graphs too (up to
        16 buckets of token count, batch and context; on CUDA with the Triton attention only).
    prefix_caching: requests sharing a prompt prefix compute its K/V once: a full page of prompt
        (or of generated tokens, once its request finished) stays cached, named by its tokens and
        those before it, until its pool space is needed (least recently used first), within a
        call, across generate() calls on the same model and for requests added online. The cache
        is emptied when the model's weights are written in place (their version counters), an
        adapter is switched, enabled or disabled, or a step fails; `Engine.clear_prefix_cache()` /
        `hf_async_cb.clear_prefix_cache(model)` empty it by hand (after writing weights through
        `.data`, which no version counter sees). Counters: `Engine.prefix_cache_stats()`.
    image_cache_bytes: with prefix_caching, a vision-language model's tower outputs per image are
        kept up to this many bytes on the model's device (least recently used evicted first), so an
        image a later call or request sends again (a chat's next turn, an RL epoch) is not encoded
        again; emptied with the prefix cache. 0 turns it off.
    late_admission: the async serving loop (Engine.start) builds each step as late as the step
        running allows, instead of right after the one before it finished, so that a request arriving
        meanwhile joins the next step (engine/late_admission.py): one step sooner to its first
        token, which is what kept the async loop's TTFT above sync's at light load (H100, 8B,
        ShareGPT-like: TTFT p50 at 4 / 16 req/s 19.0 -> 14.1 / 22.0 -> 15.9 ms, sync 13.9 / 16.9;
        ITL and E2E the same or better; at 64 req/s, requests queue and it waits little: within 1%
        E2E; docs/benchmarks.md). False builds each step as soon as the one before it finished.
    """

    mode: str = "async"
    page_size: int = 16
    num_pages: int | None = None
    max_batch_tokens: int | None = None
    max_running_requests: int = 256
    mixed_prefill_tokens: int | None = None
    kv_memory_fraction: float | None = None
    cpu_kv_cache_bytes: int = 512 * 1024**2
    seed: int | None = None
    attention: str = "auto"
    trust_untested_model: bool = False
    cuda_graphs: bool | None = None
    prefill_graphs: bool = True
    prefix_caching: bool = True
    image_cache_bytes: int = 256 * 1024**2
    late_admission: bool = True
    fuse_projections: bool | None = None
    fuse_elementwise: bool | None = None
    skinny_gemm: bool | None = None
    progress: bool | str = False
    profile: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field's type and range (a ValueError naming the field), so that a bad value
        fails here and not deep in the engine; integral numpy scalars become ints, fractions floats."""
        if not isinstance(self.mode, str) or self.mode not in MODES:
            raise ValueError(f"BatchingConfig.mode must be one of {MODES}, got {self.mode!r}.")
        for name in ("page_size", "max_running_requests", "cpu_kv_cache_bytes"):
            setattr(self, name, _positive_int(name, getattr(self, name)))
        for name in ("num_pages", "max_batch_tokens", "mixed_prefill_tokens"):
            if getattr(self, name) is not None:
                setattr(self, name, _positive_int(name, getattr(self, name)))
        if not _is_int(self.image_cache_bytes) or self.image_cache_bytes < 0:
            raise ValueError(f"BatchingConfig.image_cache_bytes must be an integer >= 0, got {self.image_cache_bytes!r}.")
        self.image_cache_bytes = int(self.image_cache_bytes)
        fraction = self.kv_memory_fraction
        if fraction is not None:
            if not _is_real(fraction) or not 0.0 < fraction <= 1.0:
                raise ValueError(f"BatchingConfig.kv_memory_fraction must be None or a number in (0, 1], "
                                 f"got {fraction!r}.")
            self.kv_memory_fraction = float(fraction)
        if self.seed is not None:
            if not _is_int(self.seed) or not 0 <= self.seed < 2**63:
                raise ValueError(f"BatchingConfig.seed must be None or an integer in [0, 2**63), got {self.seed!r}.")
            self.seed = int(self.seed)
        if not isinstance(self.attention, str) or self.attention not in ATTENTION_BACKENDS:
            raise ValueError(
                f"BatchingConfig.attention must be one of {ATTENTION_BACKENDS}, got {self.attention!r}."
            )
        for name in ("trust_untested_model", "prefill_graphs", "prefix_caching", "profile", "late_admission"):
            _bool(name, getattr(self, name), optional=False)
        if isinstance(self.progress, str) and self.progress.strip().lower() in _FLAG_WORDS:
            raise ValueError(f"BatchingConfig.progress must be True, False or a label for the bar, got "
                             f"{self.progress!r}: a flag spelled as text is ambiguous, pass True or False.")
        if not (isinstance(self.progress, str) and self.progress):  # a label, or a flag
            _bool("progress", self.progress, optional=False)
        for name in ("cuda_graphs", "fuse_projections", "fuse_elementwise", "skinny_gemm"):
            _bool(name, getattr(self, name), optional=True)

    def to_dict(self) -> dict:
        """The fields as a plain dict. transformers serialises a dataclass on a GenerationConfig
        (`generation_config.batching_config = BatchingConfig(...)`) through its to_dict(), and
        writes null for one without: saved and loaded, the config then ran stock silently. The
        dict form is what `batching_config` takes back."""
        return asdict(self)

    def with_mode(self, mode: str) -> "BatchingConfig":
        return replace(self, mode=mode)

    def for_device(self, device) -> "BatchingConfig":
        """This config with the fields left to the device (None) decided for `device` (see the
        field docs): what an Engine runs with. Unchanged fields stay as the user set them."""
        if self.max_batch_tokens is not None and self.kv_memory_fraction is not None:
            return self
        return replace(self, max_batch_tokens=self.max_batch_tokens or default_batch_tokens(device),
                       kv_memory_fraction=self.kv_memory_fraction or DEFAULT_KV_MEMORY_FRACTION)


# progress="no" reads as "off" but would be a label: refused, with every other flag spelled as text.
_FLAG_WORDS = frozenset({"yes", "no", "true", "false", "on", "off", "0", "1", "none"})
DEFAULT_KV_MEMORY_FRACTION = 0.9
CPU_BATCH_TOKENS = 512
# (GiB of device memory at least, step token budget): a large budget prefills long prompts in few,
# compute-bound steps; smaller GPUs keep it smaller to leave the KV pool room for the activations.
GPU_BATCH_TOKENS = ((70, 8192), (32, 4096), (0, 2048))


def default_batch_tokens(device) -> int:
    """The step token budget for `device` when BatchingConfig.max_batch_tokens is None."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return CPU_BATCH_TOKENS
    gib = torch.cuda.get_device_properties(device).total_memory / 2**30
    return next(tokens for at_least, tokens in GPU_BATCH_TOKENS if gib >= at_least)


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


_LOGGED_DEFAULTS: set = set()


def log_device_defaults(config: BatchingConfig, resolved: BatchingConfig, device) -> None:
    """Say once per device and choice what the device-sized defaults (`for_device`) came to."""
    chosen = {name: getattr(resolved, name) for name in ("max_batch_tokens", "kv_memory_fraction")
              if getattr(config, name) is None}
    key = (str(device), tuple(chosen.items()))
    if key not in _LOGGED_DEFAULTS:
        _LOGGED_DEFAULTS.add(key)
        logger.info("hf_async_cb: defaults for %s: %s", device,
                    ", ".join(f"{name}={value}" for name, value in chosen.items()))
