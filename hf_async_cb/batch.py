"""Host-side batch building: a StepPlan becomes the packed device tensors of one forward.

No padding: the step's tokens form one stream [1, T] with explicit positions; logits are kept only
at the last token of each chunk that samples. A token the CPU does not know yet (sampled by the
step still in flight) is written as a placeholder, with `carry_src` naming its row in that step's
sampled tokens; the runner gathers it on the device before the forward. Processors that read a
request's history get only per-row values from here (penalties.HostProcessors): the histories
themselves are on the device already (history.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from .attention.metadata import StepMetadata
from .page_table import PageTable
from .penalties import HistoryProcessors, HostProcessors, TokenBlock
from .requests import Request, SamplingParams
from .sampling import SamplingTensors
from .scheduler import StepPlan
from .slots import IOSlot

PLACEHOLDER = 0
_GREEDY = SamplingParams()
CONTEXT_BUCKET = 64


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [1, T], placeholders where carried
    carry_src: torch.Tensor | None  # [T], row of the previous step's tokens, -1 = known; None = nothing carried
    position_ids: torch.Tensor  # [1, T]
    logits_indices: torch.Tensor  # [S], rows of the stream whose logits are sampled
    meta: StepMetadata
    sampling: SamplingTensors | None  # None when every sampled row is greedy
    sample_requests: list[Request]  # row r of the sampled tokens belongs to sample_requests[r]
    # Slow path: (row, processor, host history, row of its last token in the previous step or -1).
    processor_rows: list[tuple[int, object, torch.Tensor, int]]
    # Slow path: rows whose raw logits and processed scores go back to the host (output_scores/logits).
    keep_rows: list[int] = field(default_factory=list)
    kept: tuple[torch.Tensor, torch.Tensor] | None = None  # (raw logits, processed scores) of keep_rows
    processors: HistoryProcessors | None = None  # rows whose processors read their history, else None
    token_block: TokenBlock | None = None  # tokens some rows may not sample this step, else None
    # The two device buffers every tensor above was uploaded in (int64, float32 or None): a CUDA
    # graph loads a step with one copy of each.
    packed: tuple[torch.Tensor, torch.Tensor | None] | None = None


def _ints(values) -> torch.Tensor:
    """int64 tensor of a Python list (numpy converts lists several times faster than torch.tensor)."""
    return torch.from_numpy(np.array(values, dtype=np.int64))


def _split(items: list, *sizes: int) -> list[list]:
    """items cut into consecutive parts of the given sizes, and the rest."""
    parts, start = [], 0
    for size in sizes:
        parts.append(items[start:start + size])
        start += size
    return [*parts, items[start:]]


class BatchBuilder:
    def __init__(self, page_size: int, trash_slot: int, page_table: PageTable,
                 attention_backend: str = "reference") -> None:
        """`trash_slot`: the first slot of a page outside the pool, written by padding rows, never read.
        `page_table`: the scheduler's mirror of the running requests' pages (the block tables' source)."""
        self.page_size = page_size
        self.attention_backend = attention_backend
        self.trash_page = trash_slot // page_size
        self.page_table = page_table

    def _slots(self, table: np.ndarray, query_start, query_lens, context_lens):
        """Position and cache slot of each new token, from the block table, in a few numpy ops
        (torch's small CPU ops cost microseconds each; repeat_interleave far more)."""
        ps = self.page_size
        ql = np.array(query_lens, dtype=np.int64)
        ctx = np.array(context_lens, dtype=np.int64)
        if len(ql) == int(ql.sum()):  # decode: one token per request, at its last position
            rows, positions = np.arange(len(ql)), ctx - 1
        else:
            rows = np.repeat(np.arange(len(ql)), ql)
            positions = (ctx - ql)[rows] + np.arange(len(rows)) - np.array(query_start, dtype=np.int64)[rows]
        slot_mapping = table[rows, positions // ps] * ps + positions % ps
        return torch.from_numpy(positions), torch.from_numpy(slot_mapping)

    def build(self, plan: StepPlan, slot: IOSlot, carry_rows: dict[int, int],
              pad_to: tuple[int, int, int] | None = None) -> StepInputs:
        """`carry_rows` maps id(request) -> its row in the sampled tokens of the step in flight.

        `pad_to` = (batch, context, tokens): a step padded to a CUDA-graph bucket (tokens 0: a decode
        step, one token per request). Padding requests write to and read from the trash page: one
        token each, the last one all the tokens left. Logits rows are padded to `batch` too.
        """
        ids: list[int] = []
        carry: list[int] = []
        query_start, query_lens, context_lens = [], [], []
        logits_rows: list[int] = []
        sample_requests: list[Request] = []
        processor_rows: list[tuple[int, object, torch.Tensor, int]] = []
        history_rows: list[tuple[int, int, Request]] = []  # (sampled row, batch row, request)
        blocked: list[tuple[int, tuple[int, ...]]] = []
        for batch_row, chunk in enumerate(plan.chunks):
            req, start, n = chunk.request, chunk.start, chunk.num_tokens
            stop = start + n
            prompt, output = req.prompt_token_ids, req.output_token_ids
            n_prompt = len(prompt)
            known = min(stop, n_prompt + len(output))
            query_start.append(len(ids))
            if known - start == 1:  # the common decode step: one known token
                ids.append(prompt[start] if start < n_prompt else output[start - n_prompt])
                carry.append(-1)
            elif known > start:
                ids.extend(req.token_ids(start, known))
                carry.extend([-1] * (known - start))
            if stop > known:  # the last token is still on its way from the step in flight
                row = carry_rows.get(id(req))
                if stop - known != 1 or row is None:
                    raise RuntimeError(f"{req.request_id}: tokens [{known}, {stop}) are neither known nor in flight")
                ids.append(PLACEHOLDER)
                carry.append(row)
            query_lens.append(n)
            context_lens.append(stop)
            if chunk.samples:
                if req.logits_processor is not None:
                    history = req.history_prefix + req.token_ids(0, known)
                    pending_row = carry[-1] if stop > known else -1
                    processor_rows.append((len(sample_requests), req.logits_processor,
                                           torch.tensor(history, dtype=torch.long), pending_row))
                if req.params.reads_history:  # read on the device from the token pool
                    history_rows.append((len(sample_requests), batch_row, req))
                tokens = req.blocked_tokens
                if tokens:
                    blocked.append((len(sample_requests), tokens))
                logits_rows.append(len(ids) - 1)
                sample_requests.append(req)
        real_tokens = len(ids)
        if pad_to is not None:
            batch, max_ctx, tokens = pad_to
            pads = batch - len(plan.chunks)
            for i in range(pads):
                n = 1 if i < pads - 1 or not tokens else tokens - len(ids)
                query_start.append(len(ids))
                ids.extend([PLACEHOLDER] * n)
                carry.extend([-1] * n)
                query_lens.append(n)
                context_lens.append(n)
                logits_rows.append(len(ids) - 1)
            logits_rows.extend([0] * (batch - len(logits_rows)))  # chunks that do not sample
        else:
            # Pad the context to a multiple of CONTEXT_BUCKET, so that shapes change only every few steps.
            max_ctx = -(-max(context_lens) // CONTEXT_BUCKET) * CONTEXT_BUCKET
        width = -(-max_ctx // self.page_size)
        table = self.page_table.gather([c.request for c in plan.chunks], width)
        if len(context_lens) > len(plan.chunks):  # padding requests: the trash page only
            table = np.concatenate([table, np.full((len(context_lens) - len(plan.chunks), width), self.trash_page)])
        positions, slot_mapping = self._slots(table, query_start, query_lens, context_lens)
        table = torch.from_numpy(table)
        positions[real_tokens:] = 0  # padding: its slots are on the trash page; position 0 fits any model
        has_carry = pad_to is not None or any(c >= 0 for c in carry)  # graphs always take a carry map
        params = [r.params for r in sample_requests]
        sampling_ints, sampling_floats = [], []
        if any(p.do_sample for p in params):
            # Index of the token each row samples in its request's output (what seeded sampling hashes).
            token_index = [r.num_sampled for r in sample_requests]
            if pad_to is not None:  # a graph bucket: its padding rows (and non-sampling chunks') pick greedily
                pads = len(logits_rows) - len(params)
                params, token_index = params + [_GREEDY] * pads, token_index + [0] * pads
            sampling_ints, sampling_floats = SamplingTensors.host_parts(params, token_index)
        unseeded = any(p.do_sample and p.seed is None for p in params)
        ints = [_ints(ids), torch.arange(0) if not has_carry else _ints(carry),
                positions, slot_mapping, _ints(logits_rows), table,
                _ints([*query_start, len(ids)]), _ints(context_lens), *sampling_ints]
        processors = HostProcessors.build(history_rows, pad_rows=len(logits_rows) if pad_to is not None else None)
        processor_ints, processor_floats = (processors.ints, processors.floats) if processors else ([], [])
        block_ints = TokenBlock.host_parts(blocked, padded=pad_to is not None)
        dev, floats, packed = slot.upload(ints + processor_ints + block_ints, sampling_floats + processor_floats)
        dev, dev_processor_ints, dev_block_ints = _split(dev, len(ints), len(processor_ints))
        floats, dev_processor_floats = _split(floats, len(sampling_floats))
        (input_ids, carry_src, position_ids, slot_mapping_d, logits_indices, table_d, query_start_d,
         context_lens_d, *dev_sampling_ints) = dev
        meta = StepMetadata(
            slot_mapping=slot_mapping_d, block_table=table_d, query_start=query_start_d,
            context_lens=context_lens_d, page_size=self.page_size, max_query_len=max(query_lens),
            max_context=max_ctx, backend=self.attention_backend,
        )
        return StepInputs(
            input_ids=input_ids[None],
            carry_src=carry_src if has_carry else None,
            position_ids=position_ids[None],
            logits_indices=logits_indices,
            meta=meta,
            sampling=SamplingTensors.from_device(dev_sampling_ints, floats, unseeded),
            sample_requests=sample_requests,
            processor_rows=processor_rows,
            keep_rows=[i for i, r in enumerate(sample_requests) if r.keep_scores],
            processors=HistoryProcessors.from_device(processors, dev_processor_ints, dev_processor_floats),
            token_block=TokenBlock.from_device(dev_block_ints),
            packed=packed,
        )
