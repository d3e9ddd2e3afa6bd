"""Whether a model's forward gives the same logits from `inputs_embeds` as from `input_ids`.

The engine feeds prompt embeddings (a user's `inputs_embeds`, prompt tuning's virtual tokens, a
vision-language model's merged image features) by embedding the step's token ids with the model's
`get_input_embeddings()`, writing the given embeddings over some of them, and calling the forward
with `inputs_embeds`. That is exact only if the forward does nothing more with `input_ids` than
embed them; a few models do more (per-layer inputs read from the ids, a scale applied to one input
and not the other). Checked once per preparation, on the stock model, with a short forward each way.

The input embedding module is not always an `nn.Embedding`: PEFT wraps it (a LoRA on the embeddings,
trainable tokens, `modules_to_save`), so its vocabulary and weight are read through the wrapper
(`input_vocab_size`, `input_embedding_weight`); so is the output head's width (`output_vocab_size`).
"""

from __future__ import annotations

import torch


def _embedding_and_bases(model: torch.nn.Module) -> tuple:
    """The input embedding module, and the module a PEFT wrapper of it holds (None where none)."""
    module = model.get_input_embeddings()
    return module, getattr(module, "base_layer", None), getattr(module, "original_module", None)


def input_embedding_weight(model: torch.nn.Module) -> torch.Tensor:
    """The [vocab, hidden] weight of the model's input embeddings, through a wrapper's base layer."""
    candidates = _embedding_and_bases(model)
    for candidate in candidates:
        weight = getattr(candidate, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.dim() == 2:
            return weight
    raise ValueError(f"{type(model).__name__}'s input embeddings ({type(candidates[0]).__name__}) have no "
                     "[vocab, hidden] weight the engine can read.")


def input_vocab_size(model: torch.nn.Module) -> int:
    """The number of token ids the model's input embeddings take."""
    for candidate in _embedding_and_bases(model):
        count = getattr(candidate, "num_embeddings", None)
        if isinstance(count, int):
            return count
    return input_embedding_weight(model).shape[0]


def output_vocab_size(model: torch.nn.Module) -> int | None:
    """The width of the model's logits, read through a PEFT wrapper of its output head; None where
    it has none. PEFT's TrainableTokensWrapper (`trainable_token_indices` on a model whose head is
    tied to its input embeddings: Gemma, Llama-3.2-1B, Qwen2-0.5B) has no `out_features` of its own
    and raises for it: the head's out_features were read directly and every such call crashed."""
    head = model.get_output_embeddings()
    if head is None:
        return None
    for candidate in (head, getattr(head, "base_layer", None), getattr(head, "original_module", None)):
        count = getattr(candidate, "out_features", None)
        if isinstance(count, int):
            return count
    weight = getattr(head, "weight", None)
    return weight.shape[0] if isinstance(weight, torch.Tensor) and weight.dim() == 2 else None


@torch.no_grad()
def embeddings_refusal(model: torch.nn.Module) -> str | None:
    """Why the model cannot take prompt embeddings on the engine, or None when it can."""
    try:
        embedding = model.get_input_embeddings()
    except (NotImplementedError, AttributeError):
        embedding = None
    if not isinstance(embedding, torch.nn.Module):
        return f"{type(model).__name__} has no input embedding module (get_input_embeddings())"
    vocab = input_vocab_size(model)
    device = input_embedding_weight(model).device
    ids = (torch.arange(1, 7, device=device) % vocab)[None]
    positions = torch.arange(6, device=device)[None]  # as the engine passes them (multimodal models need them)
    try:
        from_ids = model(input_ids=ids, position_ids=positions, use_cache=False).logits
        from_embeds = model(inputs_embeds=embedding(ids), position_ids=positions, use_cache=False).logits
    except Exception as error:  # noqa: BLE001 - only prompt embeddings are refused; token ids still run
        return f"{type(model).__name__}'s forward failed on inputs_embeds ({type(error).__name__}: {error})"
    if not torch.equal(from_ids, from_embeds):
        return (f"{type(model).__name__}'s forward computes more from input_ids than get_input_embeddings() does "
                "(its logits from inputs_embeds differ), so embeddings fed in their place would change the tokens")
    return None
