"""PEFT prompt learning, and any other per-step input rewriting, refused before any work.

Stock generate builds each step's model inputs with the model's prepare_inputs_for_generation.
PEFT's prompt learning methods (prefix tuning, prompt tuning, p-tuning, multitask prompt tuning,
...) reach the base model's generate with that method replaced on the model instance by their own
(PeftModelForCausalLM.generate sets it on the base model for the duration of the call): it adds
the virtual tokens, as prompt embeddings in front of the prompt, or as past keys and values in
every layer. The engine builds its inputs itself, from token ids, so such a model would silently
generate as the base model. Running them needs prompt embeddings and pre-filled per-layer K/V on
the engine; until then they are refused by name, as is any other replacement of that method on
the instance, whose effect the engine cannot know. (PEFT puts the model's own method back on the
instance after a call: that one is not a replacement.)
"""

from __future__ import annotations


def _replacement(model):
    """The prepare_inputs_for_generation set on the instance, unless it is the class's own."""
    found = vars(model).get("prepare_inputs_for_generation")
    if found is None:
        return None
    own = getattr(type(model), "prepare_inputs_for_generation", None)
    if getattr(found, "__self__", None) is model and getattr(found, "__func__", None) is own:
        return None
    return found


def check_inputs_not_rewritten(model, mode: str) -> None:
    """Raise ValueError when stock generate would feed `model` through a per-step input rewriter of
    its instance's own (PEFT prompt learning, named with its method), which the engine never calls."""
    replacement = _replacement(model)
    if replacement is None:
        return
    owner = getattr(replacement, "__self__", None)
    peft_config = getattr(owner, "active_peft_config", None)
    if getattr(peft_config, "is_prompt_learning", False):
        kind = getattr(peft_config.peft_type, "value", peft_config.peft_type)
        raise ValueError(
            f"generate(batching={mode!r}) cannot run PEFT prompt learning ({kind}, "
            f"{getattr(peft_config, 'num_virtual_tokens', '?')} virtual tokens): stock generate adds the adapter's "
            "virtual tokens at every step, as prompt embeddings (prompt tuning, p-tuning) or as past keys and values "
            "in every layer (prefix tuning), and the engine feeds token ids alone, so it would generate as the base "
            "model. Use batching='off' for this adapter (LoRA-type adapters run on the engine).")
    where = f"{type(owner).__name__}." if owner is not None else ""
    name = getattr(replacement, "__name__", type(replacement).__name__)
    raise ValueError(
        f"generate(batching={mode!r}): {type(model).__name__}.prepare_inputs_for_generation is replaced on this "
        f"instance (by {where}{name}): stock generate builds every step's inputs through it, and the engine, which "
        "builds its own, cannot know what it changes. Remove it or use batching='off'.")
