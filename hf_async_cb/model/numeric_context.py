"""The arithmetic a call runs its forward in, beside the weights: autocast and the matmul precisions.

Stock generate computes each call in the context it is made in: under `torch.autocast(dtype=bf16)`
an fp32 model multiplies in bf16, and `torch.set_float32_matmul_precision("high")` (or
`torch.backends.cuda.matmul.allow_tf32`) lets fp32 matmuls round through TF32. The engine computes
in that context too, but keeps things across calls that were computed in the context of an earlier
call: prefix-cache pages, the vision towers' outputs, and CUDA graphs, which fix the kernels (and
so the precision) of the step they captured. A later call in another context would have been given
K/V and graphs of the first, silently. So the context is read once per call (and per serving
admission) and is part of what these caches are keyed by: the prefix and tower caches through
model/kv_fingerprint.py, the CUDA graphs by Engine.check_caches, which drops them when it changes.

Autocast is per thread (a serving loop's thread runs without the caller's); the precision settings
are per process.
"""

from __future__ import annotations

import torch


def numeric_context(device_type: str) -> tuple:
    """What decides the rounding of a forward on `device_type` in this thread, beside the weights."""
    try:
        autocast = torch.is_autocast_enabled(device_type) and torch.get_autocast_dtype(device_type)
    except RuntimeError:  # a device type autocast does not know (meta): none
        autocast = False
    matmul = torch.backends.cuda.matmul
    return (autocast, torch.get_float32_matmul_precision(),
            matmul.allow_tf32, torch.backends.cudnn.allow_tf32, matmul.allow_fp16_reduced_precision_reduction,
            matmul.allow_bf16_reduced_precision_reduction, torch.are_deterministic_algorithms_enabled())
