"""StepMetadata: what every attention layer of one step needs to know about the packed batch."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class StepMetadata:
    """Describes one packed step: B requests, T new tokens in total.

    Request i owns query tokens [query_start[i], query_start[i] + query_lens[i]) of the packed
    stream; after this step its cache holds context_lens[i] tokens, the last query_lens[i] of
    which are this step's. `kv_slots[kv_start[i] : kv_start[i] + context_lens[i]]` are the cache
    slots of its whole context, in position order (used by the reference attention).
    """

    slot_mapping: torch.Tensor  # [T] int64, cache slot of each new token
    kv_slots: torch.Tensor  # [sum(context_lens)] int64
    query_start: list[int]
    query_lens: list[int]
    context_lens: list[int]
    kv_start: list[int]
    attention_calls: int = 0
    _masks: dict = field(default_factory=dict, repr=False)

    @property
    def num_requests(self) -> int:
        return len(self.query_lens)

    def masks(self, sliding_window: int | None, device: torch.device) -> list[torch.Tensor | None]:
        """Boolean [q_len, ctx] masks per request (None where attending to everything is right)."""
        key = sliding_window
        if key not in self._masks:
            self._masks[key] = [
                _causal_mask(q, c, sliding_window, device) for q, c in zip(self.query_lens, self.context_lens)
            ]
        return self._masks[key]


def _causal_mask(q_len: int, ctx: int, window: int | None, device: torch.device) -> torch.Tensor | None:
    """Query j sits at position ctx - q_len + j; it sees key k when k <= pos and pos - k < window."""
    if q_len == 1 and (window is None or ctx <= window):
        return None
    q_pos = torch.arange(ctx - q_len, ctx, device=device)[:, None]
    k_pos = torch.arange(ctx, device=device)[None, :]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= (q_pos - k_pos) < window
    return mask
