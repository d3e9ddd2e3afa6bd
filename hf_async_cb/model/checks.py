"""The models the engine refuses by their kind alone (encoder-decoder, ALiBi, non-attention
layers, ...), with the reason; every other family is checked by running it (engine/parity.py)."""

from __future__ import annotations

import torch

from hf_async_cb.model.batch_invariance import check_rows_computed_apart

# Config attributes that change attention or logits in ways the engine does not implement.
_UNSUPPORTED_CONFIG = {
    "alibi": "ALiBi position biases",
}


def check_model_supported(model: torch.nn.Module, trust_untested_model: bool = False) -> None:
    """Raise ValueError naming why `model` cannot run on the engine, if its kind alone says so.
    (Every other family is checked by running it: engine/parity.py.)"""
    from transformers import GenerationMixin

    config = getattr(model, "config", None)
    name = type(model).__name__
    if config is None or not isinstance(model, GenerationMixin):
        if callable(getattr(model, "get_base_model", None)):  # a PEFT wrapper: its adapters live in the base model
            raise ValueError(f"{name} is a PEFT wrapper, not a transformers generative model: pass "
                             "model.get_base_model() (its adapter layers stay in it and run), or call the "
                             "wrapper's own generate(..., batching=...).")
        raise ValueError(f"{name} is not a transformers generative model.")
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"{name} is an encoder-decoder model; hf_async_cb runs decoder-only models.")
    if type(model).generate is not GenerationMixin.generate:
        raise ValueError(f"{name} overrides generate(); hf_async_cb runs plain decoder-only language models.")
    devices = {p.device for p in model.parameters()}
    if torch.device("meta") in devices or _offloaded(model):
        raise ValueError(f"{name}'s weights are offloaded (accelerate's CPU/disk offload: weights on the 'meta' "
                         "device, loaded into each layer as it runs): hf_async_cb needs every weight in memory on "
                         "the device that runs it. Load the model without offload (one device), or tensor-parallel "
                         "with from_pretrained(..., tp_plan='auto') under torchrun.")
    if len(devices) > 1:
        raise ValueError(f"{name}'s weights are spread over {sorted(map(str, devices))} (a device_map): hf_async_cb "
                         "runs a model on one device, or tensor-parallel across processes (from_pretrained(..., "
                         "tp_plan='auto') under torchrun); load it on one device, or with a tp_plan.")
    config = text_config_of(config)
    layer_types = getattr(config, "layer_types", None)
    # (chunked attention only where its chunk is known: full_attention_reach bounds the rows by it)
    known = ("full_attention", "sliding_attention") + (
        ("chunked_attention",) if isinstance(getattr(config, "attention_chunk_size", None), int) else ())
    other = sorted({t for t in layer_types or () if t not in known})
    if other:
        raise ValueError(f"{name} has layers of a kind other than full or sliding-window attention ({other}); "
                         "hf_async_cb does not support them.")
    if _tunes_temperature(config) and not isinstance(getattr(config, "floor_scale", None), (int, float)):
        raise ValueError(f"{name} uses attention temperature tuning without a floor_scale, which hf_async_cb cannot "
                         "bound: it does not support it.")
    for attr, what in _UNSUPPORTED_CONFIG.items():
        if getattr(config, attr, None):
            raise ValueError(f"{name} uses {what} ({attr}={getattr(config, attr)!r}), which hf_async_cb does not support.")
    if getattr(config, "is_causal", True) is False:
        raise ValueError(f"{name} has bidirectional attention (is_causal=False); hf_async_cb needs a causal LM.")
    window = getattr(config, "sliding_window", None)
    if (type(window) is int and window == 1 and getattr(config, "use_sliding_window", True) is not False
            and (layer_types is None or "sliding_attention" in layer_types)):
        raise ValueError(f"{name} has sliding_window=1 (each token sees itself alone): stock generate's own cache "
                         "keeps no past token there and its tokens differ from its uncached forward's, so the "
                         "engine has no stock tokens to give; use batching='off', or a window of 2 or more.")
    check_rows_computed_apart(model)  # per-tensor activation quantization (model/batch_invariance.py)


def full_attention_reach(config) -> tuple[int, str] | None:
    """(positions, what) within which a model's position-dependent attention is plain causal
    attention, or None where it always is. Llama 4: its chunked-attention layers see only the keys of
    their own chunk of `attention_chunk_size` positions, and its NoPE layers' temperature tuning scales
    queries by log1p(floor((i + 1) / floor_scale)), with i counted from the start of stock's cache
    (left padding included) and, in a packed step, from the step's first token. Below one chunk
    every key is in the query's chunk, and below floor_scale - 1 the scale is exactly 1: the engine
    runs such a model as full causal attention while every position fed stays within the reach (the
    prompt checks), and a step holds fewer tokens than floor_scale - 1 (step_token_cap)."""
    config = text_config_of(config)
    found = []
    chunk = getattr(config, "attention_chunk_size", None)
    if "chunked_attention" in (getattr(config, "layer_types", None) or ()) and isinstance(chunk, int):
        found.append((chunk, f"its chunked-attention layers' chunk of {chunk} positions (attention_chunk_size)"))
    floor = step_token_cap(config)
    if floor is not None:
        found.append((floor, f"its NoPE layers' attention temperature tuning, which scales queries from position "
                      f"{floor} on (floor_scale={config.floor_scale})"))
    return min(found) if found else None


def _tunes_temperature(config) -> bool:
    """Whether the config's NoPE layers (a 0 in `no_rope_layers`) scale their queries by position (Llama 4)."""
    return bool(getattr(config, "attn_temperature_tuning", False)) and 0 in (getattr(config, "no_rope_layers", None) or ())


def step_token_cap(config) -> int | None:
    """The most tokens an engine step may hold for the model (full_attention_reach): floor_scale - 1
    where its NoPE layers tune their temperature, else None."""
    config = text_config_of(config)
    scale = getattr(config, "floor_scale", None)
    return max(1, int(scale) - 1) if _tunes_temperature(config) and isinstance(scale, (int, float)) else None


def _offloaded(model: torch.nn.Module) -> bool:
    """Whether accelerate's hooks load some module's weights at each call (offload), even where the
    parameters the module shows are real tensors (a CPU offload keeps them in a weights map)."""
    for m in model.modules():
        hook = getattr(m, "_hf_hook", None)
        for h in getattr(hook, "hooks", None) or ([hook] if hook is not None else []):
            if getattr(h, "offload", False):
                return True
    return False


def tensor_parallel_size(model: torch.nn.Module) -> int:
    """How many ranks share the model's layers (transformers' tp_plan sets it); 1 for a plain model."""
    return getattr(model, "_tp_size", None) or 1


def model_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype of the model's activations: its first floating-point parameter's (float32 if none)."""
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def text_config_of(config):
    """The config of the language model: the config itself, or a composite config's text part."""
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if callable(get) else config


def max_positions(config) -> int | None:
    for attr in ("max_position_embeddings", "n_positions"):
        value = getattr(config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def has_learned_positions(model: torch.nn.Module) -> bool:
    """Whether the model looks positions up in a fixed table (GPT-2's wpe, OPT's and BioGPT's
    embed_positions, CTRL's pos_encoding, CodeGen's and GPT-J's precomputed rotary table), which
    cannot go past its length, unlike RoPE computed on the fly or ALiBi: an embedding other than
    the token one whose name speaks of positions, a fixed position encoding tensor, or a buffer
    named for positions with one row per position. (Sinusoidal tables that grow on demand, XGLM's,
    are modules of their own kind, not embeddings, and are not limits.)"""
    tokens = model.get_input_embeddings()
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1].lower()
        if isinstance(module, torch.nn.Embedding) and module is not tokens and ("pos" in leaf or leaf == "wpe"):
            return True
        if isinstance(getattr(module, "pos_encoding", None), torch.Tensor):
            return True
    limit = max_positions(text_config_of(model.config))
    return limit is not None and any(
        "pos" in name.rsplit(".", 1)[-1].lower() and buffer.dim() >= 2 and buffer.shape[0] == limit
        for name, buffer in model.named_buffers())


_LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


def rope_switch_length(model: torch.nn.Module) -> tuple[int, str] | None:
    """(length, rope type) where the model's RoPE starts to depend on the longest sequence of a
    forward, or None. Dynamic NTK and LongRoPE (transformers' dynamic_rope_update) pick their
    frequencies for a whole forward from its largest position: past their original length the
    result depends on which sequences share a forward and on when the cache was filled (Phi-3's
    generate even refills it at the crossing), which the engine's batches cannot reproduce."""
    found = None
    for module in model.modules():
        kinds = getattr(module, "rope_type", None)
        kinds = kinds if isinstance(kinds, dict) else {None: kinds}
        for layer_type, kind in kinds.items():
            if not isinstance(kind, str) or not any(k in kind for k in _LENGTH_DEPENDENT_ROPE):
                continue
            length = getattr(module, "original_max_seq_len", None)
            if "longrope" in kind:
                params = getattr(getattr(module, "config", None), "rope_parameters", None) or {}
                params = params.get(layer_type, params) if layer_type is not None else params
                length = params.get("original_max_position_embeddings", length) if isinstance(params, dict) else length
            if isinstance(length, int) and length > 0 and (found is None or length < found[0]):
                found = (length, kind)
    return found
