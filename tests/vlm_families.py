"""Tiny random vision-language models, and their inputs built by each family's own processor.

A helper module for tests (not a test file). For every image-text-to-text family surveyed in
docs/vlm_survey.md it builds

- a tiny random-weight model on the CPU in float32 from a config (no download): hidden 32-64,
  two text layers, a one- or two-layer vision tower, images of 28-64 px, a vocabulary of a few
  hundred with the image token ids inside it;
- the batch the family's own processor makes: the real processor class, fed a tiny word-level
  tokenizer built here (words "w0".."w199" plus the family's special tokens) and the family's PIL
  image processor shrunk to the tiny image size, padding on the left. So the number of image
  placeholder tokens, pixel_values' shape and the extra inputs (image_sizes, image_grid_thw,
  pixel_attention_mask, token_type_ids, aspect ratios, ...) are whatever the processor computes.

Scenarios (``build_inputs(name, scenario)``):
- "one_each":   three rows, one image each; rows 0 and 1 have the same text and different images,
                row 2 is longer, so rows 0 and 1 are left-padded.
- "mixed":      three rows: image, no image, image.
- "two_images": row 0 has two images, row 1 one (only where the family takes several per prompt).

``FAMILIES`` maps a name to a ``VLMFamily``; ``build_model(name)`` / ``build_inputs(name, ...)``
are the short ways in. ``capture_language_model_inputs(model, inputs, family)`` records the kwargs
that reach the language-model submodule through a forward pre-hook and stops the forward there.
``python -m tests.vlm_families [name ...]`` prints the survey probes behind docs/vlm_survey.md (one
JSON line per family).

Without torchvision (this environment), three things stand in for transformers' own: video
processors are left out (``without_video``), PixtralProcessor's prompt expansion is redone here
(its module imports torchvision) and Llama 4's tiler is a PIL stand-in (its image processor is
torchvision-only). Gemma 3's image projection and Mllama's cross-attention gates start at zero,
which would make images invisible in a random model; ``post_build`` gives them small random values.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any, Callable

import numpy as np
import torch

import transformers
from packaging.version import Version
from transformers import PreTrainedTokenizerFast

TRANSFORMERS_MINOR = Version(transformers.__version__).release[:2]

N_WORDS = 200
BASE_TOKENS = ("<unk>", "<pad>", "<s>", "</s>")
SCENARIOS = ("one_each", "mixed", "two_images")

# ---------------------------------------------------------------------------------------------
# tokenizer, images, prompts


def make_tokenizer(specials=(), named=None, extra_vocab=()):
    """A word-level tokenizer: ids 0-3 are <unk> <pad> <s> </s>, then ``specials`` (split out of
    any text, as added special tokens), then ``extra_vocab`` (plain tokens), then w0..w199.

    ``named`` maps attribute names (image_token, boi_token, ...) to tokens, which become
    ``tokenizer.image_token`` / ``tokenizer.image_token_id`` as a hub tokenizer has them.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers

    named = dict(named or {})
    specials = list(dict.fromkeys(list(specials) + [t for t in named.values() if t not in specials]))
    words = list(BASE_TOKENS) + specials + [t for t in extra_vocab if t not in specials]
    words += [f"w{i}" for i in range(N_WORDS)]
    vocab = {t: i for i, t in enumerate(words)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    kwargs = {}
    if named:
        kwargs["model_specific_special_tokens"] = named
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", pad_token="<pad>", bos_token="<s>",
                                  eos_token="</s>", **kwargs)
    if specials:
        tok.add_special_tokens({"additional_special_tokens": specials}, replace_extra_special_tokens=False)
    assert len(tok) == len(vocab), (len(tok), len(vocab))
    return tok


def without_video(processor_cls):
    """``processor_cls`` that accepts ``video_processor=None``: video processors need torchvision,
    which this environment lacks, and image-only inputs never touch them."""

    class ImageOnly(processor_cls):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument is None and "video" in argument_name:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    ImageOnly.__name__ = ImageOnly.__qualname__ = processor_cls.__name__
    return ImageOnly


def vocab_size_for(tok, multiple=64):
    return -(-len(tok) // multiple) * multiple


def make_image(seed: int, size=(48, 48)):
    """A random RGB image (H, W, 3) uint8, different for every seed."""
    rng = np.random.default_rng(1000 + seed)
    return rng.integers(0, 256, size=(size[0], size[1], 3), dtype=np.uint8)


# Rows per scenario: (text with "{img}" where an image goes, number of images). Rows 0 and 1 of
# "one_each" share their text, so only their images differ.
ROWS = {
    "one_each": [("w1 w2 {img} w3 w4", 1), ("w1 w2 {img} w3 w4", 1), ("w5 w6 w7 {img} w8 w9 w10 w11 w12", 1)],
    "mixed": [("w1 {img} w2 w3", 1), ("w4 w5 w6 w7 w8 w9", 0), ("w10 w11 w12 {img} w13", 1)],
    "two_images": [("w1 {img} w2 {img} w3", 2), ("w4 w5 {img} w6", 1)],
}
# Raw image sizes (H, W) of the images of a batch, in order. Rows 0 and 1 of "one_each" get images of the
# same size (so their placeholder ids are identical: only pixel_values tell them apart); the others
# differ in aspect ratio, so that "anyres" families pick different grids.
IMAGE_SIZES = {
    "one_each": ((48, 64), (48, 64), (64, 48)),
    "mixed": ((48, 64), (56, 56)),
    "two_images": ((48, 64), (64, 48), (56, 56)),
}


# ---------------------------------------------------------------------------------------------
# family records


@dataclasses.dataclass
class VLMFamily:
    name: str
    model_type: str
    make_model: Callable[[], Any]  # -> (model) tiny, float32, eval, CPU, seeded
    make_processor: Callable[[], Any]  # -> the family's processor over a tiny tokenizer
    image_marker: str  # what stands for one image in the prompt text given to the processor
    lm_path: str  # attribute path of the language-model submodule, from the ForConditionalGeneration
    head_path: str = "lm_head"
    multi_image: bool = True  # several images in one prompt
    text_only_rows: bool = True  # rows without an image in a batch with images
    nested_images: bool = False  # the processor wants images as one list per row
    images_first: bool = False  # the family's prompts put the images before the text (PaliGemma)
    image_size: tuple | None = None  # one raw size for every image; None: IMAGE_SIZES[scenario]
    processor_kwargs: dict = dataclasses.field(default_factory=dict)
    expected_refusal: str | None = None  # why the engine's embeddings path cannot serve it
    stock_broken: str | None = None  # why stock forward/generate fails in the installed transformers
    post_build: Callable | None = None  # (model) -> None: weights whose zero init would hide the images
    notes: str = ""


FAMILIES: dict[str, VLMFamily] = {}


def register(family: VLMFamily):
    FAMILIES[family.name] = family
    return family


def scenarios_for(name):
    fam = FAMILIES[name]
    out = ["one_each"]
    if fam.text_only_rows:
        out.append("mixed")
    if fam.multi_image:
        out.append("two_images")
    return out


@functools.lru_cache(maxsize=None)
def _processor(name):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return FAMILIES[name].make_processor()


def build_model(name):
    fam = FAMILIES[name]
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = fam.make_model()
        if fam.post_build is not None:
            fam.post_build(model)
    # already float32: no .to(dtype), which would also cast Llama 4's complex rope buffer to real
    assert all(p.dtype == torch.float32 for p in model.parameters()), name
    return model.eval()


def build_inputs(name, scenario="one_each", image_seed=0, only_row=None):
    """The batch the family's processor makes for ``scenario`` (left-padded, return_tensors="pt");
    `only_row`: that row of it alone (its text and images), a batch of one."""
    fam = FAMILIES[name]
    proc = _processor(name)
    rows = ROWS[scenario]
    texts, images, k = [], [], 0
    for r, (text, n) in enumerate(rows):
        if fam.images_first:
            text = "{img}" * n + " ".join(w for w in text.split() if w != "{img}")
        row = []
        for _ in range(n):
            size = fam.image_size or IMAGE_SIZES[scenario][k]
            row.append(make_image(image_seed * 100 + k, size))
            k += 1
        if only_row is None or r == only_row:
            texts.append(text.replace("{img}", fam.image_marker))
            images.append(row)
    if fam.nested_images:
        imgs = images
    else:
        imgs = [im for row in images for im in row]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = proc(text=texts, images=imgs, padding=True, padding_side="left", return_tensors="pt",
                   **fam.processor_kwargs)
    out = dict(out)
    out.pop("labels", None)  # PaliGemma's processor adds labels for training; generate is not given them
    for key, v in list(out.items()):
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            out[key] = v.to(torch.float32)
    return out


def get_submodule(model, path):
    obj = model
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


class _Stop(Exception):
    pass


def capture_language_model_inputs(model, inputs, name_or_path, via="generate"):
    """What reaches the language-model submodule at the prefill: its (args, kwargs).

    A forward pre-hook (with_kwargs) on the submodule records them and raises, so the language model
    itself never runs. ``via="generate"`` captures the first forward of a stock greedy ``generate``
    (position ids and masks as generate prepares them); ``via="forward"`` a plain ``model(**inputs)``.
    """
    path = FAMILIES[name_or_path].lm_path if name_or_path in FAMILIES else name_or_path
    lm = get_submodule(model, path)
    seen = {}

    def hook(module, args, kwargs):
        seen["args"], seen["kwargs"] = args, dict(kwargs)
        raise _Stop

    handle = lm.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            if via == "generate":
                model.generate(**inputs, max_new_tokens=1, do_sample=False)
            else:
                model(**inputs)
    except _Stop:
        pass
    finally:
        handle.remove()
    if "kwargs" not in seen:
        raise RuntimeError(f"{path} was never called")
    return seen["args"], seen["kwargs"]


# ---------------------------------------------------------------------------------------------
# small shared configs

TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512)
CLIP_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                   projection_dim=32)
SIGLIP_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)


def _text(model_type, tok, **over):
    cfg = dict(TEXT, model_type=model_type, vocab_size=vocab_size_for(tok), pad_token_id=tok.pad_token_id,
               bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    cfg.update(over)
    return cfg


# ---------------------------------------------------------------------------------------------
# LLaVA (CLIP vision, one image = (size/patch)^2 tokens)

LLAVA_SPECIALS = ["<image>"]


def _llava_tok():
    return make_tokenizer(LLAVA_SPECIALS)


def _llava_model():
    tok = _llava_tok()
    cfg = transformers.LlavaConfig(
        vision_config=dict(CLIP_VISION, model_type="clip_vision_model", image_size=28, patch_size=7),
        text_config=_text("llama", tok), image_token_index=tok.convert_tokens_to_ids("<image>"),
        vision_feature_select_strategy="default", vision_feature_layer=-2)
    return transformers.LlavaForConditionalGeneration(cfg)


def _llava_processor():
    from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil
    ip = LlavaImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    return transformers.LlavaProcessor(image_processor=ip, tokenizer=_llava_tok(), patch_size=7,
                                       vision_feature_select_strategy="default", num_additional_image_tokens=1)


register(VLMFamily("llava", "llava", _llava_model, _llava_processor, "<image>", "model.language_model"))


# ---------------------------------------------------------------------------------------------
# LLaVA-NeXT (anyres: base image + grid tiles, unpadded, with a newline embedding per row)

NEXT_PINPOINTS = [[28, 28], [28, 56], [56, 28], [56, 56]]


def _llava_next_model():
    tok = _llava_tok()
    cfg = transformers.LlavaNextConfig(
        vision_config=dict(CLIP_VISION, model_type="clip_vision_model", image_size=28, patch_size=7),
        text_config=_text("llama", tok), image_token_index=tok.convert_tokens_to_ids("<image>"),
        vision_feature_select_strategy="default", vision_feature_layer=-2, image_grid_pinpoints=NEXT_PINPOINTS)
    return transformers.LlavaNextForConditionalGeneration(cfg)


def _llava_next_processor():
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil
    ip = LlavaNextImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28},
                                    image_grid_pinpoints=NEXT_PINPOINTS)
    return transformers.LlavaNextProcessor(image_processor=ip, tokenizer=_llava_tok(), patch_size=7,
                                           vision_feature_select_strategy="default", num_additional_image_tokens=1)


register(VLMFamily("llava_next", "llava_next", _llava_next_model, _llava_next_processor, "<image>",
                   "model.language_model"))


# ---------------------------------------------------------------------------------------------
# LLaVA-OneVision (SigLIP, anyres_max, Qwen2 text)

OV_PINPOINTS = [[28, 28], [28, 56], [56, 28], [56, 56]]


def _ov_tok():
    return make_tokenizer(["<image>", "<video>"])


def _ov_model():
    tok = _ov_tok()
    cfg = transformers.LlavaOnevisionConfig(
        vision_config=dict(SIGLIP_VISION, model_type="siglip_vision_model", image_size=28, patch_size=7),
        text_config=_text("qwen2", tok), image_token_index=tok.convert_tokens_to_ids("<image>"),
        video_token_index=tok.convert_tokens_to_ids("<video>"), image_grid_pinpoints=OV_PINPOINTS)
    return transformers.LlavaOnevisionForConditionalGeneration(cfg)


def _ov_processor():
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
        LlavaOnevisionImageProcessorPil)
    ip = LlavaOnevisionImageProcessorPil(size={"height": 28, "width": 28}, image_grid_pinpoints=OV_PINPOINTS)
    return without_video(transformers.LlavaOnevisionProcessor)(
        image_processor=ip, tokenizer=_ov_tok(), video_processor=None, num_image_tokens=16,
        vision_feature_select_strategy="full")


register(VLMFamily("llava_onevision", "llava_onevision", _ov_model, _ov_processor, "<image>",
                   "model.language_model", nested_images=True))


# ---------------------------------------------------------------------------------------------
# Qwen2-VL / Qwen2.5-VL / Qwen3-VL (patches merged 2x2, 3D multimodal rope)

QWEN_SPECIALS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
QWEN_MARKER = "<|vision_start|><|image_pad|><|vision_end|>"


def _qwen_tok():
    return make_tokenizer(QWEN_SPECIALS)


def _qwen_ids(tok):
    ids = tok.convert_tokens_to_ids
    return dict(image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
                vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"))


def _qwen_image_processor(patch_size):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    f = patch_size * 2
    return Qwen2VLImageProcessorPil(size={"shortest_edge": f * f, "longest_edge": 4 * f * f}, patch_size=patch_size,
                                    merge_size=2, temporal_patch_size=2)


def _qwen_text(model_type, tok):
    """The text config of the Qwen2-VL family: multimodal rotary sections, no explicit head_dim."""
    text = _text(model_type, tok, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                   "mrope_section": [2, 3, 3]})
    text.pop("head_dim")
    return text


def _qwen2_vl_model():
    tok = _qwen_tok()
    text = _qwen_text("qwen2_vl_text", tok)
    cfg = transformers.Qwen2VLConfig(
        text_config=text, vision_config=dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2,
                                             patch_size=14, spatial_merge_size=2, temporal_patch_size=2),
        **_qwen_ids(tok))
    return transformers.Qwen2VLForConditionalGeneration(cfg)


def _qwen2_vl_processor(patch_size=14, cls=None):
    cls = cls or transformers.Qwen2VLProcessor
    return without_video(cls)(image_processor=_qwen_image_processor(patch_size), tokenizer=_qwen_tok(),
                              video_processor=None)


register(VLMFamily("qwen2_vl", "qwen2_vl", _qwen2_vl_model, _qwen2_vl_processor, QWEN_MARKER,
                   "model.language_model"))


def _qwen2_5_vl_model():
    tok = _qwen_tok()
    text = _qwen_text("qwen2_5_vl_text", tok)
    cfg = transformers.Qwen2_5_VLConfig(
        text_config=text, vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                                             out_hidden_size=64, patch_size=14, spatial_merge_size=2,
                                             temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1]),
        **_qwen_ids(tok))
    return transformers.Qwen2_5_VLForConditionalGeneration(cfg)


register(VLMFamily("qwen2_5_vl", "qwen2_5_vl", _qwen2_5_vl_model,
                   lambda: _qwen2_vl_processor(14, transformers.Qwen2_5_VLProcessor), QWEN_MARKER,
                   "model.language_model"))


def _qwen3_vl_model(moe: bool = False):
    """A tiny Qwen3-VL (deepstack from both vision layers), its language model dense or a mixture of experts."""
    tok = _qwen_tok()
    text = _text("qwen3_vl_moe_text" if moe else "qwen3_vl_text", tok, rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2], "mrope_interleaved": True})
    if moe:
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1)
    config_class, model_class = ((transformers.Qwen3VLMoeConfig, transformers.Qwen3VLMoeForConditionalGeneration)
                                 if moe else (transformers.Qwen3VLConfig, transformers.Qwen3VLForConditionalGeneration))
    cfg = config_class(
        text_config=text, vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                                             out_hidden_size=64, patch_size=16, spatial_merge_size=2,
                                             temporal_patch_size=2, num_position_embeddings=16,
                                             deepstack_visual_indexes=[0, 1]),
        **_qwen_ids(tok))
    return model_class(cfg)


register(VLMFamily("qwen3_vl", "qwen3_vl", _qwen3_vl_model,
                   lambda: _qwen2_vl_processor(16, transformers.Qwen3VLProcessor), QWEN_MARKER,
                   "model.language_model",
                   notes="the language model also takes visual_pos_masks and deepstack_visual_embeds (added to "
                         "the hidden states of its first layers at the image positions)"))


register(VLMFamily("qwen3_vl_moe", "qwen3_vl_moe", lambda: _qwen3_vl_model(moe=True),
                   lambda: _qwen2_vl_processor(16, transformers.Qwen3VLProcessor), QWEN_MARKER,
                   "model.language_model",
                   notes="Qwen3-VL with a mixture-of-experts language model: deepstack features as Qwen3-VL's"))


# GLM-4.1V / GLM-4V (Qwen2-VL-style 3D rope, partial rotary; 2x2 merged patches)

GLM4V_SPECIALS = ["<|begin_of_image|>", "<|image|>", "<|end_of_image|>", "<|begin_of_video|>", "<|video|>",
                  "<|end_of_video|>"]


def _glm4v_tok():
    return make_tokenizer(GLM4V_SPECIALS)


def _glm4v_model():
    tok = _glm4v_tok()
    ids = tok.convert_tokens_to_ids
    text = _text("glm4v_text", tok, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                      "mrope_section": [2, 1, 1], "partial_rotary_factor": 0.5})
    text.pop("head_dim")
    cfg = transformers.Glm4vConfig(
        text_config=text, vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                                             out_hidden_size=64, image_size=28, patch_size=14, spatial_merge_size=2,
                                             temporal_patch_size=2),
        image_token_id=ids("<|image|>"), video_token_id=ids("<|video|>"),
        image_start_token_id=ids("<|begin_of_image|>"), image_end_token_id=ids("<|end_of_image|>"),
        video_start_token_id=ids("<|begin_of_video|>"), video_end_token_id=ids("<|end_of_video|>"))
    return transformers.Glm4vForConditionalGeneration(cfg)


def _glm4v_processor():
    from transformers.models.glm4v.image_processing_pil_glm4v import Glm4vImageProcessorPil
    ip = Glm4vImageProcessorPil(size={"shortest_edge": 2 * 56 * 56, "longest_edge": 2 * 4 * 56 * 56}, patch_size=14,
                                merge_size=2, temporal_patch_size=2)
    return without_video(transformers.Glm4vProcessor)(image_processor=ip, tokenizer=_glm4v_tok(),
                                                      video_processor=None)


register(VLMFamily("glm4v", "glm4v", _glm4v_model, _glm4v_processor, "<|begin_of_image|><|image|><|end_of_image|>",
                   "model.language_model"))


# ---------------------------------------------------------------------------------------------
# Gemma 3 (SigLIP, pooled to mm_tokens_per_image, <start_of_image> + soft tokens + <end_of_image>)

GEMMA3_NAMED = {"boi_token": "<start_of_image>", "image_token": "<image_soft_token>", "eoi_token": "<end_of_image>"}


def _gemma3_tok():
    return make_tokenizer(named=GEMMA3_NAMED)


def _gemma3_model():
    tok = _gemma3_tok()
    ids = tok.convert_tokens_to_ids
    text = _text("gemma3_text", tok, query_pre_attn_scalar=16, sliding_window=16,
                 layer_types=["sliding_attention", "full_attention"])
    cfg = transformers.Gemma3Config(
        text_config=text, vision_config=dict(SIGLIP_VISION, model_type="siglip_vision_model", image_size=28,
                                             patch_size=7),
        mm_tokens_per_image=4, boi_token_index=ids("<start_of_image>"), eoi_token_index=ids("<end_of_image>"),
        image_token_index=ids("<image_soft_token>"))
    return transformers.Gemma3ForConditionalGeneration(cfg)


def _gemma3_processor():
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
    ip = Gemma3ImageProcessorPil(size={"height": 28, "width": 28})
    return transformers.Gemma3Processor(image_processor=ip, tokenizer=_gemma3_tok(), image_seq_length=4)


def _gemma3_post_build(model):
    # Gemma 3 initialises its image projection to zeros: every image would project to 0
    with torch.no_grad():
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, 0.02)


register(VLMFamily("gemma3", "gemma3", _gemma3_model, _gemma3_processor, "<start_of_image>",
                   "model.language_model", nested_images=True, post_build=_gemma3_post_build,
                   notes="token_type_ids make each image's tokens attend to each other bidirectionally"))


# ---------------------------------------------------------------------------------------------
# PaliGemma (SigLIP, images first, then <bos> and the prefix; the prefix attends bidirectionally)


def _paligemma_tok():
    return make_tokenizer(["<image>"])


def _paligemma(tok, text):
    cfg = transformers.PaliGemmaConfig(
        text_config=text, vision_config=dict(SIGLIP_VISION, model_type="siglip_vision_model", image_size=28,
                                             patch_size=7, projection_dim=64),
        image_token_index=tok.convert_tokens_to_ids("<image>"), projection_dim=64, hidden_size=64,
        vocab_size=text["vocab_size"])
    return transformers.PaliGemmaForConditionalGeneration(cfg)


def _paligemma_model():
    tok = _paligemma_tok()
    return _paligemma(tok, _text("gemma", tok))


def _paligemma_processor():
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil
    ip = SiglipImageProcessorPil(size={"height": 28, "width": 28})
    ip.image_seq_length = 16
    return transformers.PaliGemmaProcessor(image_processor=ip, tokenizer=_paligemma_tok())


register(VLMFamily("paligemma", "paligemma", _paligemma_model, _paligemma_processor, "<image>",
                   "model.language_model", nested_images=True, images_first=True, text_only_rows=False,
                   notes="prefix-LM: the whole prompt (images + text, token_type_ids 0) attends bidirectionally; "
                         "positions start at 1"))


def _paligemma2_model():
    # PaliGemma 2: Gemma 2 text (sliding window every other layer, attention and final logit softcapping)
    tok = _paligemma_tok()
    return _paligemma(tok, _text("gemma2", tok, query_pre_attn_scalar=16, sliding_window=16,
                                 final_logit_softcapping=30.0, attn_logit_softcapping=50.0))


register(VLMFamily("paligemma2", "paligemma", _paligemma2_model, _paligemma_processor, "<image>",
                   "model.language_model", nested_images=True, images_first=True, text_only_rows=False,
                   notes="final_logit_softcapping applied by PaliGemmaForConditionalGeneration after lm_head"))


# ---------------------------------------------------------------------------------------------
# Idefics3 / SmolVLM (image split into tiles + a global view, pixel shuffle, <row_i_col_j> tags)

IDEFICS3_SPECIALS = (["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"]
                     + [f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)])


def _idefics3_tok():
    return make_tokenizer(IDEFICS3_SPECIALS)


def _idefics3_config(cls, vision_type, tok):
    return cls(text_config=_text("llama", tok),
               vision_config=dict(SIGLIP_VISION, model_type=vision_type, image_size=28, patch_size=7),
               image_token_id=tok.convert_tokens_to_ids("<image>"), scale_factor=2)


def _idefics3_model():
    cfg = _idefics3_config(transformers.Idefics3Config, "idefics3_vision", _idefics3_tok())
    return transformers.Idefics3ForConditionalGeneration(cfg)


def _idefics3_image_processor(mod):
    import importlib
    m = importlib.import_module(f"transformers.models.{mod}.image_processing_pil_{mod}")
    cls = getattr(m, [n for n in dir(m) if n.endswith("ImageProcessorPil")][0])
    return cls(size={"longest_edge": 56}, max_image_size={"longest_edge": 28}, do_image_splitting=True)


def _idefics3_processor():
    return transformers.Idefics3Processor(image_processor=_idefics3_image_processor("idefics3"),
                                          tokenizer=_idefics3_tok(), image_seq_len=4)


register(VLMFamily("idefics3", "idefics3", _idefics3_model, _idefics3_processor, "<image>", "model.text_model",
                   nested_images=True))


def _smolvlm_model():
    cfg = _idefics3_config(transformers.SmolVLMConfig, "smolvlm_vision", _idefics3_tok())
    return transformers.SmolVLMForConditionalGeneration(cfg)


def _smolvlm_processor():
    import transformers.models.smolvlm.processing_smolvlm as mod
    saved = mod.num2words
    if saved is None:  # only used to word video frame counts; the processor insists on it at init
        mod.num2words = str
    try:
        return without_video(transformers.SmolVLMProcessor)(
            image_processor=_idefics3_image_processor("smolvlm"), tokenizer=_idefics3_tok(), video_processor=None,
            image_seq_len=4)
    finally:
        mod.num2words = saved


register(VLMFamily("smolvlm", "smolvlm", _smolvlm_model, _smolvlm_processor, "<image>", "model.text_model",
                   nested_images=True))


# ---------------------------------------------------------------------------------------------
# Mistral3 (Pixtral vision: native aspect ratio, 2D rope, [IMG_BREAK] per row, [IMG_END]; 2x2 merge)

PIXTRAL_SPECIALS = ["[IMG]", "[IMG_BREAK]", "[IMG_END]"]


def _pixtral_tok():
    return make_tokenizer(PIXTRAL_SPECIALS)


def _mistral3_model():
    tok = _pixtral_tok()
    cfg = transformers.Mistral3Config(
        text_config=_text("mistral", tok, sliding_window=None),
        vision_config=dict(model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, head_dim=16, image_size=56, patch_size=7),
        image_token_index=tok.convert_tokens_to_ids("[IMG]"), spatial_merge_size=2, vision_feature_layer=-1)
    return transformers.Mistral3ForConditionalGeneration(cfg)


class PixtralProcessorStandIn:
    """PixtralProcessor's own steps, since its module imports torchvision (absent here): the PIL image
    processor, then each "[IMG]" in the text replaced by rows of [IMG] * (width / (patch * merge)), each row
    closed by [IMG_BREAK], the last one by [IMG_END] (PixtralProcessor.replace_image_token)."""

    def __init__(self, image_processor, tokenizer, patch_size, spatial_merge_size):
        self.image_processor, self.tokenizer = image_processor, tokenizer
        self.patch_size, self.spatial_merge_size = patch_size, spatial_merge_size

    def __call__(self, text, images=None, padding=True, padding_side="left", return_tensors="pt", **kwargs):
        data, k, out_text = {}, 0, []
        if images:
            data = dict(self.image_processor(images, return_tensors="pt"))
        step = self.patch_size * self.spatial_merge_size
        for sample in text:
            parts = sample.split("[IMG]")
            pieces = [parts[0]]
            for part in parts[1:]:
                h, w = (int(x) for x in data["image_sizes"][k])
                k += 1
                rows = [["[IMG]"] * (w // step) + ["[IMG_BREAK]"]] * (h // step)
                flat = [t for row in rows for t in row]
                flat[-1] = "[IMG_END]"
                pieces += ["".join(flat), part]
            out_text.append("".join(pieces))
        enc = self.tokenizer(out_text, padding=padding, padding_side=padding_side, return_tensors=return_tensors)
        return transformers.BatchFeature({**enc, **data})


def _mistral3_processor():
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil
    ip = PixtralImageProcessorPil(size={"longest_edge": 56}, patch_size={"height": 7, "width": 7})
    return PixtralProcessorStandIn(ip, _pixtral_tok(), patch_size=7, spatial_merge_size=2)


register(VLMFamily("mistral3", "mistral3", _mistral3_model, _mistral3_processor, "[IMG]", "model.language_model",
                   notes="prompt expansion is a stand-in for PixtralProcessor (its module needs torchvision)"))


# ---------------------------------------------------------------------------------------------
# InternVL (InternViT, tiles + thumbnail, pixel shuffle; <img> <IMG_CONTEXT>*n </img>)

INTERNVL_NAMED = {"start_image_token": "<img>", "end_image_token": "</img>", "context_image_token": "<IMG_CONTEXT>",
                  "video_token": "<video>"}


def _internvl_tok():
    return make_tokenizer(named=INTERNVL_NAMED)


def _internvl_model():
    tok = _internvl_tok()
    cfg = transformers.InternVLConfig(
        text_config=_text("qwen2", tok),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=[28, 28], patch_size=[7, 7]),
        image_token_id=tok.convert_tokens_to_ids("<IMG_CONTEXT>"), image_seq_length=4, downsample_ratio=0.5)
    return transformers.InternVLForConditionalGeneration(cfg)


def _internvl_processor():
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil
    ip = GotOcr2ImageProcessorPil(size={"height": 28, "width": 28}, crop_to_patches=True, min_patches=1,
                                  max_patches=4)
    return without_video(transformers.InternVLProcessor)(image_processor=ip, tokenizer=_internvl_tok(),
                                                         video_processor=None, image_seq_length=4)


register(VLMFamily("internvl", "internvl", _internvl_model, _internvl_processor, "<IMG_CONTEXT>",
                   "model.language_model"))


# ---------------------------------------------------------------------------------------------
# Llama 4 (tiles + a global tile, pixel shuffle; MoE text with chunked attention and NoPE layers)

LLAMA4_SPECIALS = ["<|image|>", "<|image_start|>", "<|image_end|>", "<|patch|>", "<|tile_x_separator|>",
                   "<|tile_y_separator|>"]


class Llama4TilerStandIn(transformers.image_processing_base.ImageProcessingMixin):
    """A stand-in for Llama4ImageProcessor, which needs torchvision (absent here).

    Same output layout: each image resized to a grid of (rows, cols) square tiles (rows * cols <= max_patches),
    split into tiles, plus a global tile when there is more than one; all tiles of all images stacked as
    pixel_values [tiles, 3, T, T]; ``aspect_ratios`` [images, 2] (read by the processor to expand the prompt).
    The grid choice is simpler than the real one (nearest tile counts), which does not change any shape rule.
    """

    model_input_names = ["pixel_values"]

    def __init__(self, tile=28, max_patches=4, **kwargs):
        super().__init__(**kwargs)
        self.tile, self.max_patches = tile, max_patches

    def __call__(self, images, return_tensors=None, **kwargs):
        from PIL import Image

        from transformers.image_utils import make_flat_list_of_images

        t = self.tile
        tiles, ratios = [], []
        for im in make_flat_list_of_images(images):
            im = np.asarray(im)
            h, w = im.shape[:2]
            rh, rw = max(1, round(h / t)), max(1, round(w / t))
            while rh * rw > self.max_patches:
                rh, rw = (rh - 1, rw) if rh >= rw else (rh, rw - 1)
            full = np.asarray(Image.fromarray(im).resize((rw * t, rh * t)), dtype=np.float32)
            own = [full[y * t:(y + 1) * t, x * t:(x + 1) * t] for y in range(rh) for x in range(rw)]
            if rh * rw > 1:
                own.append(np.asarray(Image.fromarray(im).resize((t, t)), dtype=np.float32))
            tiles += [(a / 255.0 - 0.5) / 0.5 for a in own]
            ratios.append([rh, rw])
        pv = torch.from_numpy(np.stack(tiles)).permute(0, 3, 1, 2).contiguous()
        return transformers.BatchFeature({"pixel_values": pv, "aspect_ratios": torch.tensor(ratios)})


def _llama4_tok():
    return make_tokenizer(LLAMA4_SPECIALS)


def _llama4_model():
    tok = _llama4_tok()
    ids = tok.convert_tokens_to_ids
    text = _text("llama4_text", tok, intermediate_size=64, intermediate_size_mlp=128, num_local_experts=2,
                 num_experts_per_tok=1, interleave_moe_layer_step=1, no_rope_layer_interval=2,
                 attention_chunk_size=256, floor_scale=256, rope_parameters={"rope_type": "default",
                                                                          "rope_theta": 500000.0})
    vision = dict(hidden_size=32, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, image_size=28,
                  patch_size=7, vision_output_dim=32, projector_input_dim=32, projector_output_dim=32,
                  pixel_shuffle_ratio=0.5)
    cfg = transformers.Llama4Config(text_config=text, vision_config=vision, boi_token_index=ids("<|image_start|>"),
                                    eoi_token_index=ids("<|image_end|>"), image_token_index=ids("<|patch|>"))
    return transformers.Llama4ForConditionalGeneration(cfg)


def _llama4_processor():
    return transformers.Llama4Processor(image_processor=Llama4TilerStandIn(28, 4), tokenizer=_llama4_tok(),
                                        patch_size=7, pixel_shuffle_ratio=0.5)


register(VLMFamily("llama4", "llama4", _llama4_model, _llama4_processor, "<|image|>", "language_model.model",
                   head_path="language_model.lm_head",
                   notes="image processor is a stand-in (the real one needs torchvision); language_model is "
                         "a Llama4ForCausalLM, its own lm_head included",
                   stock_broken=("Llama4ForConditionalGeneration.forward reads outputs.image_outputs from the "
                                 "language model's MoeCausalLMOutputWithPast (AttributeError) in transformers 5.24, "
                                 "so every forward, and generate, fails (5.25 fixed it)")
                   if TRANSFORMERS_MINOR == (5, 24) else None))


# ---------------------------------------------------------------------------------------------
# Mllama (Llama 3.2 Vision: one <|image|> token; the text attends to the image through cross-attention
# layers with their own K/V, so an embeddings-in path does not apply)


def _mllama_tok():
    return make_tokenizer(["<|image|>", "<|python_tag|>"])


def _mllama_model():
    tok = _mllama_tok()
    text = _text("mllama_text_model", tok, cross_attention_layers=[1])
    text.pop("head_dim")
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_global_layers=1, attention_heads=2,
                  image_size=28, patch_size=7, max_num_tiles=4, intermediate_layers_indices=[0],
                  vision_output_dim=64)
    cfg = transformers.MllamaConfig(text_config=text, vision_config=vision,
                                    image_token_index=tok.convert_tokens_to_ids("<|image|>"))
    return transformers.MllamaForConditionalGeneration(cfg)


def _mllama_processor():
    from transformers.models.mllama.image_processing_pil_mllama import MllamaImageProcessorPil
    ip = MllamaImageProcessorPil(size={"height": 28, "width": 28}, max_image_tiles=4)
    return transformers.MllamaProcessor(image_processor=ip, tokenizer=_mllama_tok())


def _mllama_post_build(model):
    # the cross-attention layers' tanh gates start at 0: the text would never see the image
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("cross_attn_attn_gate", "cross_attn_mlp_gate")):
                p.fill_(1.0)


register(VLMFamily("mllama", "mllama", _mllama_model, _mllama_processor, "<|image|>", "model.language_model",
                   nested_images=True, post_build=_mllama_post_build,
                   # (transformers 5.17's processor refuses a batch with rows without an image)
                   text_only_rows=TRANSFORMERS_MINOR >= (5, 24),
                   expected_refusal="cross-attention to the image (cross_attention_states / cross_attention_mask); "
                                    "image features are not merged into the input embeddings"))


# ---------------------------------------------------------------------------------------------
# Aya Vision (SigLIP tiles + global tile, pixel-shuffle adapter; Cohere2 text)

AYA_SPECIALS = ["<image>", "<|START_OF_IMG|>", "<|END_OF_IMG|>", "<|IMG_PATCH|>", "<|IMG_LINE_BREAK|>"]


def _aya_tok():
    return make_tokenizer(AYA_SPECIALS, extra_vocab=[f"TILE_{i}" for i in range(1, 13)] + ["TILE_GLOBAL"])


def _aya_model():
    tok = _aya_tok()
    text = _text("cohere2", tok, sliding_window=16, layer_types=["sliding_attention", "full_attention"])
    cfg = transformers.AyaVisionConfig(
        text_config=text, vision_config=dict(SIGLIP_VISION, model_type="siglip_vision_model", image_size=28,
                                             patch_size=7),
        image_token_index=tok.convert_tokens_to_ids("<|IMG_PATCH|>"), downsample_factor=2)
    return transformers.AyaVisionForConditionalGeneration(cfg)


def _aya_processor():
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil
    ip = GotOcr2ImageProcessorPil(size={"height": 28, "width": 28}, crop_to_patches=True, min_patches=1,
                                  max_patches=4)
    return transformers.AyaVisionProcessor(image_processor=ip, tokenizer=_aya_tok(), patch_size=7, img_size=28,
                                           downsample_factor=2)


register(VLMFamily("aya_vision", "aya_vision", _aya_model, _aya_processor, "<image>", "model.language_model"))


# ---------------------------------------------------------------------------------------------
# survey probes (docs/vlm_survey.md): python -m tests.vlm_families [name ...]

_PLAIN_LM_KWARGS = {"inputs_embeds", "input_ids", "attention_mask", "position_ids", "cache", "past_key_values",
                    "use_cache", "return_dict", "output_attentions", "output_hidden_states", "cache_position",
                    "logits_to_keep"}


def describe(value):
    """A short text for a captured value: tensor shape and dtype, dict / list contents, class names."""
    if isinstance(value, torch.Tensor):
        return f"{tuple(value.shape)} {str(value.dtype).replace('torch.', '')}"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {describe(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return f"[{len(value)} x {describe(value[0])}]" if value else "[]"
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    return type(value).__name__


def image_token_id(model):
    cfg = model.config
    for key in ("image_token_id", "image_token_index"):
        if getattr(cfg, key, None) is not None:
            return getattr(cfg, key)
    return None


def _lm_logits(model, fam, args, kwargs):
    """The language model run on captured inputs, then the head (and PaliGemma's final softcap, if set)."""
    out = get_submodule(model, fam.lm_path)(*args, **kwargs)
    hidden = out[0]
    logits = get_submodule(model, fam.head_path)(hidden)
    cap = getattr(model.config.get_text_config(), "final_logit_softcapping", None)
    if cap is not None and fam.model_type == "paligemma":
        logits = torch.tanh(logits / cap) * cap
    return hidden, logits


def _cache_keyword(model):
    import inspect
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _first_step_logits(model, fam, inputs, args, lm_kw):
    if fam.stock_broken is None:
        gen = model.generate(**inputs, max_new_tokens=1, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
        return gen.logits[0]  # [B, V]: stock's first-step logits
    return _lm_logits(model, fam, args, lm_kw)[1][:, -1]


def _replays(model, fam, inputs):
    """Max |logit difference| at the first generated position against stock, for: the language model
    + head on the captured inputs, and the whole VLM given the captured embeddings without pixel inputs
    (bare: embeddings, positions, mask; +extras: the processor's other non-pixel outputs too; nopos: no
    position ids)."""
    from transformers import DynamicCache

    args, kw = capture_language_model_inputs(model, inputs, fam.name)
    lm_kw = {k: v for k, v in kw.items() if k not in ("cache", "past_key_values")}
    lm_kw["use_cache"] = False
    out = {}
    with torch.no_grad():
        ref = _first_step_logits(model, fam, inputs, args, lm_kw)
        lm_logits = _lm_logits(model, fam, args, lm_kw)[1][:, -1]
        out["lm"] = None if fam.stock_broken else (lm_logits - ref).abs().max().item()
        emb, pos = kw.get("inputs_embeds"), kw.get("position_ids")
        bare = dict(inputs_embeds=emb, attention_mask=inputs["attention_mask"], position_ids=pos)
        extras = {k: v for k, v in inputs.items()
                  if k not in ("input_ids", "attention_mask") and not k.startswith("pixel_")}
        ck = _cache_keyword(model)
        for label, call in (("vlm_bare", bare), ("vlm_extras", {**bare, **extras}),
                            ("vlm_extras_nopos", {**bare, **extras, "position_ids": None})):
            try:
                o = model(**call, **{ck: DynamicCache(config=model.config)})
                out[label] = (o.logits[:, -1] - ref).abs().max().item()
            except Exception as e:  # noqa: BLE001 - reported, not raised
                out[label] = f"{type(e).__name__}: {str(e)[:160]}"
    out["extras"] = sorted(extras)
    return out, (args, kw, lm_kw, ref)


def survey(name):
    """What reaches the language model of ``name`` at a stock prefill, and whether embeddings in reproduce
    stock's first-step logits, for every scenario."""
    fam = FAMILIES[name]
    model = build_model(name)
    res = {"name": name, "lm_class": type(get_submodule(model, fam.lm_path)).__name__, "scenarios": {}}
    for scenario in scenarios_for(name):
        inputs = build_inputs(name, scenario)
        ids = inputs["input_ids"]
        rep, (args, kw, lm_kw, ref) = _replays(model, fam, inputs)
        sc = res["scenarios"][scenario] = {"replay": rep}
        sc["input_shapes"] = {k: describe(v) for k, v in inputs.items()}
        sc["lm_kwargs"] = {k: describe(v) for k, v in kw.items() if v is not None}
        sc["extra_lm_kwargs"] = sorted(k for k, v in kw.items() if v is not None and k not in _PLAIN_LM_KWARGS)
        if scenario == "one_each":
            # decode feeds token ids: the prompt's text positions must hold the plain embeddings of their ids,
            # through the language model's own embedding module
            emb = kw.get("inputs_embeds")
            embed = model.get_input_embeddings()
            sc["embed_is_lm_embed_tokens"] = embed is getattr(get_submodule(model, fam.lm_path), "embed_tokens", None)
            if emb is not None:
                tok = image_token_id(model)
                text = (ids != tok) & (inputs["attention_mask"] == 1)
                with torch.no_grad():
                    plain = embed(ids)
                sc["text_positions_plain_embeds"] = (plain[text] - emb[text]).abs().max().item()
            sc["rows01_same_ids"] = bool(torch.equal(ids[0], ids[1]))
            sc["rows01_logit_diff"] = (ref[0] - ref[1]).abs().max().item()
            # bidirectional attention: perturb the last image token (then the last prompt token) of row 0
            # and look at the language model's output at the first image token
            tok, emb = image_token_id(model), kw.get("inputs_embeds")
            if tok is not None and emb is not None and (ids[0] == tok).any():
                with torch.no_grad():
                    hidden = _lm_logits(model, fam, args, lm_kw)[0]
                    where = (ids[0] == tok).nonzero().flatten()
                    first, last = int(where[0]), int(where[-1])

                    def changed(at):
                        e2 = emb.clone()
                        e2[0, at] += torch.randn_like(e2[0, at])
                        h2, _ = _lm_logits(model, fam, args, {**lm_kw, "inputs_embeds": e2})
                        return (h2[0, first] - hidden[0, first]).abs().max().item() > 1e-6

                    sc["image_sees_later_image_token"] = changed(last) if last > first else None
                    sc["image_sees_later_text"] = changed(ids.shape[1] - 1)
        # positions: every call of the language model during a short stock generate
        if fam.stock_broken is None:
            calls = []

            def hook(module, a, k):
                p = k.get("position_ids")
                calls.append(None if p is None else p.clone())

            h = get_submodule(model, fam.lm_path).register_forward_pre_hook(hook, with_kwargs=True)
            try:
                with torch.no_grad():
                    model.generate(**inputs, max_new_tokens=3, do_sample=False)
            finally:
                h.remove()
            real = inputs["attention_mask"].sum(-1).tolist()
            sc["positions"] = {
                "prompt_len": ids.shape[1], "real_tokens_per_row": real,
                "prefill_last": None if calls[0] is None else calls[0][..., -1].tolist(),
                "decode": [None if c is None else c[..., -1].tolist() for c in calls[1:]],
            }
    return res


def _main(argv):
    import json
    names = argv or list(FAMILIES)
    for n in names:
        try:
            print(json.dumps(survey(n), default=str))
        except Exception as e:  # noqa: BLE001
            print(json.dumps({"name": n, "error": f"{type(e).__name__}: {e}"}))


if __name__ == "__main__":
    import sys
    _main(sys.argv[1:])
