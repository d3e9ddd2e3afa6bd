"""KVLayout: the shapes of what each attention layer stores in its cache, measured, not guessed.

Reading K/V shapes from a config goes wrong for every family that departs from
[num_key_value_heads, head_dim]: multi-query Falcon and GPT-BigCode store one head, DeepSeek's MLA
stores its latents (or keys and values of different widths, by transformers version), Gemma 4
changes head_dim per layer. So the layout is measured: one stock forward over two tokens with a
recording transformers cache, which notes the key and value shapes each layer hands to
`Cache.update`, and a recording attention function, which notes whether the layer then attends
over what the cache returned or over something it made of it (DeepSeek's MLA expands its cached
latents into keys and values). Such a layer must not be handed the whole pool (it would expand
every slot of it, every step): the cache gives it the step's contexts gathered instead (`gathered`).
The result is cached per model class, config, dtype and device type (the shapes do
not depend on the weights), so the forward runs once per family in a process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from dataclasses import dataclass
from typing import Iterator

import torch

from hf_async_cb.model.embeddings_path import input_vocab_size


@dataclass(frozen=True)
class LayerKV:
    """What one layer stores per token: keys [key_heads, key_dim], values [value_heads, value_dim]."""

    key_heads: int
    key_dim: int
    value_heads: int
    value_dim: int
    gathered: bool = False  # the layer transforms its cached states before attention (see the module doc)

    @property
    def elements_per_token(self) -> int:
        return self.key_heads * self.key_dim + self.value_heads * self.value_dim


@dataclass(frozen=True)
class KVLayout:
    """Per-layer K/V shapes of a model, in layer order."""

    layers: tuple[LayerKV, ...]

    @classmethod
    def uniform(cls, num_layers: int, num_kv_heads: int, head_dim: int) -> "KVLayout":
        """Every layer alike, keys and values of the same shape (Llama-like models, tests)."""
        return cls((LayerKV(num_kv_heads, head_dim, num_kv_heads, head_dim),) * num_layers)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        return sum(layer.elements_per_token for layer in self.layers) * torch.finfo(dtype).bits // 8


_LAYOUTS: dict[tuple, KVLayout] = {}
_PROBES = itertools.count()


def measured_layout(model: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> KVLayout:
    """The K/V shapes `model` writes to its cache, measured once per family (see the module doc).

    Raises ValueError naming the reason when the layout cannot be measured: the forward fails, or
    some layers write no cache of their own (layers that share another layer's K/V)."""
    from hf_async_cb.model.checks import tensor_parallel_size

    key = (type(model), model.config.to_json_string(use_diff=False), dtype, device.type,
           tensor_parallel_size(model))  # a tensor-parallel rank holds its own heads
    if key not in _LAYOUTS:
        from hf_async_cb.model.compiled import uncompiled
        from hf_async_cb.model.model_guard import model_guard

        with model_guard(model).held("measuring the K/V layout"), uncompiled(model):  # a forward, config switched
            _LAYOUTS[key] = _measure(model, device)
    return _LAYOUTS[key]


@torch.no_grad()
def _measure(model: torch.nn.Module, device: torch.device) -> KVLayout:
    from transformers.cache_utils import DynamicCache

    from hf_async_cb.model.attention import check_probed

    from hf_async_cb.model.kv_cache import cache_keyword
    from hf_async_cb.model.checks import text_config_of

    shapes: dict[int, LayerKV] = {}
    returned: dict[int, tuple] = {}
    transformed: set[int] = set()

    class ShapeRecorder(DynamicCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            shapes[layer_idx] = LayerKV(key_states.shape[1], key_states.shape[-1],
                                        value_states.shape[1], value_states.shape[-1])
            returned[layer_idx] = super().update(key_states, value_states, layer_idx, *args, **kwargs)
            return returned[layer_idx]

    probed = {id(m) for m in model.modules()}

    def recording_attention(module, query, key, value, attention_mask, *args, **kwargs):
        check_probed(module, probed, "measured a model's K/V layout")
        layer = getattr(module, "layer_idx", None)
        if layer in returned and (key is not returned[layer][0] or value is not returned[layer][1]):
            transformed.add(layer)
        # Only the shapes matter here: [batch, tokens, heads, value dim].
        return query.new_zeros(query.shape[0], query.shape[2], query.shape[1], value.shape[-1]), None

    name = type(model).__name__
    try:
        recorder = ShapeRecorder(config=text_config_of(model.config))
    except TypeError:  # an older DynamicCache without config=
        recorder = ShapeRecorder()
    vocab = input_vocab_size(model)
    ids = torch.tensor([[min(1, vocab - 1), min(2, vocab - 1)]], device=device)
    try:
        with _attention(model, recording_attention):
            model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True,
                  **{cache_keyword(model): recorder})
    except Exception as error:  # noqa: BLE001 - any failure of the stock forward is the reason
        first = str(error).splitlines()[0] if str(error) else ""
        raise ValueError(f"{name} cannot run on hf_async_cb: measuring its K/V layout with a transformers cache "
                         f"failed ({type(error).__name__}: {first})") from error
    if not shapes:
        raise ValueError(f"{name} cannot run on hf_async_cb: none of its layers writes a K/V cache.")
    declared = getattr(text_config_of(model.config), "num_hidden_layers", None)
    if sorted(shapes) != list(range(len(shapes))) or (isinstance(declared, int) and len(shapes) < declared):
        of = f" of its {declared}" if isinstance(declared, int) else ""
        mismatch = layer_indices_mismatch(model, declared)
        if mismatch:
            raise ValueError(f"{name} cannot run on hf_async_cb: {mismatch}")
        raise ValueError(f"{name} cannot run on hf_async_cb: only layers {sorted(shapes)}{of} write a K/V cache of "
                         "their own (the others write none, as cross-attention layers without an image, or share "
                         "another layer's), which the paged cache does not support.")
    return KVLayout(tuple(dataclasses.replace(shapes[i], gathered=i in transformed) for i in range(len(shapes))))


def layer_indices_mismatch(model: torch.nn.Module, declared) -> str | None:
    """Why the model's layers are not those its config declares (layers removed or added after
    loading, the config left as it was), or None where they are (or cannot be told)."""
    held = sorted({m.layer_idx for m in model.modules() if isinstance(getattr(m, "layer_idx", None), int)})
    if not isinstance(declared, int) or not held or held == list(range(declared)):
        return None
    return (f"its config declares {declared} layers (num_hidden_layers) but its modules hold layer indices {held} "
            "(layers removed or added?): number the layers 0..n-1 (each attention's layer_idx) and set "
            "num_hidden_layers to n.")


@contextlib.contextmanager
def _attention(model: torch.nn.Module, function) -> Iterator[None]:
    """`function` as the model's attention implementation, for a forward."""
    from transformers import AttentionInterface

    from hf_async_cb.model.adapters import AttentionAdapters
    from hf_async_cb.model.attention import implementation

    name = f"hf_async_cb_layout_probe_{next(_PROBES)}"  # one per probe: two models may probe at once
    AttentionInterface.register(name, function)
    adapters = AttentionAdapters(model)
    try:
        with implementation(model.config, name, model):
            adapters.attach()
            try:
                yield
            finally:
                adapters.detach()
    finally:
        AttentionInterface._global_mapping.pop(name, None)
