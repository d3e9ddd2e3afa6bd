"""What the K/V of a cached prefix depends on beyond its tokens, read cheaply once per call.

The prefix cache (engine/prefix_cache.py) must never hand out K/V that the model would no longer
compute. A call compares this fingerprint with the last one and empties the cache on a change:

- the weights' version counters: an optimizer step, `load_state_dict`, `copy_`, any in-place write
  through autograd's view of a parameter or buffer bumps them (no pass over the weights: one
  attribute per tensor). Writes through `.data` bump nothing: `clear_prefix_cache()` is for those;
- the storages (a reassigned `.data`, `.to()`); the runtime rebuilds on those anyway;
- each adapter layer's state (PEFT: the active adapters, disabled, merged), which switches without
  touching a weight.

Tensors made under `torch.inference_mode()` keep no version counter: for such a model the
fingerprint is None, "unknown", and the cache lives for one call only.
"""

from __future__ import annotations

import torch

from hf_async_cb.model.weight_kinds import storage_key


def kv_fingerprint(model: torch.nn.Module) -> tuple | None:
    """A value that changes whenever the K/V `model` computes for given tokens may have; None when
    that cannot be told (inference tensors)."""
    try:
        tensors = [*model.parameters(), *model.buffers()]
        versions = sum(t._version for t in tensors)
    except RuntimeError:  # "Inference tensors do not track version counter"
        return None
    storages = tuple(storage_key(t) for t in tensors)  # (a quantized subclass's inner tensors')
    return versions, hash(storages), _adapter_state(model)


def _adapter_state(model: torch.nn.Module) -> tuple:
    return _states(m for m in model.modules() if "_active_adapter" in m.__dict__)  # (PEFT tuner layers)


def _states(adapters) -> tuple:
    return tuple((id(m), str(m.__dict__["_active_adapter"]), m.__dict__.get("_disable_adapters"),
                  tuple(m.__dict__.get("merged_adapters", ()))) for m in adapters)


class WeightVersions:
    """The weights' version counters and the adapter layers' states of a model whose modules stay
    as they are (a serving loop's): the tensors and adapter layers listed once, so that a read costs
    one attribute per tensor (about 25 us for an 8B model), cheap enough for every admission. Views
    share their base's counter, so writes through the user's parameters are seen while fused
    modules are attached. None: inference tensors, which keep no counter."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._tensors = [*model.parameters(), *model.buffers()]
        self._adapters = [m for m in model.modules() if "_active_adapter" in m.__dict__]

    def read(self) -> tuple | None:
        try:
            versions = sum(t._version for t in self._tensors)
        except RuntimeError:
            return None
        return versions, _states(self._adapters)
