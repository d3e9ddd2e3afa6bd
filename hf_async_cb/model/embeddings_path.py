"""Whether a model's forward gives the same logits from `inputs_embeds` as from `input_ids`.

The engine feeds prompt embeddings (a user's `inputs_embeds`, prompt tuning's virtual tokens, a
vision-language model's merged image features) by embedding the step's token ids with the model's
`get_input_embeddings()`, writing the given embeddings over some of them, and calling the forward
with `inputs_embeds`. That is exact only if the forward does nothing more with `input_ids` than
embed them; a few models do more (per-layer inputs read from the ids, a scale applied to one input
and not the other). Checked once per preparation, on the stock model, with a short forward each way.
"""

from __future__ import annotations

import torch


@torch.no_grad()
def embeddings_refusal(model: torch.nn.Module) -> str | None:
    """Why the model cannot take prompt embeddings on the engine, or None when it can."""
    try:
        embedding = model.get_input_embeddings()
    except (NotImplementedError, AttributeError):
        embedding = None
    if not isinstance(embedding, torch.nn.Module):
        return f"{type(model).__name__} has no input embedding module (get_input_embeddings())"
    vocab = getattr(embedding, "num_embeddings", None) or 2
    device = next(model.parameters()).device
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
