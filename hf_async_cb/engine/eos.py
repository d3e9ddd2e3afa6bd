"""The default of SamplingParams.eos_token_ids: the model's own end-of-sequence ids.

Stock generate stops at the EOS its GenerationConfig names, and so does an Engine unless told
otherwise. A SamplingParams cannot know the model, so its default is the marker MODEL_EOS, which
the Engine turns into the ids when it makes the request (Engine.make_request; DataParallel before it
hands requests to its replicas, so that they follow the model as it is now): the generation
config's `eos_token_id` (an int or a list), else the tokenizer's. `eos_token_ids=()` is the way to
run past EOS. generate(batching=...) always passes the ids of its own GenerationConfig, so that
`eos_token_id=None` there keeps meaning no EOS, as in stock.
"""

from __future__ import annotations

import dataclasses
import enum

import torch


class ModelEos(enum.Enum):
    """A marker, not ids: "the EOS ids of the model the request runs on". An enum member, so that
    it survives pickling to a DataParallel process replica as itself."""

    MODEL_EOS = "the model's end-of-sequence ids"

    def __repr__(self) -> str:
        return "MODEL_EOS"


MODEL_EOS = ModelEos.MODEL_EOS


def model_eos_token_ids(model, tokenizer=None) -> tuple[int, ...]:
    """The ids `model` stops on by default: its generation config's eos_token_id, else the
    tokenizer's; () when neither names one. Negative ids (transformers' "disabled", -1) are
    left out: no token has them."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        return ()
    if isinstance(eos, torch.Tensor):
        eos = eos.tolist()
    ids = eos if isinstance(eos, (list, tuple)) else [eos]
    return tuple(int(t) for t in ids if int(t) >= 0)


def with_model_eos(params, model, tokenizer=None):
    """`params` with MODEL_EOS replaced by the model's ids; `params` itself when it names its own."""
    if params.eos_token_ids is not MODEL_EOS:
        return params
    return dataclasses.replace(params, eos_token_ids=model_eos_token_ids(model, tokenizer))
