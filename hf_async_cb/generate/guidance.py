"""Classifier-free guidance with the rows' unconditional forwards batched, as stock batches them.

Stock's UnbatchedClassifierFreeGuidanceLogitsProcessor runs the model once per step on the whole
batch's unconditional contexts (each row's negative prompt, or its last prompt token, then the tokens
it generates), with a cache of its own. The engine calls a request's processors on its row alone, so
stock's processor made per row (generate/row_processors.py) would run one forward per row and step.
Here every row's `RowGuidance` belongs to the call's `GuidedRows`; before the step's processors run,
the runner hands it the rows of the step (`before_step`), and it runs one forward per group of rows
that started together (their contexts have one length, as in stock's batch), then each row's
processor reads its row of the result.

A group's cache drops the rows that ended; a row that misses a step (preempted, then resumed)
leaves its group and recomputes its context from the start when it is next called (the same keys
and values, from one forward instead of several). Stock feeds its ended rows pad tokens to the end;
their rows of a GEMM do not change the others' beyond rounding.
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessor

from hf_async_cb.model.kv_cache import cache_keyword


class RowGuidance(LogitsProcessor):
    """One row's guidance: stock's formula on its scores and its unconditional logits (from its
    owner's batched forward)."""

    def __init__(self, owner: "GuidedRows", ids: torch.Tensor | None, mask: torch.Tensor | None) -> None:
        self.batched_by = owner
        self.ids, self.mask = ids, mask  # its unconditional context's start (None: its last prompt token)
        self.group: _Group | None = None
        self.calls = 0  # the steps it has been called for (the tokens its context has taken since)
        self.logits: torch.Tensor | None = None  # [1, vocab], from before_step

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        if self.logits is None:  # (not handed to before_step: a call outside the runner's loop)
            self.batched_by.before_step([(self, input_ids)])
        logits, self.logits = self.logits, None
        self.calls += 1
        scores = torch.nn.functional.log_softmax(scores, dim=-1)
        unconditional = torch.nn.functional.log_softmax(logits, dim=-1)
        return self.batched_by.scale * (scores - unconditional) + unconditional


class _Group:
    def __init__(self, rows: list[RowGuidance], mask: torch.Tensor, cache) -> None:
        self.mask, self.cache = mask, cache
        self.set_rows(rows)

    def set_rows(self, rows: list[RowGuidance]) -> None:
        self.rows = rows
        self.places = {id(row): i for i, row in enumerate(rows)}  # (a step of 256 rows looks each up)


class GuidedRows:
    """A call's guided rows, whose unconditional forwards run together (module docstring)."""

    def __init__(self, model: torch.nn.Module, scale: float) -> None:
        self.model, self.scale = model, scale
        self._keyword = cache_keyword(model)

    def row(self, ids: torch.Tensor | None, mask: torch.Tensor | None) -> RowGuidance:
        return RowGuidance(self, ids, mask)

    def before_step(self, entries: list[tuple[RowGuidance, torch.Tensor]]) -> None:
        """Compute the unconditional logits of every row in `entries` ((row, its history [1, n]))."""
        by_group: dict[int, list] = {}
        starting = []
        for row, history in entries:
            group = row.group
            if group is not None and row.calls and id(row) in group.places:
                by_group.setdefault(id(group), (group, []))[1].append((row, history))
            else:
                starting.append((row, history))
        for group, present in by_group.values():
            self._advance(group, present)
        if starting:
            self._start(starting)

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, cache):
        return self.model(ids, attention_mask=mask, use_cache=True, **{self._keyword: cache})

    def _start(self, entries: list[tuple[RowGuidance, torch.Tensor]]) -> None:
        """Rows called for the first time (or again after leaving their group): their contexts from
        the start, the rows of one length in one forward."""
        by_length: dict[int, list] = {}
        for row, history in entries:
            taken = history[:, history.shape[1] - row.calls:]  # (the tokens it took since: a row back)
            if row.ids is None:  # its last prompt token, then those
                ids = history[:, history.shape[1] - row.calls - 1:]
                mask = torch.ones_like(ids)
            else:
                ids = torch.cat([row.ids.to(history.device), taken], dim=1)
                start = torch.ones_like(row.ids) if row.mask is None else row.mask
                mask = torch.cat([start.to(history.device), torch.ones_like(taken)], dim=1)
            by_length.setdefault(ids.shape[1], []).append((row, ids, mask))
        for rows in by_length.values():
            ids = torch.cat([ids for _, ids, _ in rows])
            mask = torch.cat([mask for _, _, mask in rows])
            out = self._forward(ids, mask, None)  # (the model makes its own cache, as stock's first pass)
            group = _Group([row for row, _, _ in rows], mask, _returned_cache(out))
            for i, (row, _, _) in enumerate(rows):
                row.group, row.logits = group, out.logits[i : i + 1, -1]

    def _advance(self, group: _Group, present: list[tuple[RowGuidance, torch.Tensor]]) -> None:
        """One step of a group's rows present in this step; the others leave it."""
        rows = [row for row, _ in present]
        if rows != group.rows:
            keep = torch.tensor([group.places[id(row)] for row in rows], device=group.mask.device)
            group.cache.batch_select_indices(keep)
            group.mask = group.mask[keep]
            group.set_rows(rows)
        ids = torch.cat([history[:, -1:] for _, history in present])
        group.mask = torch.cat([group.mask, torch.ones_like(ids)], dim=1)
        out = self._forward(ids, group.mask, group.cache)
        for i, row in enumerate(rows):
            row.logits = out.logits[i : i + 1, -1]


def _returned_cache(out):
    """The cache a forward returned (`cache` from transformers 5.24 on, `past_key_values` before)."""
    for name in ("cache", "past_key_values"):
        if out.get(name) is not None:
            return out.get(name)
    raise RuntimeError("the model's forward returned no cache for the guidance's unconditional context.")
