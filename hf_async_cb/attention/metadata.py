"""StepMetadata: what every attention layer of one step needs to know about the packed batch."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class PaddedLayout:
    """Index tensors that view the packed step as a padded [B, max_q] x [B, max_ctx] batch."""

    q_index: torch.Tensor  # [B, max_q] rows of the packed stream (padding repeats a valid row)
    kv_index: torch.Tensor  # [B, max_ctx] cache slots (padding repeats a valid slot)
    out_index: torch.Tensor  # [T] flat positions in [B * max_q] of the real query rows, packed order
    q_pos: torch.Tensor  # [B, max_q] absolute position of each query row
    q_valid: torch.Tensor  # [B, max_q] bool


@dataclass
class StepMetadata:
    """Describes one packed step: B requests, T new tokens in total.

    Request i owns query tokens [query_start[i], query_start[i] + query_lens[i]) of the packed
    stream; after this step its cache holds context_lens[i] tokens, the last query_lens[i] of
    which are this step's. `kv_slots[kv_start[i] : kv_start[i] + context_lens[i]]` are the cache
    slots of its whole context, in position order.
    """

    slot_mapping: torch.Tensor  # [T] int64, cache slot of each new token
    kv_slots: torch.Tensor  # [sum(context_lens)] int64
    query_start: list[int]
    query_lens: list[int]
    context_lens: list[int]
    kv_start: list[int]
    attention_calls: int = 0
    _layout: PaddedLayout | None = field(default=None, repr=False)
    _masks: dict = field(default_factory=dict, repr=False)

    @property
    def num_requests(self) -> int:
        return len(self.query_lens)

    def padded(self) -> PaddedLayout:
        """Built once per step (host index math, one copy to the device), shared by all layers."""
        if self._layout is None:
            device = self.kv_slots.device
            ql = torch.tensor(self.query_lens)
            ctx = torch.tensor(self.context_lens)
            qs = torch.tensor(self.query_start)
            ks = torch.tensor(self.kv_start)
            max_q, max_ctx = int(ql.max()), int(ctx.max())
            j = torch.arange(max_q)[None, :]
            q_valid = j < ql[:, None]
            q_pos = ctx[:, None] - ql[:, None] + j
            q_index = qs[:, None] + torch.minimum(j, ql[:, None] - 1)
            k = torch.arange(max_ctx)[None, :]
            kv_flat = ks[:, None] + torch.minimum(k, ctx[:, None] - 1)
            rows = torch.arange(len(self.query_lens))[:, None] * max_q + j
            out_index = rows[q_valid]
            self._layout = PaddedLayout(
                q_index=q_index.to(device),
                kv_index=self.kv_slots[kv_flat.to(device)],
                out_index=out_index.to(device),
                q_pos=q_pos.to(device),
                q_valid=q_valid.to(device),
            )
        return self._layout

    def mask(self, sliding_window: int | None) -> torch.Tensor:
        """Bool [B, 1, max_q, max_ctx]: query at position p sees key k when k <= p (and p - k < window).

        Padding query rows see key 0 only, so that no row is fully masked (no NaN anywhere).
        """
        if sliding_window not in self._masks:
            lay = self.padded()
            k = torch.arange(lay.kv_index.shape[1], device=lay.kv_index.device)[None, None, :]
            p = lay.q_pos[:, :, None]
            allowed = k <= p
            if sliding_window is not None:
                allowed &= (p - k) < sliding_window
            valid = lay.q_valid[:, :, None]
            self._masks[sliding_window] = torch.where(valid, allowed, k == 0)[:, None]
        return self._masks[sliding_window]
