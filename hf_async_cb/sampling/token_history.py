"""The token pool: every token the model has been fed, kept on the device next to its K/V.

`TokenHistory.tokens` has one entry per KV slot (page * page_size + offset, the slot space of
`StepMetadata.slot_mapping`, the trash page of CUDA-graph padding rows included). Every step
writes its input ids there, after carry-over has put the real token in place of each placeholder,
so the pool always holds what the K/V pool holds. A request's history is then read through the
block table the step uploads anyway: no token list travels from the host per step, and shared
prompt pages (num_return_sequences), preemption and recomputation need nothing of their own.

History-based logits processors (device_processors.py) read a few rows' histories as one dense, right-
aligned `[R, width]` tensor: the row's extra prefix (stock generate's left padding, which some
processors read as part of the row) followed by its context tokens, and -1 before its start.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_async_cb.model.step_metadata import StepMetadata

BEFORE_START = -1  # a history cell left of the row's first token: equal to no token id


@dataclass
class RowHistories:
    """Histories of R rows: `tokens[r, width - length[r]:]` is row r's history, oldest first."""

    tokens: torch.Tensor  # [R, width] int64, BEFORE_START left of each row's history
    length: torch.Tensor  # [R] int64
    index: torch.Tensor  # [R, width] int64, history index of each cell (negative before the start)

    @property
    def width(self) -> int:
        return self.tokens.shape[1]


class TokenHistory:
    def __init__(self, num_slots: int, device: torch.device) -> None:
        self.tokens = torch.zeros(num_slots, dtype=torch.int64, device=device)

    def record(self, slot_mapping: torch.Tensor, input_ids: torch.Tensor) -> None:
        """Write a step's input ids [T] at their cache slots [T] (on the step's stream, before it reads)."""
        self.tokens.index_copy_(0, slot_mapping, input_ids)

    def copy_slots(self, source: torch.Tensor, destination: torch.Tensor) -> None:
        """The tokens at slots `source` [N] written again at `destination` [N] (a copied page's)."""
        self.tokens.index_copy_(0, destination, self.tokens.index_select(0, source))

    def rows(self, meta: StepMetadata, batch_rows: torch.Tensor, prefix: torch.Tensor,
             prefix_len: torch.Tensor) -> RowHistories:
        """Histories of the step's requests `batch_rows` [R]: `prefix` [R, P] (first prefix_len[r]
        tokens of row r valid) followed by the request's context_lens tokens, read through the
        block table. Shapes depend only on R, P and the step's context bucket (no host sync)."""
        num_prefix = prefix.shape[1]
        width = num_prefix + meta.max_context
        length = prefix_len + meta.context_lens[batch_rows]
        columns = torch.arange(width, device=prefix.device)
        index = columns[None, :] - (width - length)[:, None]  # history index of each cell
        position = (index - prefix_len[:, None]).clamp(min=0)  # context position (<= context - 1)
        page = meta.page_size
        slots = meta.block_table[batch_rows].gather(1, position // page) * page + position % page
        tokens = self.tokens[slots]
        if num_prefix:
            from_prefix = prefix.gather(1, index.clamp(0, num_prefix - 1))
            tokens = torch.where(index < prefix_len[:, None], from_prefix, tokens)
        return RowHistories(tokens=torch.where(index >= 0, tokens, BEFORE_START), length=length, index=index)
