"""Every compiled kernel variant a model's runs can launch, known at its engine's build.

Why: a call that compiles a kernel variant mid-run pays for it (0.3 s to 3.5 s each on the H200's
host, more than stock generate's whole call at times). No kernel specialises on a per-step value
(rows, tokens, contexts, splits: those are runtime arguments, or constexprs from short lists that
are all listed here), so the variants follow from a few facts of the model and the engine alone:
`ModelFacts`, read from an engine being built by `facts_of`, and `model_variants`, a pure function of them
that kernels/precompile.py compiles at once (tests check that it covers every key a run produces).

Not covered (they compile when first launched, as before): layers that attend over gathered
contexts (MLA latents: their K/V strides follow the step), the decode GEMM tuner's candidates
(measured once per machine), and launches with benchmark tuning overrides.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from hf_async_cb.kernels.variant import Variant

if TYPE_CHECKING:
    from hf_async_cb.kernels.skinny_gemm_forms import WeightForm


@dataclass(frozen=True)
class AttentionKind:
    """Layers that launch the same attention variants: heads, pools (as meta tensors: shape, strides,
    dtype) and the options of their calls."""

    num_heads: int
    key_pool: torch.Tensor
    value_pool: torch.Tensor
    window: bool = False  # some calls pass a sliding window (the layer may also run without)
    softcap: bool = False
    sinks: torch.dtype | None = None
    alibi: torch.dtype | None = None

    def key(self) -> tuple:
        pools = [(tuple(p.shape), p.stride(), p.dtype) for p in (self.key_pool, self.value_pool)]
        return self.num_heads, *pools, self.window, self.softcap, self.sinks, self.alibi


@dataclass(frozen=True)
class GemmFacts:
    """A skinny GEMM launch a decode step makes: weight [n, k] in `form`, a bias added by the kernel
    or not, at a rows bucket with a config (its sorted items)."""

    n: int
    k: int
    bias: bool
    bucket: int
    config: tuple
    form: WeightForm
    dtype: torch.dtype | None = None  # the activations' dtype where it is not the model's (a cast to bitsandbytes' compute dtype)


@dataclass(frozen=True)
class ModelFacts:
    """What decides a model's kernel variants. Widths are elements; dtypes are torch dtypes."""

    device_type: str  # "cuda" (compiled, libdevice) or "cpu" (the interpreter's sizes)
    dtype: torch.dtype  # the model's activations
    vocab: int  # the logits' width (lm_head's rows)
    page_size: int = 16
    attention: tuple[AttentionKind, ...] = ()  # empty: the reference attention (no kernels)
    splits: bool = True  # decode contexts may be split over programs (attention_launch.choose_splits)
    tall: bool = True  # prefill steps of TALL_TILE_QUERY_LEN tokens or more take tall tiles
    norms: tuple[tuple[int, torch.dtype, bool], ...] = ()  # fused RMSNorms: (width, weight dtype, unit offset)
    add_norms: tuple[tuple[int, torch.dtype], ...] = ()  # residual adds fused into norms: (width, weight dtype)
    rotary: tuple[tuple[int, int, int], ...] = ()  # (query heads, key heads, head size) of fused rotaries
    mlps: tuple[tuple[int, bool], ...] = ()  # fused activation-muls: (intermediate width, GELU-tanh)
    gemms: tuple[GemmFacts, ...] = ()
    llm_int8: tuple[tuple[int, int, bool, bool], ...] = ()  # LLM.int8() products: (N, K, bias, outlier threshold)
    draws: bool = True  # the greedy and sampled draws run as kernels
    extra: tuple[Variant, ...] = field(default=())


def _meta(pool: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(tuple(pool.shape), pool.stride(), dtype=pool.dtype, device="meta")


def model_variants(facts: ModelFacts) -> list[Variant]:
    """Every variant `facts` implies, each once (a pure function: no GPU, nothing compiled)."""
    from hf_async_cb.kernels import (draw_greedy, draw_sampled, elementwise, grouped_dequant, llm_int8, paged_attention,
                                     skinny_gemm, store_kv)

    device = torch.device(facts.device_type)
    on_gpu = facts.device_type == "cuda"
    found: list[Variant] = []
    for kind in {kind.key(): kind for kind in facts.attention}.values():
        for window in sorted({False, kind.window}):
            found += paged_attention.variants(kind.num_heads, kind.key_pool, kind.value_pool, facts.page_size,
                                              facts.dtype, window=window, softcap=kind.softcap, sinks=kind.sinks,
                                              alibi=kind.alibi, splits=facts.splits, tall=facts.tall)
        found += store_kv.variants(kind.key_pool, kind.value_pool, facts.dtype, facts.dtype)
    for width, weight_dtype, unit_offset in facts.norms:
        found += elementwise.rms_variants(width, facts.dtype, weight_dtype, unit_offset, use_libdevice=on_gpu)
    for width, weight_dtype in facts.add_norms:
        found += elementwise.rms_variants(width, facts.dtype, weight_dtype, add=True, use_libdevice=on_gpu)
    for q_heads, k_heads, head_dim in facts.rotary:
        found += elementwise.rotary_variants(q_heads, k_heads, head_dim, facts.dtype)
    for width, gelu in facts.mlps:
        found += elementwise.silu_mul_variants(width, facts.dtype, gelu, use_libdevice=on_gpu)
    for g in facts.gemms:
        found += skinny_gemm.variants(g.n, g.k, g.dtype or facts.dtype, g.bias, g.bucket, dict(g.config), g.form)
        if g.form.group and not g.form.codebook:  # (its steps above MAX_M rows rebuild the weight whole)
            found += grouped_dequant.variants(g.n, g.k, g.dtype or facts.dtype, g.form)
    for n, k, bias, outliers in facts.llm_int8:  # every rows bucket: decode steps and prefills of up to MAX_M tokens
        for bucket in (1 << i for i in range(skinny_gemm.MAX_M.bit_length())):
            found += llm_int8.variants(n, k, facts.dtype, facts.dtype if bias else None, outliers, bucket, on_gpu)
    if facts.draws:
        # The model's logits, or float32 ones once processors (penalties, blocked tokens) touched them.
        for dtype in dict.fromkeys((facts.dtype, torch.float32)):
            found += draw_greedy.variants(dtype, facts.vocab, facts.vocab)
            found += draw_sampled.variants(dtype, facts.vocab, facts.vocab, device)
    found += facts.extra
    return _unique(found)


def _unique(variants: list[Variant]) -> list[Variant]:
    seen, out = set(), []
    for v in variants:
        key = v.identity()
        if key not in seen:
            seen.add(key)
            out.append(v)
    return out


def facts_of(engine, model: torch.nn.Module) -> ModelFacts:
    """The facts of `model`'s engine, from the point of its build where its pool and attention
    backend exist (Engine._build): the model as prepared, the pool, the config."""
    prepared, config = engine.prepared_model, engine.config
    text = engine._model_config
    output = model.get_output_embeddings()
    vocab = output.weight.shape[0] if output is not None and getattr(output, "weight", None) is not None \
        else engine.vocab_size
    attention = _attention_kinds(model, text, engine.cache) if engine.attention_backend == "triton" else ()
    norms, add_norms, rotary, mlps = _elementwise_facts(prepared.elementwise, engine)
    gemms = []
    if prepared.decode_gemms is not None:
        for pick in prepared.decode_gemms.kernel_picks():
            # (HQQ and quanto run their own forward in another dtype; bitsandbytes' projections cast to theirs)
            if pick.dtype in (None, engine.dtype) or pick.casts:
                gemms += [GemmFacts(pick.n, pick.k, pick.bias, bucket, tuple(sorted(cfg.items())), pick.form,
                                    pick.dtype if pick.casts and pick.dtype != engine.dtype else None)
                          for bucket, cfg in pick.configs.items()]
    llm_int8_ = () if prepared.decode_gemms is None else tuple(dict.fromkeys(prepared.decode_gemms.llm_int8_picks()))
    return ModelFacts(
        device_type=engine.device.type, dtype=engine.dtype, vocab=vocab, page_size=config.page_size,
        attention=attention, norms=norms, add_norms=add_norms, rotary=rotary, mlps=mlps,
        gemms=tuple(dict.fromkeys(gemms)), llm_int8=llm_int8_, draws=engine.attention_backend == "triton")


def facts_before_preparation(model: torch.nn.Module, page_size: int, attention_backend: str) -> ModelFacts:
    """The part of `model`'s facts known before it is prepared (its masks read, weights fused,
    element-wise kernels checked: seconds of a first call): the paged attention over the pool, from the
    measured K/V layout, and the draws over its logits. These are also the longest variants to
    compile, so they compile in workers while the model is prepared, and the build compiles the rest
    (model/prepared.py). Best effort: a fact that turns out otherwise only leaves its variant to the
    build. `attention_backend` as resolved for the model's device (attention.resolve_backend)."""
    from hf_async_cb.model.checks import model_dtype, text_config_of
    from hf_async_cb.model.kv_cache import PagedKVCache
    from hf_async_cb.model.kv_layout import measured_layout

    device = next(model.parameters()).device
    dtype = model_dtype(model)
    text = text_config_of(model.config)
    attention = ()
    if attention_backend == "triton":
        layout = measured_layout(model, dtype, device)  # (measured once per family: the build then reads it)
        attention = _attention_kinds(model, text, PagedKVCache(layout, 1, page_size, dtype, torch.device("meta")))
    output = model.get_output_embeddings()
    weight = getattr(output, "weight", None) if output is not None else None
    return ModelFacts(device_type=device.type, dtype=dtype, vocab=weight.shape[0] if weight is not None else 0,
                      page_size=page_size, attention=attention,
                      draws=attention_backend == "triton" and weight is not None,
                      extra=tuple(_tower_variants(model)))


def _tower_variants(model: torch.nn.Module) -> list:
    """The kernels a vision-language model's towers launch during a call's merge (model/vision.py: the
    rotary, the norms, the padded MLPs' activation); none for text models."""
    from hf_async_cb.model import aligned_mlp, tower_norms, vision, vision_rotary

    try:
        inner = vision.language_model(model)
        if inner is model:
            return []
        return (vision_rotary.tower_variants(model) + tower_norms.tower_norm_variants(model, inner)
                + aligned_mlp.mlp_variants(model, inner))
    except Exception:  # noqa: BLE001 - best effort: the merge compiles what is missing, the text model's list stands
        return []


def _attention_kinds(model: torch.nn.Module, text, cache) -> tuple[AttentionKind, ...]:
    """The attention kinds of `model`'s layers over the pools of `cache` (a PagedKVCache; its pools
    may be meta tensors), layers attending over gathered contexts left out."""
    window = bool(getattr(text, "sliding_window", None)) or "sliding_attention" in (getattr(text, "layer_types", None) or ())
    softcap = bool(getattr(text, "attn_logit_softcapping", None))
    sinks = next((m.sinks.dtype for m in model.modules() if isinstance(getattr(m, "sinks", None), torch.Tensor)), None)
    alibi = next((m.hf_async_cb_alibi_slopes.dtype for m in model.modules()
                  if isinstance(getattr(m, "hf_async_cb_alibi_slopes", None), torch.Tensor)), None)
    return tuple(AttentionKind(query_heads(text, layer.key_heads), _meta(k), _meta(v), window, softcap, sinks, alibi)
                 for k, v, layer in zip(cache.keys, cache.values, cache.layout.layers) if not layer.gathered)


def query_heads(text_config, key_heads: int) -> int:
    """A layer's query heads: its measured key heads times the config's group size (so a tensor-
    parallel rank's share, or MQA's 71 on one, come out right)."""
    heads = text_config.num_attention_heads
    return key_heads * (heads // (getattr(text_config, "num_key_value_heads", None) or heads))


def _elementwise_facts(fused, engine) -> tuple[tuple, tuple, tuple, tuple]:
    """(norms, add_norms, rotary, mlps) of a model's element-wise fusions (model/elementwise_fusion.py)."""
    if fused is None:
        return (), (), (), ()
    from hf_async_cb.model import elementwise_fusion as ew

    norms, mlps = set(), set()
    for module, forward in fused._modules:
        function = getattr(forward, "__func__", forward)
        if function in (ew._rms_forward, ew._unit_offset_rms_forward):
            norms.add((module.weight.shape[0], module.weight.dtype, function is ew._unit_offset_rms_forward))
        elif function is ew._mlp_forward:
            mlps.add((module.gate_proj.weight.shape[0], ew._activation(module.act_fn) == "gelu_tanh"))
        elif function is ew._gate_up_forward:
            mlps.add((module.gate_up_proj.out_features // 2, False))
    hidden = engine._model_config.hidden_size  # the norms after residual adds (residual_fusion.py)
    add_norms = {(w, d) for w, d, unit in norms if not unit and w == hidden} if fused.add_norms else set()
    rotary = set()
    if fused._rotary:
        text = engine._model_config
        rotary = {(query_heads(text, layer.key_heads), layer.key_heads, layer.key_dim)
                  for layer in engine.layout.layers if not layer.gathered}
    return tuple(sorted(norms, key=str)), tuple(sorted(add_norms, key=str)), tuple(sorted(rotary)), \
        tuple(sorted(mlps))
