"""IOSlot: one of the two alternating buffer sets of the pipeline.

Each slot owns a pinned host staging buffer and a device buffer for the step's inputs (all the
small integer tensors packed into one, so that a step costs one H2D copy; the sampling floats in
a second, only when a row samples), and a pinned host buffer for the sampled tokens coming back.
Steps alternate between slots, so building step N+1 never overwrites a buffer step N still reads.
A slot is reused only after the CPU waited for its previous step's D2H event, which orders every
copy and kernel of that step before the reuse.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from hf_async_cb.devices import Streams


class _Staging:
    """A growable pinned host buffer and its device twin."""

    def __init__(self, streams: Streams, dtype: torch.dtype, capacity: int) -> None:
        self.streams = streams
        self.dtype = dtype
        self._alloc(capacity)

    def _alloc(self, capacity: int) -> None:
        self.host = self.streams.pin(torch.empty(capacity, dtype=self.dtype))
        self.host_array = self.host.numpy()  # the same memory, for numpy to pack into
        self.device = torch.empty(capacity, dtype=self.dtype, device=self.streams.device)

    def upload(self, arrays: list) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Pack host arrays (numpy, or CPU tensors), copy them up in one non-blocking H2D (on the
        current stream); return the device views and the packed device buffer they are views of.
        The packing is one numpy concatenate: a handful of small torch ops cost more than the copy."""
        arrays = [a.numpy() if isinstance(a, torch.Tensor) else a for a in arrays]
        sizes = [a.size for a in arrays]
        total = sum(sizes)
        if total > self.host.numel():
            self._alloc(max(total, 2 * self.host.numel()))
        np.concatenate(arrays, axis=None, out=self.host_array[:total], casting="unsafe")
        if self.streams.is_cuda:
            self.device[:total].copy_(self.host[:total], non_blocking=True)
            flat = self.device[:total]
        else:
            # The CPU "device" copy (later slots must not alias it), by numpy: torch would split a
            # large one over its intra-op threads, which costs more than it saves at this size.
            flat = torch.from_numpy(self.host_array[:total].copy())
        return [view if a.ndim == 1 else view.view(a.shape) for view, a in zip(flat.split(sizes), arrays)], flat


@dataclass
class Download:
    """Sampled tokens (and their log-probabilities) of one step on their way to the host."""

    host: torch.Tensor  # pinned [2, S] int64, as sampling.pack lays it out
    done: object  # event recorded on the D2H stream after the copy

    def tolist(self) -> tuple[list[int], list[float]]:
        self.done.synchronize()  # the one place the CPU blocks in a step
        return self.host[0].tolist(), self.host[1].view(torch.float64).tolist()


class IOSlot:
    def __init__(self, streams: Streams, capacity: int = 1 << 14) -> None:
        self.streams = streams
        self.ints = _Staging(streams, torch.int64, capacity)
        self.floats = _Staging(streams, torch.float32, 256)
        self._tokens = streams.pin(torch.empty(256, dtype=torch.int64))
        self.uploaded = streams.event()

    def upload(self, ints: list[torch.Tensor], floats: list[torch.Tensor]) -> tuple[list, list, tuple]:
        """All of a step's inputs up on the H2D stream; `uploaded` marks their arrival. Returns the
        device views of `ints` and `floats`, and the two packed buffers (None for no floats)."""
        with self.streams.on(self.streams.h2d):
            dev_ints, packed_ints = self.ints.upload(ints)
            dev_floats, packed_floats = self.floats.upload(floats) if floats else ([], None)
            self.uploaded.record()
        return dev_ints, dev_floats, (packed_ints, packed_floats)

    def download(self, sampled: torch.Tensor, computed) -> Download:
        """Copy a step's packed [2, S] output down on the D2H stream once `computed` has fired."""
        n = sampled.numel()
        if n > self._tokens.numel():
            self._tokens = self.streams.pin(torch.empty(max(n, 2 * self._tokens.numel()), dtype=torch.int64))
        host = self._tokens[:n].view(sampled.shape)
        done = self.streams.event()
        with self.streams.on(self.streams.d2h):
            computed.wait()
            host.copy_(sampled, non_blocking=True)
            done.record()
        return Download(host, done)
