"""The transformers hook: `model.generate(..., batching="sync" | "async")` runs on our Engine.

install() wraps GenerationMixin.generate. The wrapper takes `batching` and `batching_config` out of
the call (stock generate would reject them as unused model kwargs), reads `batching` from the call,
else from the GenerationConfig passed in, else from model.generation_config, and hands off to stock
generate when it is None or "off". Otherwise it turns the padded batch into requests, runs them on
an Engine, and pads the results back into stock generate's output format.
"""

from __future__ import annotations

import functools
import inspect
import logging
import torch

from .config import BatchingConfig, resolve_mode
from .engine import Engine
from .requests import SamplingParams
from .streaming import LockstepStreamer

logger = logging.getLogger(__name__)

_original_generate = None

# generate() arguments the engine does not implement; each must be left at its default.
_UNSUPPORTED_ARGUMENTS = (
    "prefix_allowed_tokens_fn", "assistant_model", "negative_prompt_ids", "negative_prompt_attention_mask",
    "custom_generate",
)
_ALLOWED_MODEL_KWARGS = {"attention_mask", "use_cache", "input_ids"}
_IGNORED_MODEL_KWARGS = {"output_attentions": False, "output_hidden_states": False}

# Other decoding strategies and outputs the engine does not produce, named in the error. (Anything
# missing here is still caught: by the generation-mode check, and by probing stock's processors.)
_UNSUPPORTED_GENERATION_OPTIONS = (
    ("num_beams", (None, 1)), ("num_beam_groups", (None, 1)), ("penalty_alpha", (None, 0, 0.0)),
    ("diversity_penalty", (None, 0.0)), ("constraints", (None,)), ("force_words_ids", (None,)),
    ("dola_layers", (None,)), ("encoder_repetition_penalty", (None, 1.0)),
    ("encoder_no_repeat_ngram_size", (None, 0)), ("guidance_scale", (None, 1.0)),
    ("watermarking_config", (None,)), ("output_attentions", (None, False)),
    ("output_hidden_states", (None, False)), ("prompt_lookup_num_tokens", (None,)),
    ("assistant_early_exit", (None,)), ("token_healing", (None, False)), ("use_mtp", (None, False)),
)


def _active(gc, options) -> list[str]:
    return [name for name, neutral in options if getattr(gc, name, None) not in neutral]


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        logger.warning(message)


def install() -> None:
    """Make `batching=` available on every transformers generative model (idempotent)."""
    global _original_generate
    from transformers import GenerationMixin

    from . import attention

    attention.register()
    if _original_generate is not None:
        return
    _original_generate = GenerationMixin.generate
    GenerationMixin.generate = _make_generate(_original_generate)


def uninstall() -> None:
    """Restore stock generate."""
    global _original_generate
    from transformers import GenerationMixin

    if _original_generate is not None:
        GenerationMixin.generate = _original_generate
        _original_generate = None


def is_installed() -> bool:
    return _original_generate is not None


def _make_generate(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def generate(self, *args, **kwargs):
        has_batching = "batching" in kwargs
        batching = kwargs.pop("batching", None)
        batching_config = kwargs.pop("batching_config", None)
        bound = signature.bind(self, *args, **kwargs)
        generation_config = bound.arguments.get("generation_config")
        mode = _resolve_call_mode(self, has_batching, batching, generation_config, batching_config)
        if mode is None:
            return original(self, *args, **kwargs)
        return _engine_generate(self, mode, batching_config, generation_config, bound.arguments)

    generate.__hf_async_cb__ = True
    return generate


def _resolve_call_mode(model, has_batching: bool, batching, generation_config, batching_config) -> str | None:
    if has_batching:
        return resolve_mode(batching)
    for source in (generation_config, getattr(model, "generation_config", None)):
        if source is not None and getattr(source, "batching", None) is not None:
            return resolve_mode(source.batching)
    config = batching_config
    if config is None and generation_config is not None:
        config = getattr(generation_config, "batching_config", None)
    return config.mode if isinstance(config, BatchingConfig) else None


@torch.no_grad()
def _engine_generate(model, mode: str, batching_config, generation_config, arguments: dict):
    for name in _UNSUPPORTED_ARGUMENTS:
        if arguments.get(name) is not None:
            raise ValueError(f"generate(batching={mode!r}) does not support `{name}` yet; drop it or use batching='off'.")
    if arguments.get("synced_gpus"):
        raise ValueError(f"generate(batching={mode!r}) does not support `synced_gpus`.")
    kwargs = dict(arguments.get("kwargs", {}))
    inputs = arguments.get("inputs")
    if "inputs_embeds" in kwargs:
        raise ValueError(f"generate(batching={mode!r}) needs input_ids; `inputs_embeds` is not supported.")
    if inputs is None:
        inputs = kwargs.pop("input_ids", None)
    else:
        kwargs.pop("input_ids", None)
    if inputs is None:
        raise ValueError(f"generate(batching={mode!r}) needs input_ids (a LongTensor [batch, length]).")
    tokenizer = kwargs.pop("tokenizer", None)  # for stop_strings, as stock generate takes it
    gc, model_kwargs = model._prepare_generation_config(generation_config, **kwargs)
    for key, neutral in _IGNORED_MODEL_KWARGS.items():
        if model_kwargs.get(key, neutral) == neutral:
            model_kwargs.pop(key, None)
    unknown = sorted(set(model_kwargs) - _ALLOWED_MODEL_KWARGS)
    if unknown:
        raise ValueError(f"generate(batching={mode!r}) does not support the arguments {unknown}.")
    bad = _active(gc, _UNSUPPORTED_GENERATION_OPTIONS)
    if bad:
        values = ", ".join(f"{n}={getattr(gc, n)!r}" for n in bad)
        raise ValueError(f"generate(batching={mode!r}) does not support {values} yet; use batching='off' for it.")
    strategy = gc.get_generation_mode()
    if strategy.value not in ("greedy_search", "sample"):
        raise ValueError(f"generate(batching={mode!r}) runs greedy search and sampling; this GenerationConfig "
                         f"asks for {strategy.value!r}. Use batching='off' for it.")

    input_ids = _check_input_ids(inputs, model)
    attention_mask = _attention_mask(input_ids, model_kwargs.get("attention_mask"), gc)
    prompts, prefixes = _unpad(input_ids, attention_mask)
    eos = _token_list(gc.eos_token_id)
    pad = gc.pad_token_id
    if isinstance(pad, torch.Tensor):
        pad = int(pad.flatten()[0])
    if pad is None and eos:
        logger.warning("Setting `pad_token_id` to `eos_token_id`:%d for open-end generation.", eos[0])
        pad = eos[0]
    max_new = _max_new_tokens(model, gc, generation_config, kwargs, input_ids)
    stock_processors, slow_processors, criteria, device_options = _slow_path(model, gc, input_ids, attention_mask,
                                                                             arguments, tokenizer)
    processor = stock_processors if slow_processors else None
    neutral = slow_processors  # stock's processor list then holds the warpers too
    params = SamplingParams(
        max_new_tokens=max_new,
        do_sample=bool(gc.do_sample),
        temperature=1.0 if neutral or gc.temperature is None else float(gc.temperature),
        top_k=0 if neutral else int(gc.top_k or 0),
        top_p=1.0 if neutral or gc.top_p is None else float(gc.top_p),
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
    config = batching_config or getattr(gc, "batching_config", None) or BatchingConfig()
    if not isinstance(config, BatchingConfig):
        raise ValueError(f"batching_config must be a hf_async_cb.BatchingConfig, got {type(config).__name__}.")
    page = config.page_size
    pages_needed = sum(-(-(len(p) + max_new) // page) for p in prompts) * (gc.num_return_sequences or 1)
    engine = Engine(model, config.with_mode(mode), max_pages_needed=pages_needed)
    try:  # the engine fused the model's projections: always give it back unfused
        copies = gc.num_return_sequences or 1
        if copies > 1:
            if not gc.do_sample:
                raise ValueError("num_return_sequences > 1 needs do_sample=True (greedy copies would all be the same), "
                                 "as in stock generate.")
            input_ids = input_ids.repeat_interleave(copies, dim=0)
            prompts = [p for p in prompts for _ in range(copies)]
            prefixes = [p for p in prefixes for _ in range(copies)]
        # The slow path and the history processors read each row's history as stock holds it (padding too).
        slow = processor is not None or criteria is not None or params.reads_history
        streamer = None
        if arguments.get("streamer") is not None:
            streamer = LockstepStreamer(arguments["streamer"], input_ids, pad)
        row_masks = attention_mask.repeat_interleave(copies, dim=0) if copies > 1 else attention_mask
        requests = [engine.make_request(p, params, logits_processor=processor(row_mask) if processor else None,
                                        stopping_criteria=criteria, history_prefix=prefix if slow else (),
                                        on_token=streamer.on_token if streamer else None)
                    for p, prefix, row_mask in zip(prompts, prefixes, row_masks)]
        if params.repetition_penalty != 1.0:
            for req, row_mask in zip(requests, row_masks):  # where stock's penalty reads this row from
                req.penalty_start = next(start for start in map(penalty_start, stock_processors(row_mask))
                                         if start is not None)
        keep = bool(gc.return_dict_in_generate and (gc.output_scores or gc.output_logits))
        for i, req in enumerate(requests):
            req.keep_scores = keep
            if i % copies:
                req.share_from = requests[i - i % copies]  # copies share the first one's prompt pages
        if streamer is not None:
            streamer.watch(requests)
        engine.run(requests)
        if streamer is not None:
            streamer.end()
    finally:
        engine.close()
    sequences = _pad_outputs(input_ids, [r.output_token_ids for r in requests], pad)
    if gc.return_dict_in_generate:
        from transformers.generation.utils import GenerateDecoderOnlyOutput

        steps = sequences.shape[1] - input_ids.shape[1]
        return GenerateDecoderOnlyOutput(
            sequences=sequences,
            scores=_per_step([r.output_scores for r in requests], steps) if gc.output_scores else None,
            logits=_per_step([r.output_logits for r in requests], steps) if gc.output_logits else None,
        )
    return sequences


def _per_step(rows: list[list[torch.Tensor]], steps: int) -> tuple[torch.Tensor, ...]:
    """Per-request lists of [V] tensors -> stock's tuple of [batch, V] per step. Steps after a row
    finished hold NaN (stock computes values there from pad inputs; nobody should read them)."""
    vocab = next(len(r[0]) for r in rows if r)
    out = []
    for t in range(steps):
        filler = torch.full((vocab,), float("nan"))
        out.append(torch.stack([r[t] if t < len(r) else filler for r in rows]))
    return tuple(out)


def _max_new_tokens(model, gc, generation_config, kwargs: dict, input_ids: torch.Tensor) -> int:
    """Stock generate's own length rules (max_new_tokens over max_length, 20 new tokens by default,
    min_new_tokens -> min_length), applied to `gc` in place as stock applies them."""
    if gc.max_new_tokens is not None and gc.max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be >= 1, got {gc.max_new_tokens}.")
    defaults = [model.generation_config] + ([generation_config] if generation_config is not None else [])
    has_default_max = kwargs.get("max_length") is None and all(c.max_length is None for c in defaults)
    has_default_min = kwargs.get("min_length") is None and all(c.min_length is None for c in defaults)
    input_len = input_ids.shape[1]
    model._prepare_generated_length(gc, has_default_max, has_default_min, "input_ids", input_len, input_ids)
    model._validate_generated_length(gc, input_len, has_default_max)  # ValueError when max_length <= input
    return gc.max_length - input_len


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
    from transformers.generation.logits_process import (MinLengthLogitsProcessor, MinNewTokensLengthLogitsProcessor,
                                                        MinPLogitsWarper, NoBadWordsLogitsProcessor,
                                                        NoRepeatNGramLogitsProcessor, RepetitionPenaltyLogitsProcessor,
                                                        SequenceBiasLogitsProcessor,
                                                        SuppressTokensAtBeginLogitsProcessor,
                                                        SuppressTokensLogitsProcessor, TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)
    from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

    if gc.stop_strings is not None and tokenizer is None:
        raise ValueError("stop_strings needs the tokenizer: pass generate(..., tokenizer=tokenizer), as stock does.")
    model._prepare_special_tokens(gc, True, device=input_ids.device)
    user_processors = arguments.get("logits_processor") or LogitsProcessorList()

    # One list per row, built with that row's attention mask: some processors read the mask (e.g.
    # repetition_penalty ignores padding in newer transformers) and must see a batch of one.
    def processor(row_mask: torch.Tensor):
        return model._get_logits_processor(
            generation_config=gc, input_ids_seq_length=input_ids.shape[1], encoder_input_ids=input_ids,
            logits_processor=user_processors, device=input_ids.device, model_kwargs={"attention_mask": row_mask[None]},
        )

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
        elif isinstance(p, NoBadWordsLogitsProcessor):  # a sequence bias of -inf per bad word
            device_options["bad_words_ids"] = tuple(p.sequence_bias)
        elif isinstance(p, SequenceBiasLogitsProcessor):
            device_options["sequence_bias"] = tuple(p.sequence_bias.items())
    if slow:
        _warn_once("Logits processors run on the engine's slow path: one call per request per step, on "
                   "the request's full history (correct, but slower than the built-in sampling options).")
    stock = model._get_stopping_criteria(generation_config=gc, stopping_criteria=arguments.get("stopping_criteria")
                                         or StoppingCriteriaList(), tokenizer=tokenizer)
    # Length and EOS are the engine's own; the rest is checked per request after each token.
    extra = [c for c in stock if not isinstance(c, (MaxLengthCriteria, EosTokenCriteria))]
    return processor, slow, (StoppingCriteriaList(extra) if extra else None), device_options


def _in_vocab(tokens, model) -> tuple[int, ...]:
    vocab = model.get_output_embeddings().out_features if model.get_output_embeddings() is not None \
        else model.config.vocab_size
    return tuple(int(t) for t in (tokens or ()) if 0 <= int(t) < vocab)


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


def _check_input_ids(inputs, model) -> torch.Tensor:
    if not isinstance(inputs, torch.Tensor):
        raise ValueError(f"input_ids must be a torch.LongTensor, got {type(inputs).__name__}.")
    if inputs.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"input_ids must hold integer token ids, got dtype {inputs.dtype}.")
    if inputs.dim() == 1:
        inputs = inputs[None]
    if inputs.dim() != 2:
        raise ValueError(f"input_ids must be [batch, length], got shape {tuple(inputs.shape)}.")
    if inputs.shape[0] == 0:
        raise ValueError("The batch is empty: input_ids has no rows.")
    if inputs.shape[1] == 0:
        raise ValueError("input_ids has zero length: every prompt needs at least one token.")
    return inputs


def _attention_mask(input_ids: torch.Tensor, mask, gc) -> torch.Tensor:
    """The mask stock generate would use: the given one, or input_ids != pad when pad is present."""
    if mask is None:
        pad = gc.pad_token_id
        eos = _token_list(gc.eos_token_id)
        if pad is not None and (input_ids == pad).any() and pad not in eos:
            return input_ids.ne(pad).long()
        return torch.ones_like(input_ids)
    if not isinstance(mask, torch.Tensor) or mask.shape != input_ids.shape:
        shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"attention_mask {shape} does not match input_ids {tuple(input_ids.shape)}.")
    return mask


def _unpad(input_ids: torch.Tensor, mask: torch.Tensor) -> tuple[list[list[int]], list[list[int]]]:
    """Left-padded rows -> (prompts, their padding). Right padding or holes would change the result:
    refuse them."""
    ids, keep = input_ids.tolist(), mask.bool().tolist()
    prompts, prefixes = [], []
    for row, (tokens, flags) in enumerate(zip(ids, keep)):
        if not any(flags):
            raise ValueError(f"row {row} of attention_mask is all zeros: every prompt needs at least one token.")
        first = flags.index(True)
        if not all(flags[first:]):
            raise ValueError(
                f"row {row} of attention_mask has padding after its first token: batching needs left padding "
                "(tokenizer.padding_side = 'left') and no holes."
            )
        prompts.append(tokens[first:])
        prefixes.append(tokens[:first])
    return prompts, prefixes


def _pad_outputs(input_ids: torch.Tensor, generated: list[list[int]], pad: int | None) -> torch.Tensor:
    width = max(len(g) for g in generated)
    if pad is None and any(len(g) < width for g in generated):
        raise RuntimeError("rows finished at different lengths but there is no pad_token_id to fill them")
    rows = [g + [pad] * (width - len(g)) for g in generated]
    new = torch.tensor(rows, dtype=input_ids.dtype, device=input_ids.device)
    return torch.cat([input_ids, new], dim=1)


def _token_list(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, torch.Tensor):
        return [int(v) for v in value.flatten().tolist()]
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]
