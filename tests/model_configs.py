"""A tiny random model of every causal-LM family the installed transformers ships.

The sweep (tests/test_model_sweep.py, benchmarks/model_sweep.py) must cover families nobody has
hand-written a config for, so configs are shrunk generically from each config class's defaults:
the sizes that set the cost (width, depth, heads, vocabulary, experts) are cut wherever the
config has them, and everything else (norms, biases, positions, gating, attention variants) keeps
the family's own default, which is what the engine has to reproduce. Only where generic shrinking
breaks a family's own validation is there a quirk (QUIRKS). A family that still cannot be built is
reported as (None, reason), never raised: the sweep counts it instead of crashing.
"""

from __future__ import annotations

import functools
import warnings

import torch
import transformers
from transformers import CONFIG_MAPPING, PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

MODEL_TYPES = tuple(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
VOCAB = 256
LAYERS = 2
HEAD_DIM = 16

# Attribute -> tiny value, set wherever a config has the attribute as an int (None stays None,
# outside NONE_TO: it usually means "derived" or "off").
SIZES = {
    # width
    **dict.fromkeys(("hidden_size", "d_model", "n_embd", "embed_dim", "word_embed_proj_dim", "embedding_size",
                     "embedding_dim", "hidden_size_global", "attention_hidden_size", "lru_width", "adapter_in_dim",
                     "adapter_out_dim", "adapter_input_size"), 64),
    # feed-forward
    **dict.fromkeys(("intermediate_size", "ffn_dim", "n_inner", "ffn_hidden_size", "decoder_ffn_dim",
                     "encoder_ffn_dim", "d_ff", "dff", "dim_ff", "d_inner", "intermediate_size_mlp",
                     "dense_intermediate_size", "feed_forward_size", "mlp_dim"), 128),
    # experts: small and few (at most two per token, one shared: CAPS)
    **dict.fromkeys(("moe_intermediate_size", "expert_ffn_hidden_size", "expert_intermediate_size"), 32),
    **dict.fromkeys(("shared_expert_intermediate_size", "shared_experts_intermediate_size",
                     "shared_intermediate_size", "moe_shared_expert_intermediate_size"), 64),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"), 4),
    # heads
    **dict.fromkeys(("num_attention_heads", "n_head", "n_heads", "decoder_attention_heads",
                     "encoder_attention_heads", "swa_num_attention_heads"), 4),
    **dict.fromkeys(("num_key_value_heads", "num_kv_heads", "multi_query_group_num", "num_query_groups",
                     "swa_num_key_value_heads"), 2),
    **dict.fromkeys(("head_dim", "kv_channels", "d_head", "dim_head", "attention_head_dim", "swa_head_dim",
                     "attention_head_size", "d_kv"), HEAD_DIM),
    # multi-head latent attention (DeepSeek V2/V3 and kin)
    "kv_lora_rank": 32, "q_lora_rank": 32, "o_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
    "qk_head_dim": 16, "v_head_dim": 16,
    # a window shorter than the prompts, so that sliding-window attention is exercised
    **dict.fromkeys(("sliding_window", "sliding_window_size", "attention_window_size", "local_attention_window_len"),
                    8),
    "vocab_size": VOCAB, "unpadded_vocab_size": VOCAB, "emb_dim": 64,
}
DEPTH = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers", "encoder_layers", "num_blocks",
         "depth")
# Capped rather than set: a family's own smaller default is kept.
CAPS = {
    # experts and their routing groups; the first layer dense where the family starts dense
    "num_experts_per_tok": 2, "moe_topk": 2, "num_experts_per_token": 2, "moe_k": 2,
    "n_shared_experts": 1, "num_shared_experts": 1, "n_group": 1, "topk_group": 1, "num_expert_group": 1,
    "first_k_dense_replace": 1, "num_dense_layers": 1,
    # partial rotary, sparse-attention indexers, linear-attention and state-space heads
    "rotary_dim": HEAD_DIM // 2, "index_topk": 16, "index_n_heads": 4, "index_head_dim": 16,
    "linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    "linear_num_heads": 4, "linear_head_dim": 16, "mamba_dt_rank": 8,
    # side tables that would dwarf the model (per-layer embeddings, hashed byte n-grams, glyphs)
    "vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": 16, "encoder_hash_byte_group_vocab": 512,
    "shape_vocab_size": VOCAB, "pronunciation_vocab_size": VOCAB, "laurel_rank": 8, "hc_lowrank": 16,
    "ple_embed_dim": 64,
}
# None that the family's own modeling code cannot take (its config defaults are incomplete).
NONE_TO = {"head_dim": HEAD_DIM, "num_key_value_heads": 2}
POSITIONS = ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "context_length")
# Special tokens the model itself may use (padding_idx, bos/eos): moved below the tiny vocabulary.
SPECIAL = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 1, "unk_token_id": 0,
           "sep_token_id": 2, "cls_token_id": 1, "mask_token_id": 2}


def _num_layers(attrs: dict) -> int | None:
    for name in DEPTH:
        value = attrs.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _resize_layer_list(values: list, n: int) -> list:
    """The first n entries, then the last ones replaced by any kind dropped, so that a mixed
    pattern (Gemma 3's five sliding layers to one full) keeps each kind of layer."""
    out = list(values[:n]) + [values[-1]] * max(0, n - len(values))
    missing = [v for v in dict.fromkeys(values) if v not in out]
    for i, v in enumerate(missing[: n - 1]):
        out[n - 1 - i] = v
    return out


def _shrink_rope(rope, head_dim: int):
    """Rope parameters tied to the head size (M-RoPE sections, LongRoPE factors) follow it; per
    layer-type parameters (Gemma 3's sliding and full) each."""
    if not isinstance(rope, dict):
        return rope
    if rope and all(isinstance(v, dict) or v is None for v in rope.values()):
        return {k: _shrink_rope(v, head_dim) for k, v in rope.items()}
    rope = dict(rope)
    half = int(head_dim * rope.get("partial_rotary_factor", 1.0)) // 2
    section = rope.get("mrope_section")
    if isinstance(section, list) and section and sum(section) != half:
        scaled = [max(1, round(s * half / sum(section))) for s in section]
        scaled[0] += half - sum(scaled)
        rope["mrope_section"] = scaled
    for key in ("short_factor", "long_factor"):
        if isinstance(rope.get(key), list):
            rope[key] = (rope[key] * half)[:half]
    return rope


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _overrides(config: PretrainedConfig, layers: int = LAYERS) -> dict:
    """The tiny values for `config`'s own attributes (its sub-configs as dicts of theirs): passed
    to the config class, so that what the family derives from them (head_dim, layer_types,
    per-layer overrides) is derived again at the tiny size."""
    attrs = {k: v for k, v in vars(config).items() if not k.startswith("_")}
    old = _num_layers(attrs)
    out = {}
    for name, value in attrs.items():
        if isinstance(value, PretrainedConfig):
            out[name] = _overrides(value, layers)
        elif name in DEPTH and _is_int(value):
            out[name] = layers
        elif name in SIZES and _is_int(value):
            out[name] = SIZES[name]
        elif name in SIZES and isinstance(value, list) and value and all(map(_is_int, value)):
            out[name] = [SIZES[name]] * (layers if len(value) == old else len(value))  # per-layer sizes
        elif name in NONE_TO and value is None:
            out[name] = NONE_TO[name]
        elif name in CAPS and _is_int(value):
            out[name] = min(value, CAPS[name])
        elif name in POSITIONS and _is_int(value):
            out[name] = max(value, 256)
        elif name in SPECIAL:
            if _is_int(value) and value >= VOCAB:
                out[name] = SPECIAL[name]
            elif isinstance(value, list) and any(_is_int(v) and v >= VOCAB for v in value):
                out[name] = [SPECIAL[name]]
    if "qk_rope_head_dim" in out:  # multi-head latent attention: the heads are nope + rope parts
        out["qk_head_dim"] = out.get("qk_nope_head_dim", 8) + out["qk_rope_head_dim"]
        if "head_dim" in out:
            out["head_dim"] = out["qk_rope_head_dim"]
        if attrs.get("num_key_value_heads") == attrs.get("num_attention_heads"):  # MLA keeps one KV per head
            out["num_key_value_heads"] = out.get("num_attention_heads")
    if old and attrs.get("num_kv_shared_layers") == old:  # every layer reads another model's cache
        out["num_kv_shared_layers"] = layers
    for name, value in attrs.items():  # per-layer lists follow the depth
        if "layer" not in name or name in out or name == "per_layer_config" or not isinstance(value, list):
            continue
        if old is not None and len(value) == old and old != layers:
            out[name] = _resize_layer_list(value, layers)
        elif value and all(map(_is_int, value)) and any(v >= layers for v in value):
            out[name] = [v for v in value if v < layers] or [layers - 1]  # layer indices: keep one
    head = out.get("head_dim") or (out.get("hidden_size") or 64) // (out.get("num_attention_heads") or 4)
    for name in ("rope_parameters", "rope_scaling"):
        if isinstance(attrs.get(name), dict):
            out[name] = _shrink_rope(attrs[name], head)
    return out


def _text(kw: dict, **values) -> dict:
    """Set values on the language model's part: a composite config's text_config, else the config."""
    target = kw.setdefault("text_config", {}) if "text_config" in kw else kw
    target.update(values)
    return kw


# Mamba-2 state sizes tied to the tiny width (heads x head size = 2 x hidden).
MAMBA = {"mamba_n_heads": 8, "mamba_d_head": 16, "mamba_d_state": 16}
# Per-family fixes, only where generic shrinking (or the family's own defaults) cannot be built.
QUIRKS = {
    # The defaults leave out what the modeling code reads.
    "dbrx": lambda kw: {**kw, "attn_config": {**kw.get("attn_config", {}), "rope_theta": 10000.0, "kv_n_heads": 2,
                                              "clip_qkv": 8.0}},
    "deepseek_v2": lambda kw: {**kw, "num_experts_per_tok": 2},
    "dots1": lambda kw: {**kw, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
                         "first_k_dense_replace": 1},
    "lfm2_moe": lambda kw: {**kw, "layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    "cohere_compass_text": lambda kw: {**kw, "rope_parameters": {
        "full_attention": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2]}}},
    # The sliding layers' own attention sizes (a per-layer override), at the tiny scale.
    **dict.fromkeys(("dots3_note", "dots3_note_text"), lambda kw: _text(
        kw, swa_num_attention_heads=4, swa_num_key_value_heads=4, swa_q_lora_rank=32, swa_kv_lora_rank=32,
        swa_head_dim=16, swa_qk_nope_head_dim=8, swa_v_head_dim=16)),
    "reformer": lambda kw: {**kw, "is_decoder": True, "axial_pos_embds_dim": [16, 48]},
    **dict.fromkeys(("qwen4_exp", "qwen4_exp_text"), lambda kw: _text(
        kw, indexer_n_heads=4, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=16, indexer_compress_ratio=4)),
    # Zamba's shared attention block reads the concatenation of two residual streams.
    "zamba": lambda kw: {**kw, "layers_block_type": ["linear_attention", "hybrid", "hybrid"],
                         "attention_hidden_size": 128, "attention_head_dim": 32},
    "zamba2": lambda kw: {**kw, "attention_hidden_size": 128, "attention_head_dim": 32},
    **dict.fromkeys(("gemma3n_text", "gemma3n"), lambda kw: _text(
        kw, num_kv_shared_layers=2, layer_types=["sliding_attention", "full_attention"] * 2)),
    "dory": lambda kw: {**kw, "n_input_layers": 1, "n_recurrent_layers": 1, "n_output_layers": 1},
    # Hybrids whose attention layers sit past the first two, and whose state sizes are tied.
    "jamba": lambda kw: {**kw, "attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2,
                         "expert_layer_offset": 1},
    "recurrent_gemma": lambda kw: {**kw, "block_types": ["recurrent", "attention"]},
    "bamba": lambda kw: {**kw, "attn_layer_indices": [1], **MAMBA},
    "granitemoehybrid": lambda kw: {**kw, "layer_types": ["linear_attention", "full_attention"], **MAMBA},
    "mamba2": lambda kw: {**kw, "num_heads": 8, "n_groups": 1},
    "xlstm": lambda kw: {**kw, "num_heads": 4},
    # The full-attention layers' own head size (a per-layer override), at the tiny scale.
    **dict.fromkeys(("gemma4", "gemma4_text", "gemma4_unified", "gemma4_unified_text", "gemma4_unified_assistant"),
                    lambda kw: _text(kw, global_head_dim=32)),
}
# Depth where two layers cannot hold the family's pattern: Zamba's shared attention block needs two
# hybrid layers; KV sharing (Gemma 3n) a producer of each layer type before its consumers; Dory an
# input, a recurrent and an output block.
LAYERS_FOR = {"zamba": 3, "gemma3n_text": 4, "gemma3n": 4, "dory": 3}
# Families whose causal LM takes one part of the composite config the mapping names.
SUB_CONFIG = {"musicgen": "decoder", "musicgen_melody": "decoder"}
# Config kwargs without which the class's own defaults fail validation.
DEFAULTS = {"gemma4_assistant": {"text_config": {"hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0}}}


def tiny_config(model_type: str):
    """(config, "") with the family's defaults at a tiny size, or (None, why it cannot be built)."""
    try:
        cls = CONFIG_MAPPING[model_type]
    except KeyError:
        return None, f"no config class for {model_type!r}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            defaults = cls(**DEFAULTS.get(model_type, {}))
        except Exception as error:  # noqa: BLE001 - reported, not raised
            return None, f"its config class has no usable defaults ({first_line(error)})"
        kw = _overrides(defaults, LAYERS_FOR.get(model_type, LAYERS))
        kw = QUIRKS.get(model_type, lambda kw: kw)(kw)
        try:
            config = cls(**kw)
        except Exception as error:  # noqa: BLE001 - reported, not raised
            return None, f"the family's config rejects the tiny sizes ({first_line(error)})"
    return (getattr(config, SUB_CONFIG[model_type]) if model_type in SUB_CONFIG else config), ""


def first_line(error: BaseException) -> str:
    """The error's type and first line (and the next, where the first only introduces it)."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    text = " ".join(lines[:2]) if len(lines) > 1 and lines[0].endswith(":") else (lines[0] if lines else "")
    return f"{type(error).__name__}: {text}"[:300]


@functools.lru_cache(maxsize=None)
def tiny_model(model_type: str, seed: int = 0):
    """(model, "") as a deterministic fp32 CPU model, weights (dim > 1) scaled x4 so that greedy
    picks are far from ties; or (None, why not)."""
    config, reason = tiny_config(model_type)
    if config is None:
        return None, reason
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            if model_type in SUB_CONFIG:  # the auto class knows only the composite config
                cls = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
                model = cls._from_config(config, dtype=torch.float32).eval()
            else:
                model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        except Exception as error:  # noqa: BLE001 - reported, not raised
            return None, f"the model does not build from the tiny config ({first_line(error)})"
    if model_type == "xmod":  # its adapters need a language; the config's first is the default
        model.roberta.set_default_language(config.languages[0])
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(4.0)
    return model, ""


def routes_attention(model: torch.nn.Module) -> bool:
    """Whether the installed transformers' modeling module of `model` routes its attention through the
    attention interface (GPT-J's and CodeGen's did not before 5.2x: the engine refuses them there)."""
    import sys

    return "ALL_ATTENTION_FUNCTIONS" in vars(sys.modules[type(model).__module__])
