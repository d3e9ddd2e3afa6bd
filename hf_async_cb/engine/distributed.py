"""Tensor-parallel models: how the ranks' engines stay in step without a coordinator.

A model loaded with `from_pretrained(..., tp_plan="auto")` under torchrun runs its forward on every
rank: each holds its shard of the weights, its own query and KV heads (the engine's measured K/V
layout then sizes the pages for the rank's own heads), and the collectives transformers put into
the model keep the activations and the gathered logits identical on every rank.

Every rank runs its own engine over the same requests. Its schedule depends only on the requests,
the sampled tokens and the pool's size, so the engines agree step for step when three things agree,
which this module makes so:
- the pool: each rank sizes it from its own free memory; the smallest size wins (`agree_min`);
- the engine seed drawn for requests without one (`agree_seed`: rank 0's);
- the tokens: greedy picks and seeded draws from identical logits are identical.
A background loop (Engine.start) admits requests when they arrive, which no two ranks see at the
same step: it is refused on a tensor-parallel model.
"""

from __future__ import annotations

import torch

from hf_async_cb.model.checks import tensor_parallel_size


class TensorParallel:
    """The model's tensor-parallel process group, or None for a model on one device."""

    def __init__(self, group, size: int) -> None:
        self.group = group
        self.size = size

    @classmethod
    def of(cls, model: torch.nn.Module) -> "TensorParallel | None":
        mesh = getattr(model, "_device_mesh", None)
        size = tensor_parallel_size(model)
        if mesh is None or size <= 1 or not torch.distributed.is_initialized():
            return None
        try:
            group = mesh["tp"].get_group()
        except (KeyError, RuntimeError, ValueError):  # a mesh without a tp dimension: the whole mesh
            group = mesh.get_group()
        return cls(group, size)

    def _device(self) -> torch.device:
        """Collectives of this group's backend take tensors on this device (NCCL: the current GPU)."""
        backend = torch.distributed.get_backend(self.group)
        return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")

    def agree_min(self, value: int) -> int:
        """The smallest of every rank's `value`."""
        t = torch.tensor([value], dtype=torch.int64, device=self._device())
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def agree_seed(self, seed: int) -> int:
        """The group's first rank's `seed`, on every rank."""
        t = torch.tensor([seed], dtype=torch.int64, device=self._device())
        torch.distributed.broadcast(t, group_src=0, group=self.group)
        return int(t.item())
