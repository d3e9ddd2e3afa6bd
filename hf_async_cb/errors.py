"""Errors raised from inside a generation step, made actionable for the caller."""

from __future__ import annotations

import torch

from .config import BatchingConfig


def explain_out_of_memory(error: BaseException, config: BatchingConfig) -> BaseException:
    """An out-of-memory error inside a step, re-raised as the same type with what to change; any
    other error unchanged. The engine itself stays usable: the step's requests are aborted and
    their pages freed before this is raised."""
    if not isinstance(error, torch.OutOfMemoryError):
        return error
    return torch.OutOfMemoryError(
        f"{error} -- out of memory inside a generation step (its requests were aborted, the engine is still "
        f"usable). Give the step less room: a smaller BatchingConfig.max_batch_tokens (now "
        f"{config.max_batch_tokens}) or max_running_requests (now {config.max_running_requests}), or a smaller KV "
        f"pool (kv_memory_fraction, now {config.kv_memory_fraction}; or num_pages)."
    )
