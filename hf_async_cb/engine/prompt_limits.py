"""What a prompt may be on a model: token ids in its vocabulary, within its positions.

Checked for every request as it is made (Engine.make_request), so that a prompt that cannot run is
a ValueError naming the limit, before any step: ids outside the vocabulary, a prompt longer than
the model's positions, a learned position table too short for prompt + max_new_tokens, or a RoPE
whose frequencies switch with the longest sequence of a forward (model/checks.rope_switch_length).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from hf_async_cb.model.embeddings_path import input_vocab_size
from hf_async_cb.model.checks import full_attention_reach, has_learned_positions, max_positions, rope_switch_length


@dataclass(frozen=True)
class PromptLimits:
    vocab_size: int
    max_positions: int | None
    learned_positions: bool
    rope_switch: tuple[int, str] | None  # (length, rope type) past which the frequencies switch
    reach: tuple[int, str] | None = None  # (positions, what) within which attention is plain causal

    @classmethod
    def of(cls, model: torch.nn.Module, text_config) -> "PromptLimits":
        return cls(input_vocab_size(model), max_positions(text_config),
                   has_learned_positions(model), rope_switch_length(model), full_attention_reach(text_config))


def check_reach(fed_positions: int, limits: PromptLimits, padded: str = "") -> None:
    """A ValueError when `fed_positions` (the positions a row feeds, counted as stock counts them)
    run past the model's full-attention reach (model/checks.full_attention_reach). `padded`: how
    the count was made, for the message."""
    if limits.reach is not None and fed_positions > limits.reach[0]:
        reach, what = limits.reach
        raise ValueError(
            f"{padded or 'prompt + max_new_tokens - 1'} = {fed_positions} positions run past {reach}, the reach of "
            f"{what}: the engine runs this model's attention as plain causal attention, which it is within "
            f"that reach only. Keep the prompt (with its padding) + max_new_tokens within {reach + 1}, or run "
            "stock generate (batching='off').")


def check_prompt(ids: list[int], params, limits: PromptLimits, tokens_in_vocab: bool = False) -> None:
    """Raise ValueError when prompt `ids` with `params` (SamplingParams) cannot run within `limits`.
    `tokens_in_vocab`: the caller checked the ids against the vocabulary already (no pass over them)."""
    bad = [] if tokens_in_vocab else [t for t in ids if not 0 <= t < limits.vocab_size]
    if bad:
        raise ValueError(f"prompt has token ids outside the vocabulary [0, {limits.vocab_size}): {bad[:5]}")
    sequences = {"bad_words_ids": [t for w in params.bad_words_ids for t in w],
                 "sequence_bias": [t for key, _ in params.sequence_bias for t in key]}
    for name in ("bad_words_ids", "sequence_bias"):  # ((begin_)suppress_tokens: see known_suppressed)
        outside = [t for t in sequences.get(name, getattr(params, name)) if not 0 <= t < limits.vocab_size]
        if outside:
            raise ValueError(f"{name} has token ids outside the vocabulary [0, {limits.vocab_size}): {outside[:5]}")
    fed_positions = len(ids) + params.max_new_tokens - 1  # (the last token is sampled, never fed)
    # (The RoPE switch first: where it applies, it is the reason a longer prompt cannot run.)
    if limits.rope_switch is not None and fed_positions > limits.rope_switch[0]:
        length, kind = limits.rope_switch
        raise ValueError(
            f"prompt ({len(ids)}) + max_new_tokens ({params.max_new_tokens}) runs past {length} positions, where "
            f"the model's {kind!r} RoPE starts to pick its frequencies by the longest sequence in a forward: past "
            "it stock generate's tokens depend on which sequences share a forward and on when the cache was "
            "filled, which the engine's batches cannot reproduce. Keep prompt + max_new_tokens within "
            f"{length + 1}, or run stock generate (batching='off').")
    check_reach(fed_positions, limits)
    if limits.max_positions is not None:
        if len(ids) > limits.max_positions:
            raise ValueError(
                f"prompt of {len(ids)} tokens is longer than the model's maximum of {limits.max_positions}."
            )
        if limits.learned_positions and fed_positions > limits.max_positions:
            raise ValueError(
                f"prompt ({len(ids)}) + max_new_tokens ({params.max_new_tokens}) runs past the model's "
                f"{limits.max_positions} positions of its position table; lower max_new_tokens."
            )


def history_ids(history_prefix, vocab_size: int) -> list[int]:
    """Engine.make_request's `history_prefix` as a list of ints, checked as a prompt's ids are: integers
    only (a float or a bool was truncated by int(), silently) and in the vocabulary (the history options
    skipped an id outside it without a word, and stock's processors on the slow path index their scores
    with it). generate() passes each row's left padding, which it checked with the prompt."""
    from hf_async_cb.engine.requests import _as_int

    if isinstance(history_prefix, (str, bytes)) or not hasattr(history_prefix, "__iter__"):
        raise ValueError(f"history_prefix must be a sequence of integer token ids, got {history_prefix!r}.")
    if isinstance(history_prefix, (torch.Tensor, np.ndarray)) and history_prefix.ndim != 1:
        raise ValueError(f"history_prefix must be 1-D, got shape {tuple(history_prefix.shape)}.")
    ids = [_as_int(t) for t in history_prefix]
    for t, v in zip(history_prefix, ids):
        if v is None:
            raise ValueError(f"history_prefix holds {t!r} ({type(t).__name__}): token ids must be integers.")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"history_prefix has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
    return ids


def known_suppressed(params, vocab_size: int):
    """`params` (SamplingParams) with the (begin_)suppress_tokens outside the vocabulary left out:
    stock ignores them, as generate() does here (generate/stock_options.py)."""
    names = ("suppress_tokens", "begin_suppress_tokens")
    kept = {name: tuple(t for t in getattr(params, name) if 0 <= t < vocab_size) for name in names}
    if all(kept[name] == getattr(params, name) for name in names):
        return params
    return replace(params, **kept)
