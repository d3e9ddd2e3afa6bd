"""Errors raised from inside a generation step, made actionable for the caller."""

from __future__ import annotations

import torch

from hf_async_cb.config import BatchingConfig

# What libraries that allocate on their own (cuBLAS, cuDNN, the driver) say when memory runs out:
# torch raises these as plain RuntimeErrors, not as OutOfMemoryError.
_OUT_OF_MEMORY_MARKERS = ("out of memory", "CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_ALLOC_FAILED")


def is_out_of_memory(error: BaseException) -> bool:
    if isinstance(error, torch.OutOfMemoryError):
        return True
    return isinstance(error, RuntimeError) and any(m.lower() in str(error).lower() for m in _OUT_OF_MEMORY_MARKERS)


def explain_out_of_memory(error: BaseException, config: BatchingConfig) -> BaseException:
    """An out-of-memory error inside a step (the allocator's, or a library's that ran out), re-raised
    as torch.OutOfMemoryError with what to change; any other error unchanged. The engine itself
    stays usable: the step's requests are aborted and their pages freed before this is raised."""
    if not is_out_of_memory(error):
        return error
    return torch.OutOfMemoryError(
        f"{error} -- out of memory inside a generation step (its requests were aborted, the engine is still "
        f"usable). Give the step less room: a smaller BatchingConfig.max_batch_tokens (now "
        f"{config.max_batch_tokens}) or max_running_requests (now {config.max_running_requests}), or a smaller KV "
        f"pool (kv_memory_fraction, now {config.kv_memory_fraction}; or num_pages)."
    )
