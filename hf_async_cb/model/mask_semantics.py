"""What a model's own attention masks do, layer by layer, learned from one short forward.

Stock attention (eager, sdpa) applies a sliding window, and anything else a family folds into
its mask, through the mask transformers builds for each layer; the `sliding_window` keyword that
attention modules pass along is read by flash-attention alone. The engine builds no mask: its
paged attention takes the window from that keyword. Most families pass both, and they agree.
Some do not: PhiMoE's and Qwen2-MoE's attention pass no keyword while their masks slide, so the
engine would attend past the window; a config with a stray `sliding_window` can make a module pass
a window that its masks never apply; a module keeps the window it was built with when the user
changes `config.sliding_window` afterwards, while stock's masks follow the config. Some families
add a learned bias to the mask (Doge), or build a bidirectional one (Gemma 3 with
use_bidirectional_attention), which no keyword tells.

So, once per preparation, a 12-token forward runs with a recording attention on the model's own
eager masks, with the config's window shrunk to 4 tokens so that it shows: per attention module,
whether its mask slides, whether it lets a query see later keys, and whether it holds anything
but 0 and -inf. The engine then takes each layer's window from its mask (window_override) and
refuses the last two with their reason (check_masks). A model whose forward cannot run this way
is left to the parity check (engine/parity.py).
"""

from __future__ import annotations

import itertools
import logging
import weakref
from dataclasses import dataclass, field

import torch

from hf_async_cb.model.embeddings_path import input_embedding_weight, input_vocab_size

logger = logging.getLogger(__name__)

PROBE_TOKENS = 12
PROBE_WINDOW = 4
_PROBES = itertools.count()
# Attention module -> the window the engine uses for it, where its keyword and its mask disagree.
_OVERRIDES: "weakref.WeakKeyDictionary[torch.nn.Module, int | None]" = weakref.WeakKeyDictionary()
_UNSET = object()


@dataclass
class MaskSemantics:
    windows: dict = field(default_factory=dict)  # id(module) -> (module, its mask slides, its keyword window)
    bias: list = field(default_factory=list)  # names of modules whose masks carry a bias
    bidirectional: list = field(default_factory=list)  # names of modules whose masks see later keys
    config_windows: list = field(default_factory=list)  # the configs' own sliding windows


def window_override(module: torch.nn.Module, keyword_window):
    """The sliding window the engine applies for `module`: its mask's, where the keyword says
    otherwise; else the keyword's."""
    if not _OVERRIDES:  # (most models: every layer's keyword agrees with its mask)
        return keyword_window
    override = _OVERRIDES.get(module, _UNSET)
    return keyword_window if override is _UNSET else override


def config_tree(config) -> list:
    """`config` and every sub-config under it, each once."""
    found, stack = {}, [config]
    while stack:
        c = stack.pop()
        if c is None or id(c) in found:
            continue
        found[id(c)] = c
        stack.extend(getattr(c, key, None) for key in (getattr(c, "sub_configs", None) or {}))
    return list(found.values())


def _configs_with_windows(config) -> list:
    return [c for c in config_tree(config)
            if isinstance(getattr(c, "sliding_window", None), int) and c.sliding_window > PROBE_WINDOW]


@torch.no_grad()
def read_masks(model: torch.nn.Module) -> MaskSemantics | None:
    """The per-module mask semantics of `model` (see the module docstring). A ValueError when its
    forward fails (the user's own error where a hook or patched forward of theirs raised)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask

    from hf_async_cb.model.attention import check_probed, implementation

    names = {id(m): n for n, m in model.named_modules()}
    found = MaskSemantics()

    def recording_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        check_probed(module, names, "read a model's masks")
        mask = attention_mask
        if (isinstance(mask, torch.Tensor) and mask.is_floating_point() and mask.dim() == 4
                and mask.shape[-1] == mask.shape[-2] == PROBE_TOKENS):
            masked = torch.finfo(mask.dtype).min / 2  # eager masks hold their dtype's min where masked
            mask = mask.float()
            slides = bool((mask[..., -1, 0] <= masked).any())
            if bool((mask[..., 0, -1] > masked).any()):
                found.bidirectional.append(names.get(id(module), type(module).__name__))
            if bool(((mask != 0) & (mask > masked)).any()):
                found.bias.append(names.get(id(module), type(module).__name__))
            found.windows[id(module)] = (module, slides, kwargs.get("sliding_window"))
        return query.new_zeros(query.shape[0], query.shape[2], query.shape[1], value.shape[-1]), None

    name = f"hf_async_cb_mask_probe_{next(_PROBES)}"
    windows = [(c, c.sliding_window) for c in _configs_with_windows(model.config)]
    AttentionInterface.register(name, recording_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, eager_mask)
    vocab = input_vocab_size(model)
    ids = torch.arange(PROBE_TOKENS, device=input_embedding_weight(model).device)[None] % vocab
    try:
        for c, _ in windows:
            c.sliding_window = PROBE_WINDOW
        with implementation(model.config, name, model):
            model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
    except Exception as error:
        # Without the masks read, windows, biases and bidirectional blocks would go unchecked (the
        # parity check's prompts are shorter than most windows): a forward that fails here refuses
        # the model, or reaches the caller as the user's own error (a hook's, a patched forward's).
        from hf_async_cb.model.kv_fingerprint import runs_user_code

        if runs_user_code(model):
            raise
        first = str(error).splitlines()[0] if str(error) else ""
        raise ValueError(f"{type(model).__name__} cannot run on hf_async_cb: reading its attention masks with a "
                         f"forward of {PROBE_TOKENS} tokens failed ({type(error).__name__}: {first})") from error
    finally:
        for c, window in windows:
            c.sliding_window = window
        AttentionInterface._global_mapping.pop(name, None)
        ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.pop(name, None)
    found.config_windows = [w for _, w in windows] or [
        c.sliding_window for c in config_tree(model.config) if isinstance(getattr(c, "sliding_window", None), int)]
    return found


def apply_masks(model: torch.nn.Module) -> None:
    """Read `model`'s masks; refuse what the engine cannot reproduce (a bias in the mask, a
    bidirectional mask) with a ValueError; make each layer's window its mask's."""
    found = read_masks(model)
    if found is None:
        return
    family = type(model).__name__
    if found.bias:
        raise ValueError(f"{family} cannot run on hf_async_cb: its attention adds a bias to the scores through the "
                         f"mask ({', '.join(found.bias[:3])}{', ...' if len(found.bias) > 3 else ''}), which the "
                         "paged attention does not read.")
    if found.bidirectional:
        raise ValueError(f"{family} cannot run on hf_async_cb: its attention is bidirectional (its masks let a token "
                         "see later ones), which the paged cache and causal attention cannot reproduce.")
    window = max(found.config_windows, default=None)  # the config's window (one per model)
    for module, slides, keyword in found.windows.values():
        # A keyword other than the config's: the module kept the window it was built with, and the
        # user has changed the config since (stock's masks follow the config), or it reads the
        # config at call time (it gave the probe's window; then the override is what it will pass).
        if slides and keyword != window and window is not None:
            _OVERRIDES[module] = window
        elif not slides and keyword is not None:
            _OVERRIDES[module] = None
        else:
            _OVERRIDES.pop(module, None)
