"""StepMetadata: what every attention layer of one step needs to know about the packed batch."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class StepMetadata:
    """One packed step: B requests, T new tokens in total, all index tensors already on the device.

    Request i owns query tokens [query_start[i], query_start[i] + query_lens[i]) of the packed
    stream; after this step its cache holds context_lens[i] tokens, the last query_lens[i] of
    which are this step's. For attention the step is viewed as a padded batch [B, max_q] x
    [B, max_ctx] through index tensors (padding entries repeat a valid index).
    """

    slot_mapping: torch.Tensor  # [T] cache slot of each new token
    q_index: torch.Tensor  # [B, max_q] rows of the packed stream
    kv_index: torch.Tensor  # [B, max_ctx] cache slots of each request's context, in position order
    out_index: torch.Tensor  # [T] flat positions in [B * max_q] of the real query rows, packed order
    q_pos: torch.Tensor  # [B, max_q] absolute position of each query row
    q_valid: torch.Tensor  # [B, max_q], nonzero where the query row is real
    query_start: list[int]
    query_lens: list[int]
    context_lens: list[int]
    attention_calls: int = 0
    _masks: dict = field(default_factory=dict, repr=False)

    def begin_forward(self) -> None:
        """Forget per-forward state: a static (CUDA-graph) metadata is reused with new values."""
        self.attention_calls = 0
        self._masks.clear()

    def mask(self, sliding_window: int | None) -> torch.Tensor:
        """Bool [B, 1, max_q, max_ctx]: query at position p sees key k when k <= p (and p - k < window).

        Computed on the device, inside the step's compute (nothing of the step runs on another
        stream), once per step and window. Padding query rows see key 0 only, so
        that no row is fully masked (no NaN anywhere).
        """
        if sliding_window not in self._masks:
            k = torch.arange(self.kv_index.shape[1], device=self.kv_index.device)[None, None, :]
            p = self.q_pos[:, :, None]
            allowed = k <= p
            if sliding_window is not None:
                allowed &= (p - k) < sliding_window
            self._masks[sliding_window] = torch.where(self.q_valid[:, :, None].bool(), allowed, k == 0)[:, None]
        return self._masks[sliding_window]


def padded_layout(query_start: list[int], query_lens: list[int], context_lens: list[int]) -> dict[str, torch.Tensor]:
    """Host-side index math of the padded view (everything but kv_index, which needs the pages)."""
    ql = torch.tensor(query_lens)
    ctx = torch.tensor(context_lens)
    qs = torch.tensor(query_start)
    j = torch.arange(int(ql.max()))[None, :]
    q_valid = j < ql[:, None]
    rows = torch.arange(len(query_lens))[:, None] * j.shape[1] + j
    return {
        "q_index": qs[:, None] + torch.minimum(j, ql[:, None] - 1),
        "out_index": rows[q_valid],
        "q_pos": ctx[:, None] - ql[:, None] + j,
        "q_valid": q_valid.long(),
    }
