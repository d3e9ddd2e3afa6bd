"""Stock generate's options mapped onto the engine.

Sampling, penalties and the other options the engine runs for all requests at once on the device
become a SamplingParams; whatever else stock would apply (any other logits processor, the caller's
own, stop strings and other stopping criteria) is built by stock's own code and run per request
on its full history (the slow path), so nothing is silently dropped.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from hf_async_cb.engine.requests import SamplingParams
from hf_async_cb.generate.arguments import GenerateCall, check_rows_stop_together, max_new_tokens
from hf_async_cb.generate.guidance import GuidedRows
from hf_async_cb.generate.row_processors import ROW_BUILT, for_row, negative_prompt
from hf_async_cb.generate.row_checks import RowChecked, check_rows_alike
from hf_async_cb.model.embeddings_path import output_vocab_size

logger = logging.getLogger(__name__)

_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        logger.warning(message)


@dataclass
class CallOptions:
    """What runs where: the device's SamplingParams, and stock's processors and criteria for the rest."""

    params: SamplingParams
    stock_processors: object  # row mask -> stock's LogitsProcessorList for that row
    processor: object | None  # the same, when the call needs the slow path; else None
    criteria: object | None  # stock's StoppingCriteriaList beyond length and EOS, or None


def call_options(model, call: GenerateCall, generation_config) -> CallOptions:
    """The SamplingParams of every request of the call, and stock's slow-path objects."""
    gc, input_ids, eos = call.gc, call.input_ids, call.eos
    max_new = max_new_tokens(model, gc, generation_config, call.kwargs, input_ids, call.inputs_embeds)
    stock_processors, slow_processors, criteria, device_options, limits = _slow_path(
        model, gc, input_ids, call.attention_mask, call.arguments, call.tokenizer)
    if criteria is not None:  # parse_call checked the known sources; this covers any other
        check_rows_stop_together(call, [type(c).__name__ for c in criteria])
    if "max_length" in limits:  # the caller's MaxLengthCriteria, the only length bound stock then has
        max_new = max(1, limits["max_length"] - input_ids.shape[1])  # (stock's loop makes one token at least)
    if "eos" in limits and set(limits["eos"]) != set(eos):
        # Stock stops on the caller's EosTokenCriteria ids, while min_length / min_new_tokens still
        # hold back the GenerationConfig's: stock's own processors run those (the slow path).
        slow_processors = slow_processors or bool(gc.min_new_tokens or gc.min_length)
        eos = list(limits["eos"])
    if gc.do_sample and gc.top_p is not None and gc.top_p == 0:
        slow_processors = True  # top_p=0: stock's warper keeps one token by its own rule; it runs it
    processor = stock_processors if slow_processors else None
    neutral = slow_processors  # stock's processor list then holds the warpers too
    params = SamplingParams(
        max_new_tokens=max_new,
        do_sample=bool(gc.do_sample),
        temperature=1.0 if neutral or gc.temperature is None else float(gc.temperature),
        top_k=0 if neutral else int(gc.top_k or 0),
        top_p=1.0 if neutral or gc.top_p is None or gc.top_p >= 1.0 else float(gc.top_p),  # (stock: no warper from 1)
        min_p=0.0 if neutral or gc.min_p is None else float(gc.min_p),
        repetition_penalty=1.0 if neutral or gc.repetition_penalty is None else float(gc.repetition_penalty),
        **({} if neutral else device_options),  # no_repeat_ngram_size, bad_words_ids, sequence_bias
        # Stock holds EOS back while a row is shorter than min_length (its padded width included) or
        # has fewer than min_new_tokens new tokens; rows grow in lockstep, so both are a count of new tokens.
        min_new_tokens=0 if neutral or not eos else max(0, int(gc.min_new_tokens or 0),
                                                        int(gc.min_length or 0) - input_ids.shape[1]),
        # Ids outside the logits are ignored by stock's processors (torch.isin over the vocabulary).
        suppress_tokens=() if neutral else _in_vocab(gc.suppress_tokens, model),
        begin_suppress_tokens=() if neutral else _in_vocab(gc.begin_suppress_tokens, model),
        eos_token_ids=tuple(eos),
    )
    return CallOptions(params, stock_processors, processor, criteria)


def _slow_path(model, gc, input_ids: torch.Tensor, attention_mask: torch.Tensor, arguments: dict, tokenizer):
    """Stock generate's own logits processors for this call (a factory: row mask -> list), whether
    they must run on the slow path, the stopping criteria (None when stock would build nothing
    beyond what the engine does natively), and the SamplingParams of the history options read
    from stock's processors (no_repeat_ngram_size, bad_words_ids after stock drops lone EOS ids,
    sequence_bias).

    Whether they are needed is asked of stock itself: its processor list for this call is built and
    anything but the repetition penalty, no_repeat_ngram_size, bad_words_ids, sequence_bias,
    min_length / min_new_tokens, (begin_)suppress_tokens and the temperature / top-k / top-p /
    min-p warpers built from the GenerationConfig (which the engine runs on the device for all
    requests at once) sends the call to the slow path, so an option this module has never heard
    of, or a processor passed in `logits_processor=`, is never silently dropped. They are applied
    to each request's row as stock holds it (its left padding included), so that every option
    behaves as in stock generate, only one request at a time.
    """
    from transformers import LogitsProcessorList, StoppingCriteriaList
    from transformers.generation.logits_process import (
        MinLengthLogitsProcessor,
        MinNewTokensLengthLogitsProcessor,
        MinPLogitsWarper,
        NoBadWordsLogitsProcessor,
        NoRepeatNGramLogitsProcessor,
        RepetitionPenaltyLogitsProcessor,
        SequenceBiasLogitsProcessor,
        SuppressTokensAtBeginLogitsProcessor,
        SuppressTokensLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
        UnbatchedClassifierFreeGuidanceLogitsProcessor,
    )
    from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

    if gc.stop_strings is not None and tokenizer is None:
        raise ValueError("stop_strings needs the tokenizer: pass generate(..., tokenizer=tokenizer), as stock does.")
    model._prepare_special_tokens(gc, True, device=input_ids.device)
    user_processors = arguments.get("logits_processor") or LogitsProcessorList()

    # One list per row, built with that row's attention mask: some processors read the mask (e.g.
    # repetition_penalty ignores padding in newer transformers) and must see a batch of one.
    checked: set[int] = set()  # the caller's deterministic processors and criteria (generate/row_checks.py)

    copies = max(1, int(gc.num_return_sequences or 1))
    owners: dict = {}  # the call's batched guidance (generate/guidance.py), per guidance processor

    def guided(given, made):
        """A guidance processor made for one row (`made`, from `given`) as a row of the call's batched
        guidance; anything else as it is."""
        if not isinstance(made, UnbatchedClassifierFreeGuidanceLogitsProcessor) \
                or not made.unconditional_context["use_cache"]:
            return made  # (without a cache stock feeds the whole context each step: per row, as stock's)
        key = id(given) if any(given is p for p in user_processors) else "guidance_scale"
        owner = owners.setdefault(key, GuidedRows(made.model, made.guidance_scale))
        return owner.row(made.unconditional_context["input_ids"], made.unconditional_context["attention_mask"])

    negative_prompt(arguments, 0, input_ids.shape[0])  # (checked once, before any work)

    def processor(row_mask: torch.Tensor, row: int = 0):
        """Stock's list for the call's `row` (its index among the rows stock generates, copies
        included), a batch of one row."""
        built = model._get_logits_processor(
            generation_config=gc, input_ids_seq_length=input_ids.shape[1], encoder_input_ids=input_ids,
            logits_processor=user_processors, device=input_ids.device, model_kwargs={"attention_mask": row_mask[None]},
            prefix_allowed_tokens_fn=arguments.get("prefix_allowed_tokens_fn"),
            **negative_prompt(arguments, row // copies, input_ids.shape[0]),
        )
        built = LogitsProcessorList(guided(p, for_row(p, row, copies, input_ids.shape[0])) for p in built)
        if checked:
            built = LogitsProcessorList(RowChecked(p, "logits processor") if id(p) in checked else p for p in built)
        return built

    native = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper,
              MinLengthLogitsProcessor, MinNewTokensLengthLogitsProcessor, SuppressTokensLogitsProcessor,
              NoRepeatNGramLogitsProcessor, SequenceBiasLogitsProcessor)  # NoBadWords is a SequenceBias

    def is_native(p) -> bool:
        if any(p is user for user in user_processors):
            return False  # the caller's own objects run as given (their settings are not the config's)
        if isinstance(p, RepetitionPenaltyLogitsProcessor):
            return penalty_start(p) is not None
        if isinstance(p, SuppressTokensAtBeginLogitsProcessor):
            return p.begin_index == input_ids.shape[1]  # the first new token (no forced BOS shift)
        return isinstance(p, native)

    row_processors = processor(attention_mask[0])
    slow = not all(is_native(p) for p in row_processors)
    device_options = {}
    for p in row_processors:
        if isinstance(p, NoRepeatNGramLogitsProcessor):
            device_options["no_repeat_ngram_size"] = p.ngram_size
        elif isinstance(p, NoBadWordsLogitsProcessor):  # a sequence bias of -inf per bad word (an empty
            device_options["bad_words_ids"] = tuple(words for words in p.sequence_bias if words)  # one bans nothing)
        elif isinstance(p, SequenceBiasLogitsProcessor):
            device_options["sequence_bias"] = tuple(p.sequence_bias.items())
    user_criteria = arguments.get("stopping_criteria") or StoppingCriteriaList()
    rows = input_ids.shape[0] * copies
    probed = [p for p in user_processors if not isinstance(p, ROW_BUILT)]  # (made per row: for_row)
    checked |= check_rows_alike(probed, user_criteria, input_ids, rows, _vocab_size(model),
                                criteria_get_scores(gc))
    if slow:
        _warn_once("Logits processors run on the engine's slow path: one call per request per step, on "
                   "the request's full history, as a batch of one row (correct for processors that treat "
                   "each row on its own, and slower than the built-in sampling options). A processor that "
                   "looks across the rows of the batch needs batching='off'.")
    stock = model._get_stopping_criteria(generation_config=gc, stopping_criteria=user_criteria, tokenizer=tokenizer)
    # Length and EOS are the engine's own. The caller's own MaxLengthCriteria / EosTokenCriteria
    # replace stock's (its merge keeps the caller's of the same type): their length and ids become
    # the engine's. Everything else, subclasses of those two included, is checked per request after
    # each token.
    limits = {}
    extra = []
    for c in stock:
        own = any(c is user for user in user_criteria)
        if own and type(c) is MaxLengthCriteria:
            limits["max_length"] = int(c.max_length)
        elif own and type(c) is EosTokenCriteria:
            limits["eos"] = tuple(int(t) for t in torch.as_tensor(c.eos_token_id).reshape(-1).tolist())
        elif own or not isinstance(c, (MaxLengthCriteria, EosTokenCriteria)):
            extra.append(RowChecked(c, "stopping criterion") if id(c) in checked else c)
    return processor, slow, (StoppingCriteriaList(extra) if extra else None), device_options, limits


def criteria_get_scores(gc) -> bool:
    """Whether stock hands its stopping criteria the scores so far (else None): when it returns them."""
    return bool(gc.return_dict_in_generate and gc.output_scores)


def _vocab_size(model) -> int:
    """The width of the logits (through a PEFT wrapper of the head: embeddings_path.output_vocab_size)."""
    width = output_vocab_size(model)
    return width if width is not None else model.config.vocab_size


def _in_vocab(tokens, model) -> tuple[int, ...]:
    """The ids of `tokens` (a list, a tensor or array of any shape, one id) within the vocabulary:
    stock takes every form (`torch.tensor(tokens)`), and a tensor's truth value is no emptiness test."""
    if tokens is None:
        return ()
    vocab = _vocab_size(model)
    return tuple(int(t) for t in torch.as_tensor(tokens).reshape(-1).tolist() if 0 <= int(t) < vocab)


def penalty_start(processor) -> int | None:
    """Where stock's RepetitionPenaltyLogitsProcessor starts reading a row's history: 0, or the
    prompt_ignore_length it was given (newer transformers pass each row's padding length); None
    for another processor, or a form the engine does not run natively."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    if not isinstance(processor, RepetitionPenaltyLogitsProcessor):
        return None
    ignore = getattr(processor, "prompt_ignore_length", None)
    if ignore is None:
        return 0
    if isinstance(ignore, int):
        return ignore
    if isinstance(ignore, torch.Tensor) and ignore.numel() == 1:
        return int(ignore.reshape(-1)[0])
    return None
