"""A generate() call's arguments, checked and read as stock generate reads them.

parse_call() refuses what the engine does not run (a ValueError naming the option, before any
work), builds the call's GenerationConfig with stock's own code, and turns the left-padded batch
into prompts: everything the engine needs, in one GenerateCall.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import numpy as np
import torch

from hf_async_cb.generate.cache_options import check_cache_implementation
from hf_async_cb.model.media_inputs import media_inputs
from hf_async_cb.generate.peft_routing import check_no_row_routing
from hf_async_cb.generate.prompt_learning import check_inputs_not_rewritten


# generate() arguments the engine does not implement; each must be left at its default.
_UNSUPPORTED_ARGUMENTS = (
    "assistant_model", "custom_generate",
)
_ALLOWED_MODEL_KWARGS = {"attention_mask", "use_cache", "input_ids"}
_IGNORED_MODEL_KWARGS = {"output_attentions": False, "output_hidden_states": False}

# Other decoding strategies and outputs the engine does not produce, named in the error. (Anything
# missing here is still caught: by the generation-mode check, and by probing stock's processors.)
_UNSUPPORTED_GENERATION_OPTIONS = (
    ("num_beams", (None, 1)), ("num_beam_groups", (None, 1)), ("penalty_alpha", (None, 0, 0.0)),
    ("constraints", (None,)), ("force_words_ids", (None,)),  # (diversity_penalty: group beams' alone)
    ("dola_layers", (None,)), ("output_attentions", (None, False)),
    ("output_hidden_states", (None, False)), ("prompt_lookup_num_tokens", (None,)),
    ("assistant_early_exit", (None,)), ("token_healing", (None, False)), ("use_mtp", (None, False)),
)


def _active(gc, options) -> list[str]:
    return [name for name, neutral in options if getattr(gc, name, None) not in neutral]


@dataclass
class GenerateCall:
    """One generate() call, read: the GenerationConfig, the padded batch and its prompts."""

    gc: object  # transformers.GenerationConfig for this call, as stock prepares it
    model_kwargs: dict
    kwargs: dict  # the call's generation keyword arguments (for stock's length rules)
    tokenizer: object | None
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    prompts: list[list[int]]
    prefixes: list[list[int]]  # each row's left padding
    eos: list[int]
    pad: int | None
    arguments: dict
    # inputs_embeds [batch, length, hidden] fed for the prompts (their rows aligned with attention_mask);
    # input_ids is then [batch, 0] when the call passed no ids (stock answers only the new tokens).
    inputs_embeds: torch.Tensor | None = None
    media: dict | None = None  # a vision-language model's image inputs (model/media_inputs.py), else None
    virtual: object = None  # a PEFT prompt-tuning adapter's VirtualTokens (generate/prompt_learning.py), else None

    @property
    def copies(self) -> int:
        return self.gc.num_return_sequences or 1


def parse_call(model, mode: str, generation_config, arguments: dict) -> GenerateCall:
    """Check the call and read it; raise ValueError for anything the engine does not run."""
    virtual = check_inputs_not_rewritten(model, mode)  # PEFT prompt learning
    check_no_row_routing(model, mode)  # PEFT's adapter_names=, task_ids=, ...
    for name in _UNSUPPORTED_ARGUMENTS:
        if arguments.get(name) is not None:
            raise ValueError(f"generate(batching={mode!r}) does not support `{name}` yet; drop it or use batching='off'.")
    if arguments.get("synced_gpus"):
        raise ValueError(f"generate(batching={mode!r}) does not support `synced_gpus`.")
    kwargs = dict(arguments.get("kwargs", {}))
    inputs = arguments.get("inputs")
    embeds = kwargs.pop("inputs_embeds", None)
    if inputs is None:
        inputs = kwargs.pop("input_ids", None)
    else:
        kwargs.pop("input_ids", None)
    if inputs is None and embeds is None:
        raise ValueError(f"generate(batching={mode!r}) needs input_ids (a LongTensor [batch, length]) or "
                         "inputs_embeds ([batch, length, hidden]).")
    embeds_only = inputs is None
    if embeds is not None:
        inputs = check_inputs_embeds(embeds, inputs, model)
    tokenizer = kwargs.pop("tokenizer", None)  # for stop_strings, as stock generate takes it
    kwargs.pop("trust_remote_code", None)  # (stock's, for a custom_generate from the Hub: refused above)
    for name in ("past_key_values", "cache"):  # (one argument under its old and new names)
        if kwargs.get(name) is not None:
            raise ValueError(f"generate(batching={mode!r}) does not take `{name}`: the engine keeps its own paged "
                             "cache (and reuses shared prefixes itself); drop it, or use batching='off' to continue "
                             "from a cache of your own.")
        kwargs.pop(name, None)
    gc, model_kwargs = model._prepare_generation_config(generation_config, **kwargs)
    _check_model_kwargs_as_stock(model, model_kwargs)
    media = media_inputs(model, model_kwargs, mode)  # a vision-language model's images and their kin
    for key, neutral in _IGNORED_MODEL_KWARGS.items():
        if model_kwargs.get(key, neutral) == neutral:
            model_kwargs.pop(key, None)
        elif not gc.return_dict_in_generate:
            # Stock computes them and returns the sequences alone (it warns the flag "may be ignored"):
            # the engine's sequences are the same. (This was refused as an unknown model argument.)
            model_kwargs.pop(key, None)
            setattr(gc, key, neutral)
        else:
            raise ValueError(f"generate(batching={mode!r}) does not return {key.removeprefix('output_')} "
                             f"({key}=True with return_dict_in_generate=True); use batching='off' for it.")
    unknown = sorted(set(model_kwargs) - _ALLOWED_MODEL_KWARGS)
    if unknown:
        raise ValueError(f"generate(batching={mode!r}) does not support the arguments {unknown}.")
    check_cache_implementation(gc, mode, kwargs)
    bad = _active(gc, _UNSUPPORTED_GENERATION_OPTIONS)
    if bad:
        values = ", ".join(f"{n}={getattr(gc, n)!r}" for n in bad)
        raise ValueError(f"generate(batching={mode!r}) does not support {values} yet; use batching='off' for it.")
    strategy = gc.get_generation_mode()
    if strategy.value not in ("greedy_search", "sample"):
        raise ValueError(f"generate(batching={mode!r}) runs greedy search and sampling; this GenerationConfig "
                         f"asks for {strategy.value!r}. Use batching='off' for it.")

    copies = gc.num_return_sequences  # stock runs 0 or -1 as one copy, and fails on 2.0 with a TypeError
    if copies is not None:
        if isinstance(copies, bool) or not isinstance(copies, (int, np.integer)) or copies < 1:
            raise ValueError(f"num_return_sequences must be a positive integer, got {copies!r}.")
        gc.num_return_sequences = copies = int(copies)
    if (copies or 1) > 1 and not gc.do_sample:
        raise ValueError("num_return_sequences > 1 needs do_sample=True (greedy copies would all be the same), "
                         "as in stock generate.")

    input_ids = check_input_ids(inputs, model)
    given_mask = model_kwargs.get("attention_mask")
    if embeds_only and given_mask is None:  # (no ids to infer padding from: stock attends to every position)
        given_mask = torch.ones(input_ids.shape, dtype=torch.long, device=input_ids.device)
    attention_mask = padding_mask(input_ids, given_mask, gc)
    inferred = "" if model_kwargs.get("attention_mask") is not None else \
        f" (inferred as input_ids != pad_token_id {gc.pad_token_id}, as stock does: none was passed)"
    prompts, prefixes = unpad(input_ids, attention_mask, inferred)
    given_eos = token_list(gc.eos_token_id, "eos_token_id")
    eos = [t for t in given_eos if t >= 0]  # a negative id: stock warns, and no token ever meets it
    pad = token_list(gc.pad_token_id, "pad_token_id")[:1]
    pad = pad[0] if pad else None
    if pad is None and given_eos:
        pad = given_eos[0]  # (negative too: stock fills the stopped rows with it)
    call = GenerateCall(gc, model_kwargs, kwargs, tokenizer, input_ids[:, :0] if embeds_only else input_ids,
                        attention_mask, prompts, prefixes, eos, pad, arguments, embeds, media, virtual)
    stops = ["stopping_criteria"] if arguments.get("stopping_criteria") else []
    stops += [name for name in ("stop_strings", "max_time") if getattr(gc, name, None) is not None]
    check_rows_stop_together(call, stops)
    return call


def _check_model_kwargs_as_stock(model, model_kwargs: dict) -> None:
    """Stock's own check of the model arguments, first: an argument the model does not take (a typo:
    `max_new_token=`) gets stock's ValueError, which says so, rather than ours for arguments the
    engine does not run."""
    validate = getattr(model, "_validate_model_kwargs", None)
    if not callable(validate):
        return
    try:
        validate(dict(model_kwargs))
    except ValueError:
        raise
    except Exception:  # noqa: BLE001 - stock's check failing otherwise (another version's): ours follows
        pass


def check_rows_stop_together(call: GenerateCall, stops: list[str]) -> None:
    """Refuse, before any work, a batch whose rows a stopping criterion may end apart when there is
    no EOS: stock generate pads a stopped row only behind EOS, and otherwise keeps generating real
    tokens on it until every row has stopped, which the engine (each request ends on its own) does
    not reproduce; with no pad_token_id either, it could not even fill the stopped rows."""
    rows = call.input_ids.shape[0] * call.copies
    if stops and rows > 1 and not call.eos:
        missing = "no eos_token_id" + (" nor pad_token_id" if call.pad is None else "")
        raise ValueError(
            f"rows can stop at different lengths ({', '.join(stops)}) and there is {missing}: stock generate "
            "then keeps generating on the rows that stopped until every row has, which the engine does not do. "
            "Pass eos_token_id=... (and pad_token_id=...), generate one row at a time, or use batching='off'."
        )


def max_new_tokens(model, gc, generation_config, kwargs: dict, input_ids: torch.Tensor,
                   inputs_embeds: torch.Tensor | None = None) -> int:
    """Stock generate's own length rules (max_new_tokens over max_length, 20 new tokens by default,
    min_new_tokens -> min_length; max_length counts the embeddings of a call without input_ids),
    applied to `gc` in place as stock applies them."""
    # Integral floats run in stock (max_new_tokens=3.0): use them as ints. Other fractions would
    # make stock round the length up by accident of its comparisons: refuse them.
    gc.max_new_tokens = _whole("max_new_tokens", gc.max_new_tokens)
    gc.max_length = _whole("max_length", gc.max_length)
    if gc.max_new_tokens is not None and gc.max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be >= 1, got {gc.max_new_tokens}.")
    defaults = [model.generation_config] + ([generation_config] if generation_config is not None else [])
    has_default_max = kwargs.get("max_length") is None and all(c.max_length is None for c in defaults)
    has_default_min = kwargs.get("min_length") is None and all(c.min_length is None for c in defaults)
    input_len = input_ids.shape[1]
    name, tensor = ("input_ids", input_ids) if inputs_embeds is None else ("inputs_embeds", inputs_embeds)
    model._prepare_generated_length(gc, has_default_max, has_default_min, name, input_len, tensor)
    model._validate_generated_length(gc, input_len, has_default_max)  # ValueError when max_length <= input
    return int(gc.max_length) - input_len


def _whole(name: str, value):
    """An integer length option as an int (an integral float too, as stock runs it); None stays."""
    if value is None or isinstance(value, int):
        return value  # bools included: stock runs max_new_tokens=True as one token
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.dtype.is_complex:
        value = value.item()  # (stock runs max_new_tokens=torch.tensor(5))
        if isinstance(value, int):  # (bools too, as above)
            return value
    if isinstance(value, (float, np.floating, np.integer)) and float(value).is_integer():
        return int(value)
    raise ValueError(f"{name} must be an integer, got {value!r}.")


def check_inputs_embeds(embeds, input_ids, model) -> torch.Tensor:
    """Check inputs_embeds ([batch, length, hidden], floating point, matching input_ids when given,
    a model whose generate takes them); returns the token ids of the prompts: input_ids, or
    placeholders (0) for a call without them."""
    if "inputs_embeds" not in inspect.signature(model.prepare_inputs_for_generation).parameters:
        # (stock refuses them alike: such a model, e.g. Gemma 3's or PaliGemma's, builds its masks from ids)
        raise ValueError(f"{type(model).__name__} takes no inputs_embeds in generate: its "
                         "prepare_inputs_for_generation does not forward them (stock generate refuses them too).")
    if not isinstance(embeds, torch.Tensor) or embeds.dim() != 3 or not embeds.dtype.is_floating_point:
        what = f"{embeds.dtype} tensor of shape {tuple(embeds.shape)}" if isinstance(embeds, torch.Tensor) \
            else type(embeds).__name__
        raise ValueError(f"inputs_embeds must be a floating-point tensor [batch, length, hidden], got a {what}.")
    weight = getattr(model.get_input_embeddings(), "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dtype.is_floating_point and embeds.dtype != weight.dtype:
        # Stock runs the prompt in the embeddings' dtype (its rotary tables follow them) and the new
        # tokens in the model's: one precision for both would give other tokens.
        raise ValueError(f"inputs_embeds are {embeds.dtype} and the model's embeddings {weight.dtype}: stock generate "
                         f"would run the prompt in {embeds.dtype} and the new tokens in {weight.dtype}; pass "
                         f"inputs_embeds.to({weight.dtype}).")
    if input_ids is None:
        return torch.zeros(embeds.shape[:2], dtype=torch.long, device=embeds.device)
    if isinstance(input_ids, torch.Tensor) and tuple(input_ids.shape) != tuple(embeds.shape[:2]):
        raise ValueError(f"inputs_embeds {tuple(embeds.shape)} does not match input_ids {tuple(input_ids.shape)}: "
                         "give one embedding per token.")
    return input_ids


def check_input_ids(inputs, model) -> torch.Tensor:
    if not isinstance(inputs, torch.Tensor):
        raise ValueError(f"input_ids must be a torch.LongTensor, got {type(inputs).__name__}.")
    if inputs.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"input_ids must hold integer token ids, got dtype {inputs.dtype}.")
    if inputs.dim() != 2:  # stock fails on a 1-D tensor too (an IndexError)
        hint = " (one prompt: input_ids[None])" if inputs.dim() == 1 else ""
        raise ValueError(f"input_ids must be [batch, length], got shape {tuple(inputs.shape)}{hint}.")
    if inputs.shape[0] == 0:
        raise ValueError("The batch is empty: input_ids has no rows.")
    if inputs.shape[1] == 0:
        raise ValueError("input_ids has zero length: every prompt needs at least one token.")
    return inputs


def padding_mask(input_ids: torch.Tensor, mask, gc) -> torch.Tensor:
    """The mask stock generate would use: the given one, or input_ids != pad when pad is present."""
    if mask is None:
        pad = gc.pad_token_id
        eos = token_list(gc.eos_token_id, "eos_token_id")
        if pad is not None and (input_ids == pad).any() and pad not in eos:
            return input_ids.ne(pad).long()
        return torch.ones_like(input_ids)
    if not isinstance(mask, torch.Tensor) or mask.shape != input_ids.shape:
        shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"attention_mask {shape} does not match input_ids {tuple(input_ids.shape)}.")
    return mask


def unpad(input_ids: torch.Tensor, mask: torch.Tensor, inferred: str = "") -> tuple[list[list[int]], list[list[int]]]:
    """Left-padded rows -> (prompts, their padding). Right padding or holes would change the result:
    refuse them (`inferred`: how the mask was made, when the caller passed none). The mask is read as
    a tensor (one pass in torch, not one per token in Python: a 256 x 1K batch is 260K tokens)."""
    if mask.dtype != torch.bool:  # stock reads other values as weights of positions (mask.cumsum)
        odd = (mask != 0) & (mask != 1)
        if odd.any():
            row = int(odd.any(dim=1).nonzero()[0])
            value = mask[row][odd[row]][0].item()
            raise ValueError(f"row {row} of attention_mask{inferred} holds {value!r}: a padding mask holds 1 for a "
                             "token and 0 for padding, nothing else (stock generate would take other values into "
                             "its position ids).")
    keep = mask.bool()
    if keep.shape[1] == 0 or not keep.any(dim=1).all():
        row = 0 if keep.shape[1] == 0 else int((~keep.any(dim=1)).nonzero()[0])
        raise ValueError(f"row {row} of attention_mask{inferred} is all zeros: every prompt needs at least one "
                         "token.")
    lengths = keep.sum(dim=1)
    width = keep.shape[1]
    # Left padding: each row's kept positions are its last `length` ones.
    holes = keep.long().cumsum(dim=1) != (torch.arange(1, width + 1, device=keep.device)
                                          - (width - lengths)[:, None]).clamp(min=0)
    if holes.any():
        row = int(holes.any(dim=1).nonzero()[0])
        raise ValueError(
            f"row {row} of attention_mask{inferred} has padding after its first token: batching needs left "
            "padding (tokenizer.padding_side = 'left') and no holes" +
            (", so pass the attention_mask when a prompt holds the pad token." if inferred else ".")
        )
    firsts = (width - lengths).tolist()
    ids = input_ids.tolist()
    return [tokens[first:] for tokens, first in zip(ids, firsts)], [tokens[:first] for tokens, first in zip(ids, firsts)]


def token_list(value, name: str = "token ids") -> list[int]:
    """One token id or several (ints, integral floats as stock takes them, a tensor) as a list of ints."""
    if value is None:
        return []
    if isinstance(value, torch.Tensor):
        value = value.flatten().tolist()
    values = value if isinstance(value, (list, tuple)) else [value]
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) or not float(v).is_integer():
            raise ValueError(f"{name} must be an integer token id or a list of them, got {value!r}.")
        out.append(int(v))
    return out
