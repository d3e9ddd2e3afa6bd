"""Host-side batch building: a StepPlan becomes the packed device tensors of one forward.

No padding: the step's tokens form one stream [1, T] with explicit positions; logits are kept only
at the last token of each chunk that samples. A token the CPU does not know yet (sampled by the
step still in flight) is written as a placeholder, with `carry_src` naming its row in that step's
sampled tokens; the runner gathers it on the device before the forward. Processors that read a
request's history get only per-row values from here (penalties.HostProcessors): the histories
themselves are on the device already (sampling/token_history.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import compress

import numpy as np
import torch

from hf_async_cb.engine.io_slots import IOSlot
from hf_async_cb.engine.page_table import PageTable
from hf_async_cb.engine.requests import Request, SamplingParams
from hf_async_cb.engine.step_plan import StepPlan
from hf_async_cb.engine.shared_prefix_groups import shared_prefix_groups
from hf_async_cb.model.step_metadata import StepMetadata
from hf_async_cb.sampling.device_processors import HistoryProcessors, HostProcessors, TokenBlock
from hf_async_cb.sampling.sampler import SamplingTensors

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
    # (raw logits, processed scores) of keep_rows, and {kept row index: processed scores in the dtype
    # its logits processor returned} where that is not float32 (ModelRunner.step)
    kept: tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]] | None = None
    faults: dict[int, BaseException] | None = None  # slow path: row -> what its logits processor raised
    processors: HistoryProcessors | None = None  # rows whose processors read their history, else None
    token_block: TokenBlock | None = None  # tokens some rows may not sample this step, else None
    # The two device buffers every tensor above was uploaded in (int64, float32 or None): a CUDA
    # graph loads a step with one copy of each.
    packed: tuple[torch.Tensor, torch.Tensor | None] | None = None
    # Eager steps only, kept on the host until the runner's forward puts them on the device (on
    # its stream): prompt embeddings (engine/prompt_embeds.py) as (stream indices [E], the device
    # embeddings fed there, in pieces) instead of the tokens' own; multimodal rotary positions
    # [K, T] when some token's K rows differ (else position_ids holds them all); and [2, T] the
    # bidirectional block of each token (StepMetadata.visible_from / visible), else None.
    embeds: tuple[np.ndarray, list[torch.Tensor]] | None = None
    rotary: np.ndarray | None = None
    visible: np.ndarray | None = None
    # (stream indices [N], per chunk (PrefixKV, first, stop)) of the positions whose K/V are given
    # (model/prefix_kv.py), else None.
    prefix_kv: tuple[np.ndarray, list] | None = None
    # (stream indices [D], per layer the features added there) of deepstack positions
    # (PromptEmbeds.deepstack), else None.
    deepstack: tuple[np.ndarray, list[torch.Tensor]] | None = None


def _split(items: list, *sizes: int) -> list[list]:
    """items cut into consecutive parts of the given sizes, and the rest."""
    parts, start = [], 0
    for size in sizes:
        parts.append(items[start:start + size])
        start += size
    return [*parts, items[start:]]


class BatchBuilder:
    def __init__(self, page_size: int, trash_slot: int, page_table: PageTable,
                 attention_backend: str = "reference", groups_prefixes: bool = True) -> None:
        """`trash_slot`: the first slot of a page outside the pool, written by padding rows, never read.
        `page_table`: the scheduler's mirror of the running requests' pages (the block tables' source).
        `groups_prefixes`: whether some layer's attention reads a shared prefix once per group
        (Engine: the Triton kernels, where a prefix tile holds the layer's query heads per KV head)."""
        self.page_size = page_size
        self.attention_backend = attention_backend
        self.groups_prefixes = groups_prefixes and attention_backend == "triton"
        self.trash_page = trash_slot // page_size
        self.page_table = page_table
        # Decode steps built with shared-prefix groups, and the keys per layer their rows did not read
        # again (a group's prefix once, not once per row): Engine.prefix_cache_stats() reports them.
        self.grouped_steps = 0
        self.keys_read_once = 0

    @staticmethod
    def _token_ids(plan: StepPlan, carry_rows: dict[int, int]) -> tuple[list[int], list[int], list[int]]:
        """The step's known input ids with a placeholder for each token still in flight, those
        placeholders' indices in the stream, and their rows in the step in flight. The one
        per-request loop of a step's build: everything else is numpy over the plan's columns."""
        ids: list[int] = []
        carry_at: list[int] = []
        carry_from: list[int] = []
        for req, start, n in zip(plan.requests, plan.starts, plan.sizes):
            prompt = req.prompt_token_ids
            n_prompt = len(prompt)
            if n == 1:  # the common decode step: one token, known unless it is still in flight
                if start < n_prompt:
                    ids.append(prompt[start])
                    continue
                output = req.output_token_ids
                i = start - n_prompt
                if i < len(output):
                    ids.append(output[i])
                    continue
                row = carry_rows.get(id(req))
                if i == len(output) and row is not None:  # the async loop's decode step
                    carry_at.append(len(ids))
                    carry_from.append(row)
                    ids.append(PLACEHOLDER)
                    continue
            stop = start + n
            known = min(stop, n_prompt + len(req.output_token_ids))
            if known > start:
                ids.extend(req.token_ids(start, known))
            if stop > known:  # the last token is still on its way from the step in flight
                row = carry_rows.get(id(req))
                if stop - known != 1 or row is None:
                    raise RuntimeError(f"{req.request_id}: tokens [{known}, {stop}) are neither known nor in flight")
                carry_at.append(len(ids))
                carry_from.append(row)
                ids.append(PLACEHOLDER)
        return ids, carry_at, carry_from

    @staticmethod
    def _row_options(plan: StepPlan, sample_requests: list[Request], carry_rows: dict[int, int]):
        """What some sampled rows need besides their token (a plan that is not plain): the slow
        path's processors, the rows whose processors read their history, the blocked tokens, and
        the rows whose scores go back to the host."""
        processor_rows: list[tuple[int, object, torch.Tensor, int]] = []
        history_rows: list[tuple[int, int, Request]] = []  # (sampled row, batch row, request)
        blocked: list[tuple[int, tuple[int, ...]]] = []
        sample_row = 0
        for batch_row, chunk in enumerate(plan.chunks):
            if not chunk.samples:
                continue
            req = chunk.request
            if req.logits_processor is not None:
                stop = chunk.start + chunk.num_tokens
                known = min(stop, req.num_known_tokens)
                history = req.history_tensor(len(req.history_prefix) + known)  # (kept: O(1) per token)
                pending_row = carry_rows[id(req)] if stop > known else -1
                processor_rows.append((sample_row, req.logits_processor, history, pending_row))
            if req.params.reads_history:  # read on the device from the token pool
                history_rows.append((sample_row, batch_row, req))
            tokens = req.blocked_tokens
            if tokens:
                blocked.append((sample_row, tokens))
            sample_row += 1
        keep_rows = [i for i, r in enumerate(sample_requests) if r.keep_scores]
        return processor_rows, history_rows, blocked, keep_rows

    def build(self, plan: StepPlan, slot: IOSlot, carry_rows: dict[int, int],
              pad_to: tuple[int, int, int] | None = None, sampled: bool = False) -> StepInputs:
        """`carry_rows` maps id(request) -> its row in the sampled tokens of the step in flight.

        `pad_to` = (batch, context, tokens): a step padded to a CUDA-graph bucket (tokens 0: a decode
        step, one token per request). Padding requests write to and read from the trash page: one
        token each, the last one all the tokens left. Logits rows are padded to `batch` too.
        `sampled`: the bucket's graph takes sampling parameters (a greedy step may replay a sampled
        graph: DecodeGraphs._lent_sampled), so they are uploaded even where no row samples.
        """
        ps = self.page_size
        ids, carry_at, carry_from = self._token_ids(plan, carry_rows)
        real_rows, real_tokens = len(plan.chunks), len(ids)  # each chunk feeds its num_tokens
        sizes = plan.sizes
        if pad_to is not None:
            batch, max_ctx, tokens = pad_to
            pads = batch - real_rows
            if pads > 0:
                last = 1 if not tokens else tokens - (real_tokens + pads - 1)
                sizes = sizes + [1] * (pads - 1) + [last]
        query_lens = np.array(sizes, dtype=np.int64)
        rows = len(query_lens)
        query_start = np.zeros(rows + 1, dtype=np.int64)
        np.cumsum(query_lens, out=query_start[1:])
        num_tokens = int(query_start[-1])
        context_lens = query_lens.copy()  # padding requests: their own tokens
        context_lens[:real_rows] += plan.starts
        if pad_to is None:
            # Pad the context to a multiple of CONTEXT_BUCKET, so that shapes change only every few steps.
            max_ctx = -(-int(context_lens.max()) // CONTEXT_BUCKET) * CONTEXT_BUCKET
        # Logits at the last token of every chunk that samples, then of every padding request,
        # then row 0 for the bucket's remaining rows (chunks that do not sample).
        last_token = query_start[1:] - 1
        if plan.all_sample:
            sample_requests = plan.requests[:]
            logits_rows = last_token
        else:
            sample_requests = list(compress(plan.requests, plan.samples))
            logits_rows = np.concatenate([last_token[:real_rows][np.array(plan.samples, dtype=bool)],
                                          last_token[real_rows:]])
        if pad_to is not None and len(logits_rows) < batch:
            logits_rows = np.concatenate([logits_rows, np.zeros(batch - len(logits_rows), dtype=np.int64)])
        # Block table: the requests' rows of the page table, padding requests on the trash page only.
        width = -(-max_ctx // ps)
        table = self.page_table.gather(plan.requests, width, rows - real_rows, self.trash_page)
        # Position and cache slot of each token.
        if num_tokens == rows:  # one token per request, at its last position
            positions = context_lens - 1
            token_rows = np.arange(rows)
        else:
            token_rows = np.repeat(np.arange(rows), query_lens)
            positions = (context_lens - query_lens - query_start[:-1])[token_rows] + np.arange(num_tokens)
        slot_mapping = table[token_rows, positions // ps] * ps + positions % ps
        positions[real_tokens:] = 0  # padding: its slots are on the trash page; position 0 fits any model
        rotary = None
        cache_positions = positions
        if plan.rotary:  # positions of the model's own (multimodal rotary), not the cache's
            positions, rotary = _rotary_positions(plan, positions, query_start)
        input_ids = np.zeros(num_tokens, dtype=np.int64)  # PLACEHOLDER past the real tokens
        input_ids[:real_tokens] = ids
        has_carry = pad_to is not None or bool(carry_at)  # graphs always take a carry map
        carry = np.full(num_tokens if has_carry else 0, -1, dtype=np.int64)
        carry[carry_at] = carry_from
        processor_rows, history_rows, blocked, keep_rows = [], [], [], []
        sampling_ints, sampling_floats, unseeded = [], [], False
        params = None  # (a plain step, greedy and in no sampled graph, looks at no row's options)
        if not plan.plain:
            processor_rows, history_rows, blocked, keep_rows = self._row_options(plan, sample_requests, carry_rows)
            params = [r.params for r in sample_requests]
            unseeded = any(p.unseeded for p in params)
        elif sampled:  # plain rows replaying a sampled graph (DecodeGraphs._lent_sampled): each picks greedily
            params = [_GREEDY] * len(sample_requests)
        if params is not None and (sampled or any(p.do_sample for p in params)):
            # Index of the token each row samples in its request's output (what seeded sampling hashes).
            token_index = [r.num_sampled for r in sample_requests]
            if pad_to is not None:  # a graph bucket: its padding rows (and non-sampling chunks') pick greedily
                pads = len(logits_rows) - len(params)
                params, token_index = params + [_GREEDY] * pads, token_index + [0] * pads
            sampling_ints, sampling_floats = SamplingTensors.host_parts(params, token_index)
        groups = None
        if num_tokens == rows and self.groups_prefixes:  # a decode step on the Triton kernels
            groups = shared_prefix_groups(table, context_lens, real_rows, ps)
            if groups is not None:
                self.grouped_steps += 1
                self.keys_read_once += groups.keys_saved
        ints = [input_ids, carry, positions, slot_mapping, logits_rows, table, query_start, context_lens,
                *(groups[:3] if groups is not None else ()), *sampling_ints]
        processors = HostProcessors.build(history_rows, pad_rows=len(logits_rows) if pad_to is not None else None)
        processor_ints, processor_floats = (processors.ints, processors.floats) if processors else ([], [])
        block_ints = TokenBlock.host_parts(blocked, padded=pad_to is not None)
        dev, floats, packed = slot.upload(ints + processor_ints + block_ints, sampling_floats + processor_floats)
        dev, dev_processor_ints, dev_block_ints = _split(dev, len(ints), len(processor_ints))
        floats, dev_processor_floats = _split(floats, len(sampling_floats))
        (input_ids, carry_src, position_ids, slot_mapping_d, logits_indices, table_d, query_start_d,
         context_lens_d, *dev_sampling_ints) = dev
        group_start_d = group_rows_d = shared_len_d = None
        if groups is not None:
            group_start_d, group_rows_d, shared_len_d, *dev_sampling_ints = dev_sampling_ints
        meta = StepMetadata(
            slot_mapping=slot_mapping_d, block_table=table_d, query_start=query_start_d,
            context_lens=context_lens_d, page_size=ps, max_query_len=int(query_lens.max()),
            max_context=max_ctx, backend=self.attention_backend, group_start=group_start_d,
            group_rows=group_rows_d, shared_len=shared_len_d, pool_slots=self.trash_page * ps,
        )
        embeds = visible = prefix_kv = deepstack = None
        if plan.embedded:
            embeds = _embeds(plan, query_start)
            deepstack = _deepstack(plan, query_start)
            prefix_kv = _prefix_kv(plan, query_start)
            visible = _visible(plan, cache_positions, query_start)
            if visible is not None:  # a bidirectional block: the reference attention takes the mask
                meta.backend = "reference"
        return StepInputs(
            embeds=embeds,
            rotary=rotary if plan.embedded else None,
            visible=visible,
            prefix_kv=prefix_kv,
            deepstack=deepstack,
            input_ids=input_ids[None],
            carry_src=carry_src if has_carry else None,
            position_ids=position_ids[None],
            logits_indices=logits_indices,
            meta=meta,
            sampling=SamplingTensors.from_device(dev_sampling_ints, floats, unseeded),
            sample_requests=sample_requests,
            processor_rows=processor_rows,
            keep_rows=keep_rows,
            processors=HistoryProcessors.from_device(processors, dev_processor_ints, dev_processor_floats),
            token_block=TokenBlock.from_device(dev_block_ints),
            packed=packed,
        )


def _rotary_positions(plan: StepPlan, positions: np.ndarray, query_start: np.ndarray):
    """The step's position ids where some request has multimodal rotary positions: row 0 of them
    for every token (all a step needs when its rows agree), and all K rows [K, T] when a chunk
    feeds a span where they differ (then an eager step: plan.embedded), else None."""
    positions = positions.copy()
    wide = []  # (stream offset, [K, n] positions) of the chunks whose rows differ
    for i, (req, start, n) in enumerate(zip(plan.requests, plan.starts, plan.sizes)):
        embeds = req.embeds
        if embeds is None or embeds.rope is None:
            continue
        q = query_start[i]
        if n == 1 and start >= embeds.rope.shape[1]:  # a decode token: its position, shifted
            positions[q] = start + embeds.rope_delta
            continue
        rope = embeds.rope_positions(start, start + n, len(req.prompt_token_ids))
        positions[q:q + n] = rope[0]
        if start < embeds.rope_end and start + n > embeds.rope_first:
            wide.append((q, rope))
    if not wide:
        return positions, None
    rows = np.repeat(positions[None], wide[0][1].shape[0], axis=0)
    for q, rope in wide:
        rows[:, q:q + rope.shape[1]] = rope
    return positions, rows


def _embeds(plan: StepPlan, query_start: np.ndarray) -> tuple[np.ndarray, list[torch.Tensor]] | None:
    """(stream indices, embeddings in pieces) of the prompt embeddings the step's chunks feed, or None."""
    where, values = [], []
    for i in plan.embedded:
        chunk = plan.chunks[i]
        rel, vals = chunk.request.embeds.slice(chunk.start, chunk.start + chunk.num_tokens)
        if len(rel):
            where.append(rel + query_start[i])
            values.append(vals)
    return (np.concatenate(where), values) if where else None


def _deepstack(plan: StepPlan, query_start: np.ndarray) -> tuple[np.ndarray, list[torch.Tensor]] | None:
    """(stream indices, per layer the features added there) of the deepstack positions the step's
    chunks cover, or None."""
    where, layers = [], []
    for i in plan.embedded:
        chunk = plan.chunks[i]
        found = chunk.request.embeds.deepstack_slice(chunk.start, chunk.start + chunk.num_tokens)
        if found is not None:
            where.append(found[0] + query_start[i])
            layers.append(found[1])
    if not where:
        return None
    return np.concatenate(where), [torch.cat(parts) for parts in zip(*layers)]


def _prefix_kv(plan: StepPlan, query_start: np.ndarray) -> tuple[np.ndarray, list] | None:
    """(stream indices, per chunk (PrefixKV, first, stop)) of the prefix positions whose K/V the
    step's chunks are given (PromptEmbeds.kv), or None."""
    where, pieces = [], []
    for i in plan.embedded:
        chunk = plan.chunks[i]
        embeds = chunk.request.embeds
        stop = min(embeds.kv_end, chunk.start + chunk.num_tokens)
        if chunk.start < stop:
            where.append(np.arange(stop - chunk.start) + query_start[i])
            pieces.append((embeds.kv, chunk.start, stop))
    return (np.concatenate(where), pieces) if where else None


def _visible(plan: StepPlan, positions: np.ndarray, query_start: np.ndarray) -> np.ndarray | None:
    """[2, T] the first and the last key position of each token's bidirectional block, where a
    chunk's tokens see past themselves (PromptEmbeds.visible), else None."""
    visible = None
    for i in plan.embedded:
        chunk = plan.chunks[i]
        embeds = chunk.request.embeds
        lo, hi = embeds.sees_ahead
        start, stop = chunk.start, chunk.start + chunk.num_tokens
        if embeds.visible is None or not (start < hi and stop > lo):
            continue
        if visible is None:
            visible = np.stack([positions, positions])
        q = query_start[i]
        prompt_stop = min(stop, len(embeds.visible))
        visible[0, q:q + prompt_stop - start] = embeds.visible_from[start:prompt_stop]
        visible[1, q:q + prompt_stop - start] = embeds.visible[start:prompt_stop]
    return visible
