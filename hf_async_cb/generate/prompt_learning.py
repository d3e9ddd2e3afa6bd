"""PEFT prompt learning: prompt tuning and p-tuning run as prompt embeddings; any other per-step
input rewriting is refused before any work.

Stock generate builds each step's model inputs with the model's prepare_inputs_for_generation.
PEFT's prompt learning methods (prefix tuning, prompt tuning, p-tuning, multitask prompt tuning,
...) reach the base model's generate with that method replaced on the model instance by their own
(PeftModelForCausalLM.generate sets it on the base model for the duration of the call): it adds
the virtual tokens, as prompt embeddings in front of the prompt, or as past keys and values in
every layer. The engine builds its inputs itself, from token ids, so such a model would silently
generate as the base model.

Prompt tuning and p-tuning put the adapter's virtual-token embeddings (the same for every row)
in front of each prompt: the engine feeds them as prompt embeddings (engine/prompt_embeds.py) at
placeholder tokens in front of the prompt, with PEFT's positions (it drops generate's position ids,
so the model counts positions from the cache: a row's left padding shifts its tokens' positions).
Prefix tuning (per-layer past keys and values) and the other methods are refused by name, as is any
other replacement of that method on the instance, whose effect the engine cannot know. (PEFT puts
the model's own method back on the instance after a call: that one is not a replacement.)
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch

from hf_async_cb.engine.prompt_embeds import PromptEmbeds

_EMBEDDED_METHODS = ("PROMPT_TUNING", "P_TUNING")


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
def check_inputs_not_rewritten(model, mode: str) -> VirtualTokens | None:
    """The virtual tokens of a PEFT prompt-tuning or p-tuning adapter driving this call, or None;
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
        raise ValueError(
            f"generate(batching={mode!r}) cannot run PEFT prompt learning ({kind}, "
            f"{getattr(peft_config, 'num_virtual_tokens', '?')} virtual tokens): stock generate adds this adapter's "
            "virtual tokens at every step as past keys and values in every layer (or with task-specific inputs), "
            "which the engine does not feed. Use batching='off' for this adapter (prompt tuning, p-tuning and "
            "LoRA-type adapters run on the engine).")
    where = f"{type(owner).__name__}." if owner is not None else ""
    name = getattr(replacement, "__name__", type(replacement).__name__)
    raise ValueError(
        f"generate(batching={mode!r}): {type(model).__name__}.prepare_inputs_for_generation is replaced on this "
        f"instance (by {where}{name}): stock generate builds every step's inputs through it, and the engine, which "
        "builds its own, cannot know what it changes. Remove it or use batching='off'.")
