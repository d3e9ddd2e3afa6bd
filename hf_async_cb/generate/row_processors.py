"""Stock's processors that number or slice the rows of their batch, built for one row.

The engine hands each request's processors a batch of one row: a processor built for stock's
whole batch must be told which row it is. So is one the caller built for the whole batch and passed
in `logits_processor` (stock's PrefixConstrainedLogitsProcessor or
UnbatchedClassifierFreeGuidanceLogitsProcessor): `for_row` makes it per row.

`generate(prefix_allowed_tokens_fn=...)`:

Stock's PrefixConstrainedLogitsProcessor calls `fn(batch_id, sent)` for every row of its batch and
keeps only the tokens it returns (constrained decoding: entity names, grammars, a trie of allowed
outputs). The engine hands each request's processors a batch of one row, where stock's processor
would number every row 0 (and, grouping rows by beams, see none at all). `RowPrefixConstraint` is
that processor for one row of stock's batch: the same `fn`, the row's own `batch_id` (its index in
stock's batch over the processor's group size, which transformers 5.17 sets to `num_beams` and 5.25
to `num_return_sequences` where larger), the same mask, the same empty-list error.

Where every allowed token of a row is already -inf, transformers 5.25 forces the allowed tokens
(scores 0), 5.17 leaves the row at -inf (its draw then takes token 0 greedily, or fails sampled):
the installed version's rule is read once from its own processor. One difference: 5.25 forces only
when that holds for every row of its group (the copies of one prompt); here each row is forced on its
own (stock's other rows of that group would draw from all -inf scores and fail).
"""

from __future__ import annotations

import copy
import functools
import math

import torch
from transformers import LogitsProcessor
from transformers.generation.logits_process import (
    EncoderNoRepeatNGramLogitsProcessor,
    EncoderRepetitionPenaltyLogitsProcessor,
    PrefixConstrainedLogitsProcessor,
    UnbatchedClassifierFreeGuidanceLogitsProcessor,
)


class RowPrefixConstraint(LogitsProcessor):
    def __init__(self, fn, batch_id: int) -> None:
        self.fn, self.batch_id = fn, batch_id

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        mask = torch.full_like(scores, -math.inf)
        allowed = self.fn(self.batch_id, input_ids[0])
        if len(allowed) == 0:
            raise ValueError(f"`prefix_allowed_tokens_fn` returned an empty list for batch ID {self.batch_id}. "
                             "This means that the constraint is unsatisfiable. Please check your implementation "
                             "of `prefix_allowed_tokens_fn`.")
        mask[0, allowed] = 0
        constrained = scores + mask
        return mask if _stock_forces() and bool(constrained.amax().isneginf()) else constrained


@functools.cache
def _stock_forces() -> bool:
    """Whether the installed transformers forces a row's allowed tokens when all are -inf."""
    stock = PrefixConstrainedLogitsProcessor(lambda batch_id, sent: [0], 1)
    return bool(stock(torch.zeros(1, 1, dtype=torch.long), torch.full((1, 2), -math.inf))[0, 0] == 0)


def negative_prompt(arguments: dict, prompt: int, prompts: int) -> dict:
    """`generate(guidance_scale=..., negative_prompt_ids=..., negative_prompt_attention_mask=...)`:
    the negative prompt of the call's `prompt` (of `prompts`), for that row's own classifier-free
    guidance processor (stock's UnbatchedClassifierFreeGuidanceLogitsProcessor, which runs the
    model on it with a cache of its own: model/callback_forwards.py hands it the stock model).
    Stock takes one negative row per prompt, or one for a batch of one prompt; copies
    (`num_return_sequences`) share their prompt's."""
    ids, mask = arguments.get("negative_prompt_ids"), arguments.get("negative_prompt_attention_mask")
    if ids is None:
        if mask is not None:
            raise ValueError("negative_prompt_attention_mask without negative_prompt_ids.")
        return {}
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[0] != prompts:
        shape = tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise ValueError(f"negative_prompt_ids must be a LongTensor [batch, length] with a row per prompt "
                         f"({prompts}), as stock's guidance concatenates it with the batch; got {shape}.")
    if mask is not None and (not isinstance(mask, torch.Tensor) or tuple(mask.shape) != tuple(ids.shape)):
        raise ValueError("negative_prompt_attention_mask must have negative_prompt_ids' shape.")
    return {"negative_prompt_ids": ids[prompt : prompt + 1],
            "negative_prompt_attention_mask": None if mask is None else mask[prompt : prompt + 1]}


def for_row(processor: LogitsProcessor, row: int, copies: int = 1, prompts: int = 1) -> LogitsProcessor:
    """`processor` for the call's `row` (of `prompts` prompts, `copies` rows each): stock's prefix
    constraint bound to the row's batch id, a guidance processor of the caller's own made anew with
    the row's unconditional context, the prompt-reading processors (`encoder_repetition_penalty`,
    `encoder_no_repeat_ngram_size`: for a decoder-only model stock hands them the padded prompts)
    given the row's prompt, any other processor as it is."""
    if isinstance(processor, EncoderRepetitionPenaltyLogitsProcessor):
        made = copy.copy(processor)
        at = _prompt_row(processor.encoder_input_ids.shape[0], row, copies, prompts, "an encoder processor's prompts")
        made.encoder_input_ids = processor.encoder_input_ids[at : at + 1]
        return made
    if isinstance(processor, EncoderNoRepeatNGramLogitsProcessor):
        made = copy.copy(processor)
        at = _prompt_row(processor.batch_size, row, copies, prompts, "an encoder processor's prompts")
        made.generated_ngrams = [processor.generated_ngrams[at]]
        made.batch_size = 1
        return made
    if isinstance(processor, PrefixConstrainedLogitsProcessor):
        return RowPrefixConstraint(processor._prefix_allowed_tokens_fn, row // max(1, processor._num_beams))
    if isinstance(processor, UnbatchedClassifierFreeGuidanceLogitsProcessor):
        context = processor.unconditional_context
        if not context["first_pass"]:
            raise ValueError("a UnbatchedClassifierFreeGuidanceLogitsProcessor that has run already keeps its "
                             "unconditional cache: pass a new one (or guidance_scale=... and negative_prompt_ids=...).")
        ids, mask = context["input_ids"], context["attention_mask"]
        if ids is not None:
            at = _prompt_row(ids.shape[0], row, copies, prompts, "a guidance processor's unconditional_ids")
            ids, mask = ids[at : at + 1], None if mask is None else mask[at : at + 1]
        return UnbatchedClassifierFreeGuidanceLogitsProcessor(processor.guidance_scale, processor.model, ids, mask,
                                                              context["use_cache"])
    return processor


def _prompt_row(rows: int, row: int, copies: int, prompts: int, what: str) -> int:
    """Which of a processor's `rows` rows (`what` they are) the call's `row` reads: one per row, one per
    prompt (its copies share it, as stock repeats them), or one for all."""
    at = {prompts * copies: row, prompts: row // copies, 1: 0}.get(rows)
    if at is None:
        raise ValueError(f"{what} have {rows} rows for a call of {prompts} prompts x {copies} copies: give one "
                         "per row, one per prompt, or one.")
    return at


# Stock's processors of the caller's that for_row makes per row (the row checks' probe would call a
# batch-wide one on copies of one row: a guidance processor keeps state, a constraint numbers rows,
# the prompt-reading ones hold every prompt).
ROW_BUILT = (PrefixConstrainedLogitsProcessor, UnbatchedClassifierFreeGuidanceLogitsProcessor,
             EncoderRepetitionPenaltyLogitsProcessor, EncoderNoRepeatNGramLogitsProcessor)
