"""A vision-language model's generate() inputs beyond the prompt: images and what comes with them.

`pixel_values` and its companions (image sizes, grids, pixel masks, videos, the token type ids some
families read) are whatever the model's forward accepts besides the text inputs; they reach the
model once, when its own code merges the image features into the prompt's embeddings
(model/vision.py). Models without a vision forward keep refusing unknown arguments by name.
"""

from __future__ import annotations

import inspect

# What the engine feeds itself, or stock generate reads and drops: never a media input.
_TEXT_INPUTS = {"input_ids", "attention_mask", "use_cache", "inputs_embeds", "position_ids", "past_key_values",
                "cache", "cache_position", "labels", "logits_to_keep", "return_dict", "output_attentions",
                "output_hidden_states"}


def takes_media(model) -> bool:
    """Whether the model's forward takes images (a vision-language model)."""
    return bool({"pixel_values", "pixel_values_videos"} & _forward_parameters(model))


def media_inputs(model, model_kwargs: dict, mode: str) -> dict | None:
    """Move the call's media inputs out of `model_kwargs` (None when it has none, or the model takes
    no images: its unknown arguments are then refused as before)."""
    if not takes_media(model):
        return None
    accepted = _forward_parameters(model) - _TEXT_INPUTS
    media = {name: model_kwargs.pop(name) for name in list(model_kwargs) if name in accepted}
    media = {name: value for name, value in media.items() if value is not None}
    return media or None


def _forward_parameters(model) -> set[str]:
    try:
        return set(inspect.signature(type(model).forward).parameters)
    except (TypeError, ValueError):
        return set()
