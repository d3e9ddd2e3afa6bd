"""One generate(batching=...) call on the engine: read the call, build its requests, run, answer.

    parse_call()      generate/arguments.py       checks, GenerationConfig, prompts
    call_options()    generate/stock_options.py   SamplingParams + stock's slow-path objects
    build_requests()  here                        one engine request per row (and per copy)
    runtime_engine()  generate/runtime.py         the model's engine, kept between calls
    engine.run()      engine/engine.py            the loop
    stock_output()    generate/outputs.py         padded sequences / GenerateDecoderOnlyOutput
"""

from __future__ import annotations

import time

import numpy as np
import torch

from hf_async_cb.config import BatchingConfig
from hf_async_cb.engine.engine import Engine
from hf_async_cb.engine.prompt_limits import PromptLimits, check_prompt, check_reach
from hf_async_cb.engine.prompt_embeds import PromptEmbeds
from hf_async_cb.engine.requests import Request
from hf_async_cb.generate.arguments import GenerateCall, parse_call
from hf_async_cb.generate.outputs import stock_output
from hf_async_cb.generate.prompt_learning import check_window
from hf_async_cb.generate.runtime import runtime_engine
from hf_async_cb.generate.stock_options import CallOptions, call_options, criteria_get_scores, penalty_start
from hf_async_cb.generate.streaming import LockstepStreamer, release_streamer
from hf_async_cb.model.checks import text_config_of
from hf_async_cb.model.eval_mode import as_in_eval
from hf_async_cb.model.model_guard import model_guard
from hf_async_cb.model.vision import merged_prompts


@torch.no_grad()
@torch.inference_mode(False)  # what the runtime keeps (fused weights, pool, graphs) outlives the caller's mode
def engine_generate(model, mode: str, batching_config, generation_config, arguments: dict):
    # The model's guard for the whole call, then eval mode (model/eval_mode.py) for the images' merge,
    # the checks and the steps: taken in this order, a stock call still running in another thread keeps
    # the modes it started with.
    try:
        with model_guard(model).held("generate", kind="outer"), as_in_eval(model):
            return _engine_generate(model, mode, batching_config, generation_config, arguments)
    except BaseException as error:
        # A refusal or a failed run ends the call's streamer, so that a consumer waiting on it in another
        # thread (TextIteratorStreamer) is released rather than hung (generate/streaming.py).
        release_streamer(arguments.get("streamer"), error)
        raise


def _engine_generate(model, mode: str, batching_config, generation_config, arguments: dict):
    call = parse_call(model, mode, generation_config, arguments)
    options = call_options(model, call, generation_config)
    config = batching_config or BatchingConfig()  # the hook resolved it (generate/hook.py)
    max_new = options.params.max_new_tokens
    page = config.page_size
    extra = call.virtual.count if call.virtual is not None else 0  # a PEFT adapter's virtual tokens
    pages_needed = sum(-(-(len(p) + extra + max_new) // page) for p in call.prompts) * call.copies
    _check_history_is_seen(call, options)  # before the engine is built or taken
    limits = PromptLimits.of(model, text_config_of(model.config))
    # Bad input refused before any pool is built or grown for it, once: the tensor check covers every
    # prompt token (and the padding: stock embeds every position, and fails there), the rows' checks
    # the rest; their requests (build_requests) are not checked again.
    outside = call.input_ids[(call.input_ids < 0) | (call.input_ids >= limits.vocab_size)]
    if outside.numel():
        raise ValueError(f"input_ids hold token ids outside the vocabulary [0, {limits.vocab_size}), padding "
                         f"included: {outside[:5].tolist()}")
    for prompt in call.prompts:
        check_prompt(prompt, options.params, limits, tokens_in_vocab=True)
    if limits.reach is not None:  # stock counts those positions over its padded rows
        width = max([call.input_ids.shape[1], *map(len, call.prompts)]) + extra
        check_reach(width + max_new - 1, limits, padded="the padded prompt width + max_new_tokens - 1")
    # The KV tokens the longest row can hold, counted as the engine counts them (Request.max_total_tokens:
    # the last sampled token is never fed). Counting prompt + max_new_tokens here refused, from the second
    # call on, a row that fits the pool exactly and that the first call (checked by the engine) had run.
    row_tokens = max((len(p) + extra + max_new - 1 for p in call.prompts), default=0)
    with runtime_engine(model, config.with_mode(mode), pages_needed, row_tokens) as engine:
        # The caches checked (one reading of the weights) before the images' merge reads the tower outputs.
        engine.check_caches()
        input_ids, requests, streamer = build_requests(engine, call, options)
        _start_clocks(options.criteria, call.arguments.get("stopping_criteria"))
        engine.run(requests, caches_checked=True)
        if streamer is not None:
            streamer.end()
    return stock_output(call, input_ids, requests)


def _reads_history(options: CallOptions) -> bool:
    """Whether the call's processors or criteria read each row's history as stock holds it (the
    slow path, and the history processors: padding included)."""
    return options.processor is not None or options.criteria is not None or options.params.reads_history


def _check_history_is_seen(call: GenerateCall, options: CallOptions) -> None:
    """A ValueError when the call's prompt is fed partly as embeddings the history does not show
    (inputs_embeds without input_ids, a PEFT adapter's virtual tokens) and something reads that
    history: stock's processors and criteria would see other rows than the engine keeps."""
    hidden = "inputs_embeds without input_ids" if call.inputs_embeds is not None and call.input_ids.shape[1] == 0 \
        else f"PEFT {call.virtual.method}" if call.virtual is not None else None
    if hidden and _reads_history(options):
        raise ValueError(f"{hidden}: stock generate's logits processors and stopping criteria then see a history "
                         "without the embedded prompt positions, which the engine does not reproduce; use "
                         "batching='off' for this call.")


def _start_clocks(criteria, own) -> None:
    """max_time's clock (stock's MaxTimeCriteria, made from the generation config) starts when the
    call has the model and its engine, as stock's starts in its own generate: not while the call
    waited for another thread's call, nor while the engine was built. A criterion the caller made
    keeps the clock the caller gave it."""
    from transformers.generation.stopping_criteria import MaxTimeCriteria

    for c in criteria or ():
        if isinstance(c, MaxTimeCriteria) and not any(c is mine for mine in own or ()):
            c.initial_timestamp = time.time()


def fed_prompts(model, call: GenerateCall, towers=None) -> tuple[list[list[int]], list[PromptEmbeds | None]]:
    """Per row of the call: the tokens its prompt feeds and what it feeds beyond their embeddings
    (the call's inputs_embeds, a vision-language model's merged images: model/vision.py, with the
    engine's TowerOutputCache `towers`; a PEFT prompt-tuning adapter's virtual tokens:
    generate/prompt_learning.py), or None."""
    sources = [name for name, value in (("inputs_embeds", call.inputs_embeds), ("images", call.media),
                                        ("a PEFT prompt-tuning adapter", call.virtual)) if value is not None]
    if len(sources) > 1:
        raise ValueError(f"generate(batching=...) takes one of {' and '.join(sources)} per call, not both.")
    prompts = call.prompts
    if call.media is not None:  # (its engine checked the tower outputs for this call: Engine.check_caches)
        return prompts, merged_prompts(model, call.input_ids, call.attention_mask, call.media, towers, content=None)
    if call.virtual is not None:
        check_window(model, call.virtual, call)
        rows = [call.virtual.prompt(p, len(prefix)) for p, prefix in zip(prompts, call.prefixes)]
        return [r[0] for r in rows], [r[1] for r in rows]
    if call.inputs_embeds is None:
        return prompts, [None] * len(prompts)
    mask = call.attention_mask.bool()
    return prompts, [PromptEmbeds(row[keep], np.arange(int(keep.sum())))
                     for row, keep in zip(call.inputs_embeds, mask)]


def build_requests(engine: Engine, call: GenerateCall, options: CallOptions):
    """The call's requests (copies of a row next to each other, sharing its prompt pages), the
    input ids they answer (rows repeated per copy) and the streamer fed from them, if any."""
    gc, params, processor = call.gc, options.params, options.processor
    input_ids, prefixes, attention_mask = call.input_ids, call.prefixes, call.attention_mask
    prompts, embeds = fed_prompts(engine.model, call, engine.tower_outputs)
    copies = call.copies
    if copies > 1:  # (parse_call refused greedy copies)
        input_ids = input_ids.repeat_interleave(copies, dim=0)
        prompts = [p for p in prompts for _ in range(copies)]
        prefixes = [p for p in prefixes for _ in range(copies)]
        embeds = [e for e in embeds for _ in range(copies)]
    slow = _reads_history(options)
    streamer = None
    if call.arguments.get("streamer") is not None:
        streamer = LockstepStreamer(call.arguments["streamer"], input_ids, call.pad)
    row_masks = attention_mask.repeat_interleave(copies, dim=0) if copies > 1 else attention_mask
    requests: list[Request] = [
        engine.make_request_from_ids(p, params, checked=True,
                                     logits_processor=processor(row_mask, row) if processor else None,
                                     stopping_criteria=options.criteria, history_prefix=prefix if slow else (),
                                     on_token=streamer.on_token if streamer else None, embeds=row_embeds)
        for row, (p, prefix, row_mask, row_embeds) in enumerate(zip(prompts, prefixes, row_masks, embeds))]
    if params.repetition_penalty != 1.0:
        for req, row_mask in zip(requests, row_masks):  # where stock's penalty reads this row from
            req.penalty_start = next(start for start in map(penalty_start, options.stock_processors(row_mask))
                                     if start is not None)
    keep = bool(gc.return_dict_in_generate and (gc.output_scores or gc.output_logits))
    for i, req in enumerate(requests):
        req.keep_scores = keep
        req.criteria_read_scores = criteria_get_scores(gc)
        if i % copies:
            req.share_from = requests[i - i % copies]  # copies share the first one's prompt pages
    if streamer is not None:
        streamer.watch(requests)
    return input_ids, requests, streamer
