"""Our attention implementation, registered with transformers' AttentionInterface.

Models call registered attention functions as fn(module, query, key, value, attention_mask,
scaling=..., dropout=..., **forward_kwargs). Ours receives the layer's whole page pool as key and
value (from PagedKVCache.update) and the step's StepMetadata through the forward kwargs.

No mask function is registered on purpose: transformers skips building a dense mask for an
attention implementation that has none, and the paged attention derives causality (and sliding
windows) from the step metadata instead.
"""

from __future__ import annotations

import torch

from hf_async_cb.kernels.paged_attention_reference import paged_attention_reference
from hf_async_cb.model.step_metadata import StepMetadata

ATTENTION_NAME = "hf_async_cb_paged"
METADATA_KWARG = "hf_async_cb_step"


def paged_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    meta: StepMetadata | None = kwargs.get(METADATA_KWARG)
    if meta is None:
        raise RuntimeError(
            f"{type(module).__name__} called the {ATTENTION_NAME!r} attention without the engine's step "
            "metadata: this model does not pass its forward kwargs to the attention function, so the "
            "engine cannot run it."
        )
    if kwargs.get("softcap") is not None:
        raise ValueError("attention logit softcapping is not supported by hf_async_cb yet.")
    meta.attention_calls += 1
    if meta.backend == "triton":
        from hf_async_cb.kernels.paged_attention import paged_attention_triton

        out = paged_attention_triton(query, key, value, meta, scaling, kwargs.get("sliding_window"))
    else:
        out = paged_attention_reference(query, key, value, meta, scaling, kwargs.get("sliding_window"))
    return out, None


def resolve_backend(choice: str, device: torch.device) -> str:
    """BatchingConfig.attention -> the kernel the engine runs: "auto" takes the Triton kernels on
    CUDA when Triton is installed, the pure-torch reference otherwise."""
    if choice == "reference":
        return "reference"
    try:
        from hf_async_cb.kernels.paged_attention import runs_on
    except ImportError as e:
        if choice == "triton":
            raise ValueError(f"BatchingConfig(attention='triton') needs Triton: {e}") from e
        return "reference"
    if choice == "triton":
        if not runs_on(device):
            raise ValueError(
                "BatchingConfig(attention='triton') on the CPU runs only in Triton's interpreter: set "
                "TRITON_INTERPRET=1 before triton is first imported."
            )
        return "triton"
    return "triton" if device.type == "cuda" else "reference"


def register() -> None:
    """Register the attention function (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)


def unregister() -> None:
    from transformers import AttentionInterface

    AttentionInterface._global_mapping.pop(ATTENTION_NAME, None)


__all__ = ["ATTENTION_NAME", "METADATA_KWARG", "StepMetadata", "paged_attention_forward",
           "paged_attention_reference", "register", "resolve_backend", "unregister"]
