"""A vision-language model's generate() inputs beyond the prompt: images and what comes with them.

`pixel_values` and its companions (image sizes, grids, pixel masks, videos, the token type ids some
families read) are whatever the model's forward accepts besides the text inputs; they reach the
model once, when its own code merges the image features into the prompt's embeddings
(model/vision.py). Models without a vision forward keep refusing unknown arguments by name.
"""

from __future__ import annotations

import copy
import inspect

import torch

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
    accepted = _media_names(model)
    media = {name: model_kwargs.pop(name) for name in list(model_kwargs) if name in accepted}
    media = {name: value for name, value in media.items() if value is not None}
    return media or None


def _media_names(model) -> set[str]:
    """What the model's forward takes beside the text inputs."""
    return _forward_parameters(model) - _TEXT_INPUTS


def _forward_parameters(model) -> set[str]:
    """The forward's named inputs: not its `self`, nor the names of its `*args` / `**kwargs`, which
    no input goes by (media={"self": ...} would reach the forward twice)."""
    try:
        parameters = inspect.signature(type(model).forward).parameters.values()
    except (TypeError, ValueError):
        return set()
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {p.name for p in parameters if p.kind in named and p.name != "self"}


def checked_media(model, media) -> tuple[dict, object]:
    """Engine.add_request(media=...) checked on the caller's thread, as generate() checks its
    arguments: a dict of what the model's forward takes beside the prompt (a ValueError naming any
    other key), copied, so that the request merges the images it was given even if the caller
    reuses its buffers before the loop takes it in. Returns (the copy, a CUDA event the merge waits
    for on its own stream: the copies were queued on the caller's; None off CUDA)."""
    name = type(model).__name__
    if not isinstance(media, dict):
        raise ValueError(f"media must be a dict of the processor's image inputs (pixel_values, ...), got "
                         f"{type(media).__name__}.")
    if not takes_media(model):
        raise ValueError(f"{name} takes no images (its forward has no pixel_values): media= is for "
                         "vision-language models.")
    accepted = _media_names(model)
    text = sorted(k for k in media if k in _TEXT_INPUTS)
    if text:
        raise ValueError(f"media holds {text}: the prompt (its image placeholders included) is add_request's "
                         f"first argument, and media only what comes beside it ({_listed(accepted)}).")
    unknown = sorted(str(k) for k in media if k not in accepted)
    if unknown:
        raise ValueError(f"{name}'s forward does not take {unknown}; media takes {_listed(accepted)}.")
    copied, cuda = {}, []
    for key, value in media.items():
        if isinstance(value, torch.Tensor):
            copied[key] = value.detach().clone()
            if value.is_cuda:
                cuda.append(value.device)
        elif type(value).__module__ == "numpy":
            raise ValueError(f"media[{key!r}] is a NumPy array: pass the processor's torch tensors "
                             "(return_tensors='pt').")
        else:  # (image sizes as lists, None)
            copied[key] = copy.deepcopy(value)
    ready = None
    if cuda:
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(cuda[0]))
    return copied, ready


def _listed(names) -> str:
    names = sorted(names)
    return ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
