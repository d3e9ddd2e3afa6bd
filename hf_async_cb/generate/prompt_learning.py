"""PEFT prompt learning: prompt tuning and p-tuning run as prompt embeddings, prefix tuning as
keys and values given per layer; any other per-step input rewriting is refused before any work.

Stock generate builds each step's model inputs with the model's prepare_inputs_for_generation.
PEFT's prompt learning methods (prefix tuning, prompt tuning, p-tuning, multitask prompt tuning,
...) reach the base model's generate with that method replaced on the model instance by their own
(PeftModelForCausalLM.generate sets it on the base model for the duration of the call): it adds
the virtual tokens, as prompt embeddings in front of the prompt, or as past keys and values in
every layer. The engine builds its inputs itself, from token ids, so such a model would silently
generate as the base model: each method is read here and fed as the engine's own inputs.

Prompt tuning and p-tuning put the adapter's virtual-token embeddings (the same for every row)
in front of each prompt: the engine feeds them as prompt embeddings (engine/prompt_embeds.py) at
placeholder tokens in front of the prompt, with PEFT's positions (it drops generate's position ids,
so the model counts positions from the cache: a row's left padding shifts its tokens' positions).

Prefix tuning gives, per layer, keys and values for its virtual tokens (PEFT's get_prompt: the
same for every row; the keys used as they are, without rotary) that every prompt token attends
to. The engine puts placeholder tokens in front of each prompt whose K/V it replaces with the
adapter's before storing them (model/prefix_kv.py); the pages holding them are keyed by the
adapter's content, so the rows of a call and later calls share them, never a plain prompt or
another adapter. The real tokens take PEFT's positions: the virtual tokens plus the count of real
tokens before them (PEFT adds num_virtual_tokens to generate's position ids, which skip the left
padding), which are the engine's own positions after the placeholders. PEFT's cartridges are
served as prefix tuning is and run the same way. (Stock PEFT 0.21 generate on transformers 5.24
hands the prefix to the model as `past_key_values`, which the model drops for the `cache` that
generate passes: there stock generates without the prefix, from shifted positions. The engine
runs the prefix as PEFT's forward does, and as stock generate does once the prefix reaches the
cache: tests/test_prefix_tuning.py.)

Refused by name: multitask prompt tuning, CPT and any other prompt-learning method; any other
replacement of that method on the instance, whose effect the engine cannot know (PEFT puts the
model's own method back on the instance after a call: that one is not a replacement); a prefix
for an encoder-decoder (two transformer submodules) or whose K/V shapes are not the model's
cache's; and, on a sliding-window model, left-padded rows whose context exceeds the window (stock's
cache holds the padding between the virtual tokens and the row, and its window counts it).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch

from hf_async_cb.engine.prompt_embeds import PromptEmbeds, content_keys
from hf_async_cb.model.prefix_kv import PrefixKV

_EMBEDDED_METHODS = ("PROMPT_TUNING", "P_TUNING")
_PREFIX_METHODS = ("PREFIX_TUNING", "CARTRIDGE")  # (PEFT serves both as past keys and values)


@dataclass
class VirtualTokens:
    """A prompt-tuning adapter's virtual tokens: [n, hidden] embeddings fed before every prompt."""

    values: torch.Tensor
    method: str
    key: bytes  # their content (the prefix cache shares their pages between rows and calls)

    @property
    def count(self) -> int:
        return self.values.shape[0]

    def prompt(self, tokens: list[int], padding: int, placeholder: int = 0) -> tuple[list[int], PromptEmbeds]:
        """A row's prompt with the virtual tokens in front, and what they feed: positions as PEFT's
        forward counts them, the row's `padding` included after the virtual tokens."""
        n = self.count
        rope = None
        if padding:
            rope = np.concatenate([np.arange(n), np.arange(n + padding, n + padding + len(tokens))])[None]
        embeds = PromptEmbeds(self.values, np.arange(n), key=self.key, rope=rope, rope_delta=padding)
        return [placeholder] * n + list(tokens), embeds


@dataclass
class PrefixTokens:
    """A prefix-tuning adapter's virtual tokens: per-layer K/V for `count` positions before every prompt."""

    kv: PrefixKV
    method: str

    @property
    def count(self) -> int:
        return self.kv.count

    def prompt(self, tokens: list[int], padding: int, placeholder: int = 0) -> tuple[list[int], PromptEmbeds]:
        """A row's prompt with placeholders for the virtual tokens in front, and the K/V given for
        them. Positions are the engine's own (PEFT's: the left padding does not count)."""
        width = self.kv.keys[0].shape[-1]
        embeds = PromptEmbeds(self.kv.keys[0].new_empty(0, width), np.arange(0), kv=self.kv)
        return [placeholder] * self.count + list(tokens), embeds


def _prefix_tokens(owner, peft_config, kind: str, mode: str) -> PrefixTokens:
    """The prefix an adapter gives every layer, read as PEFT's forward reads it (get_prompt), or a
    ValueError naming what the engine cannot run exactly."""
    n = peft_config.num_virtual_tokens
    what = f"generate(batching={mode!r}) cannot run PEFT prompt learning ({kind}, {n} virtual tokens)"
    if getattr(peft_config, "num_transformer_submodules", 1) != 1:
        raise ValueError(f"{what}: a prefix for {peft_config.num_transformer_submodules} transformer submodules "
                         "(an encoder-decoder). Use batching='off' for this adapter.")
    prompt = owner.get_prompt(batch_size=1)
    layers = getattr(prompt, "layers", None)
    pairs = [(layer.keys, layer.values) for layer in layers] if layers is not None else \
        [tuple(p) for p in prompt] if isinstance(prompt, (tuple, list)) else None
    if not pairs or any(not (torch.is_tensor(k) and torch.is_tensor(v) and k.dim() == 4 and v.dim() == 4
                             and k.shape[0] == v.shape[0] == 1 and k.shape[2] == v.shape[2] == n) for k, v in pairs):
        raise ValueError(f"{what}: its past keys and values ({type(prompt).__name__}) are not one [1, heads, "
                         f"{n}, dim] pair per layer. Use batching='off' for this adapter.")
    keys = [k[0].detach() for k, _ in pairs]
    values = [v[0].detach() for _, v in pairs]
    flat = torch.cat([t.transpose(0, 1).reshape(n, -1).float() for t in keys + values], dim=1)  # [n, ...]
    key = b"peft-prefix:" + content_keys([flat])[0]
    return PrefixTokens(PrefixKV(keys, values, key, name=f"PEFT {kind} ({n} virtual tokens)"), str(kind))


def check_window(model, virtual, call) -> None:
    """A ValueError when a sliding-window model would see a left-padded row's virtual tokens leave
    the window at other steps than stock's: stock's cache holds [virtual tokens, padding, row], and
    its window counts the padding in the distance; the engine's holds no padding. Rows without
    padding, and rows whose whole context stays within the window, run exactly."""
    window = getattr(model.config.get_text_config(), "sliding_window", None)
    if not isinstance(window, int) or isinstance(window, bool):
        return
    gc = call.gc
    longest = call.input_ids.shape[1] + gc.max_new_tokens if gc.max_new_tokens is not None else gc.max_length
    if any(call.prefixes) and virtual.count + (longest or 0) > window:
        raise ValueError(f"PEFT {virtual.method} on a model with a sliding window of {window} tokens, with left-padded "
                         f"rows whose context (the {virtual.count} virtual tokens, the padding and up to {longest} "
                         "tokens) exceeds it: stock counts the padding in the window's distance to the virtual tokens, "
                         "the engine does not. Pass unpadded rows (one call each) or use batching='off'.")


def _replacement(model):
    """The prepare_inputs_for_generation set on the instance, unless it is the class's own."""
    found = vars(model).get("prepare_inputs_for_generation")
    if found is None:
        return None
    own = getattr(type(model), "prepare_inputs_for_generation", None)
    if getattr(found, "__self__", None) is model and getattr(found, "__func__", None) is own:
        return None
    return found


@torch.no_grad()
def check_inputs_not_rewritten(model, mode: str) -> VirtualTokens | PrefixTokens | None:
    """The virtual tokens of a PEFT prompt-tuning, p-tuning or prefix-tuning adapter driving this call, or None;
    a ValueError when stock generate would feed `model` through any other per-step input rewriter
    of its instance's own (the other prompt-learning methods, named), which the engine never calls."""
    replacement = _replacement(model)
    if replacement is None:
        return None
    owner = getattr(replacement, "__self__", None)
    peft_config = getattr(owner, "active_peft_config", None)
    if getattr(peft_config, "is_prompt_learning", False):
        kind = getattr(peft_config.peft_type, "value", peft_config.peft_type)
        if str(getattr(peft_config.peft_type, "name", kind)) in _EMBEDDED_METHODS:
            values = owner.get_prompt(batch_size=1)[0].detach()
            digest = hashlib.blake2b(values.float().cpu().numpy().tobytes(), digest_size=16).digest()
            return VirtualTokens(values, str(kind), b"peft-virtual-tokens:" + digest)
        if str(getattr(peft_config.peft_type, "name", kind)) in _PREFIX_METHODS:
            return _prefix_tokens(owner, peft_config, kind, mode)
        raise ValueError(
            f"generate(batching={mode!r}) cannot run PEFT prompt learning ({kind}, "
            f"{getattr(peft_config, 'num_virtual_tokens', '?')} virtual tokens): stock generate builds this adapter's "
            "virtual tokens at every step from inputs of its own (task ids, a context of typed tokens), which the "
            "engine does not feed. Use batching='off' for this adapter (prompt tuning, p-tuning, prefix tuning, "
            "cartridges and LoRA-type adapters run on the engine).")
    where = f"{type(owner).__name__}." if owner is not None else ""
    name = getattr(replacement, "__name__", type(replacement).__name__)
    raise ValueError(
        f"generate(batching={mode!r}): {type(model).__name__}.prepare_inputs_for_generation is replaced on this "
        f"instance (by {where}{name}): stock generate builds every step's inputs through it, and the engine, which "
        "builds its own, cannot know what it changes. Remove it or use batching='off'.")
