"""Host-side batch building: a StepPlan becomes the packed tensors of one forward.

No padding: the step's tokens form one stream [1, T] with explicit positions; logits are kept only
at the last token of each chunk that samples.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention.metadata import StepMetadata
from .requests import Request
from .sampling import SamplingTensors
from .scheduler import StepPlan


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T]
    logits_indices: torch.Tensor  # [S], rows of the stream whose logits are sampled
    meta: StepMetadata
    sampling: SamplingTensors | None  # None when every sampled row is greedy
    sample_requests: list[Request]  # row r of the sampled tokens belongs to sample_requests[r]


class BatchBuilder:
    def __init__(self, page_size: int, device: torch.device) -> None:
        self.page_size = page_size
        self.device = device
        self._offsets = torch.arange(page_size)

    def _slots(self, pages: list[int], start: int, stop: int) -> torch.Tensor:
        """Cache slots of positions [start, stop) of a request holding `pages`."""
        first, last = start // self.page_size, -(-stop // self.page_size)
        page_ids = torch.tensor(pages[first:last], dtype=torch.long)
        slots = (page_ids[:, None] * self.page_size + self._offsets).flatten()
        offset = first * self.page_size
        return slots[start - offset : stop - offset]

    def build(self, plan: StepPlan) -> StepInputs:
        ids: list[int] = []
        positions: list[torch.Tensor] = []
        new_slots: list[torch.Tensor] = []
        kv_slots: list[torch.Tensor] = []
        query_start, query_lens, context_lens, kv_start = [], [], [], []
        logits_rows: list[int] = []
        sample_requests: list[Request] = []
        kv_total = 0
        for chunk in plan.chunks:
            req, start, n = chunk.request, chunk.start, chunk.num_tokens
            stop = start + n
            query_start.append(len(ids))
            ids.extend(req.token_ids(start, stop))
            positions.append(torch.arange(start, stop))
            context = self._slots(req.pages, 0, stop)
            kv_slots.append(context)
            new_slots.append(context[start:])
            query_lens.append(n)
            context_lens.append(stop)
            kv_start.append(kv_total)
            kv_total += stop
            if chunk.samples:
                logits_rows.append(len(ids) - 1)
                sample_requests.append(req)
        dev = self.device
        meta = StepMetadata(
            slot_mapping=torch.cat(new_slots).to(dev),
            kv_slots=torch.cat(kv_slots).to(dev),
            query_start=query_start,
            query_lens=query_lens,
            context_lens=context_lens,
            kv_start=kv_start,
        )
        return StepInputs(
            input_ids=torch.tensor(ids, dtype=torch.long).to(dev)[None],
            position_ids=torch.cat(positions).to(dev)[None],
            logits_indices=torch.tensor(logits_rows, dtype=torch.long).to(dev),
            meta=meta,
            sampling=SamplingTensors.build([r.params for r in sample_requests], dev),
            sample_requests=sample_requests,
        )
