"""A model config's settings as a value to compare: what stock reads at every forward, copied.

An engine is built on the config as it finds it (per-layer windows from `layer_types`, rotary
settings, sub-configs of a vision-language model) and checks before each call, and at each serving
admission, that the config is still what it was built on. A shallow copy kept the very lists, dicts
and sub-configs the user edits in place (`config.layer_types[0] = "full_attention"`,
`config.text_config.sliding_window = 8`), so such an edit compared equal and ran the old settings.
The attention implementation, which the engine itself switches during its calls, is left out.
"""

from __future__ import annotations

import copy

from transformers import PretrainedConfig

_VOLATILE = ("_attn_implementation_internal", "_attn_implementation", "_commit_hash")


def config_snapshot(config) -> dict:
    """The config's settings, nested ones copied (sub-configs as snapshots of their own, lists and
    dicts deep), so that an edit in place anywhere in it compares as a change."""
    state = {}
    for name, value in vars(config).items():
        if name in _VOLATILE:
            continue
        if isinstance(value, PretrainedConfig):
            state[name] = config_snapshot(value)
        else:
            try:
                state[name] = copy.deepcopy(value)
            except Exception:  # noqa: BLE001 (a value that does not copy: compared as the object it is)
                state[name] = value
    return state
