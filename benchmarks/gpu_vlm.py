"""Vision-language generate on the GPU: exactness on a tiny fp32 LLaVA, then a 7B shape (random bf16
weights) with 64 requests x (1 image of 576 tokens + 64 text tokens) -> 256 new, stock generate beside
generate(batching="async") in one process, and the roofline. Shapes: LLaVA-1.5-7B (CLIP ViT-L/14 at
336 px, Llama-2-7B), Qwen2.5-VL-7B (its ViT at 672 x 672 px: 2304 patches merged 2 x 2 into 576 tokens,
multimodal rotary positions), Qwen3-VL-8B (its ViT at 768 x 768 px with 16 px patches: 2304 patches
merged into 576 tokens, interleaved multimodal rotary positions, deepstack features added to the
language model's first layers). Inputs are built without a processor (no image library needed).

    PYTHONPATH=. python benchmarks/gpu_vlm.py [--shape llava-1.5-7b|qwen2.5-vl-7b|qwen3-vl-8b] [--requests 64] [--new 256]
                                              [--repeat G]

--repeat G: requests / G distinct prompts, each G times in a row, image included (a GRPO rollout's
groups): the towers encode each distinct image once (model/vision_dedupe.py), stock every copy.
`again_s` is the same call once more (an RL epoch, an evaluation rerun): its prompt pages and tower
outputs come from the engine's caches (model/vision_feature_cache.py).

Roofline: the vision tower's and the prefill's FLOPs (of the distinct prompts) at 790 TFLOP/s, plus
every decode step at the bandwidth floor (weights + the K/V it reads, at the measured copy bandwidth).
"""

from __future__ import annotations

import argparse
import inspect
import json
import time

import torch

import hf_async_cb

PEAK_FLOPS = 790e12


def llava(text: dict, vision: dict, image_size: int, patch: int, dtype, device):
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    config = LlavaConfig(text_config=LlamaConfig(**text), vision_config=CLIPVisionConfig(
        image_size=image_size, patch_size=patch, **vision), image_token_id=text["vocab_size"] - 1,
        vision_feature_layer=-2, vision_feature_select_strategy="default")
    with torch.device(device):
        model = LlavaForConditionalGeneration(config).to(dtype).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def qwen_vl(text: dict, vision: dict, dtype, device, version: str = "2.5"):
    from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen3VLConfig,
                              Qwen3VLForConditionalGeneration)

    config_class, model_class = ((Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration) if version == "2.5"
                                 else (Qwen3VLConfig, Qwen3VLForConditionalGeneration))
    vocab = text["vocab_size"]
    ids = dict(image_token_id=vocab - 1, video_token_id=vocab - 2, vision_start_token_id=vocab - 3,
               vision_end_token_id=vocab - 4)
    half = text["hidden_size"] // text["num_attention_heads"] // 2  # rotary pairs: [t, h, w] as Qwen's 16/24/24 of 64
    sections = [half // 4, (half - half // 4) // 2, half - half // 4 - (half - half // 4) // 2]
    rope = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": sections}
    if version != "2.5":  # (Qwen3-VL: [24, 20, 20] of 64 pairs, interleaved)
        rope.update(mrope_section=[3 * half // 8, (half - 3 * half // 8) // 2, half - 3 * half // 8 - (half - 3 * half // 8) // 2],
                    mrope_interleaved=True)
    config = config_class(text_config=dict(text, rope_parameters=rope), vision_config=vision, **ids)
    with torch.device(device):
        model = model_class(config).to(dtype).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def qwen_batch(model, rows: int, text_tokens: int, grid: int, device, seed: int = 0):
    """rows x (text, <vision_start>, grid*grid/4 image tokens, <vision_end>, text): input ids, mask,
    flattened patches [rows * grid * grid, 3 * 2 * 14 * 14], grids, and the token types 5.24 reads."""
    config = model.config
    g = torch.Generator().manual_seed(seed)
    vocab = config.text_config.vocab_size
    tokens = grid * grid // 4
    ids = torch.randint(3, vocab - 8, (rows, text_tokens), generator=g)
    half = text_tokens // 2
    image = torch.tensor([config.vision_start_token_id] + [config.image_token_id] * tokens + [config.vision_end_token_id])
    ids = torch.cat([ids[:, :half], image.repeat(rows, 1), ids[:, half:]], dim=1)
    vision = config.vision_config
    patch = 3 * vision.temporal_patch_size * vision.patch_size ** 2
    inputs = dict(input_ids=ids.to(device), attention_mask=torch.ones_like(ids).to(device),
                  pixel_values=torch.randn(rows * grid * grid, patch, generator=g).to(device, next(model.parameters()).dtype),
                  image_grid_thw=torch.tensor([[1, grid, grid]] * rows).to(device))
    if "mm_token_type_ids" in inspect.signature(type(model).forward).parameters:
        inputs["mm_token_type_ids"] = (ids == config.image_token_id).int().to(device)
    return inputs


def repeated(inputs: dict, times: int) -> dict:
    """Each row `times` times in a row, its image too (the per-row tensors, the patches of a row's
    image and its grid alike: one image per row)."""
    rows = inputs["input_ids"].shape[0]
    out = {}
    for key, value in inputs.items():
        if key == "pixel_values" and value.shape[0] != rows:  # flattened patches, as many per row
            value = value.reshape(rows, -1, value.shape[-1]).repeat_interleave(times, 0).flatten(0, 1)
        else:
            value = value.repeat_interleave(times, 0)
        out[key] = value
    return out


def batch(model, rows: int, text_tokens: int, image_tokens: int, image_size: int, device, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.text_config.vocab_size
    image = model.config.image_token_id
    ids = torch.randint(3, vocab - 2, (rows, text_tokens), generator=g)
    half = text_tokens // 2
    ids = torch.cat([ids[:, :half], torch.full((rows, image_tokens), image), ids[:, half:]], dim=1)
    pixels = torch.randn(rows, 3, image_size, image_size, generator=g)
    return (ids.to(device), torch.ones_like(ids).to(device),
            pixels.to(device, next(model.parameters()).dtype))


def timed(fn):
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start, out


def exact_tiny(device) -> dict:
    text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=300, max_position_embeddings=512)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, projection_dim=32)
    torch.manual_seed(0)
    model = llava(text, vision, 28, 14, torch.float32, device)
    ids, mask, pixels = batch(model, 6, 12, 4, 28, device)
    mask[0, :3] = 0
    ref = model.generate(input_ids=ids, attention_mask=mask, pixel_values=pixels, max_new_tokens=12, do_sample=False)
    result = {}
    for mode in ("sync", "async"):
        out = model.generate(input_ids=ids, attention_mask=mask, pixel_values=pixels, max_new_tokens=12,
                             do_sample=False, batching=mode)
        result[mode] = bool(torch.equal(out, ref))
    return result


def copy_bandwidth(device) -> float:
    x = torch.empty(2 << 30, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    y.copy_(x)
    seconds, _ = timed(lambda: [y.copy_(x) for _ in range(10)])
    return 2 * x.numel() * 10 / seconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", choices=("llava-1.5-7b", "qwen2.5-vl-7b", "qwen3-vl-8b"), default="llava-1.5-7b")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--skip-tiny", action="store_true")
    parser.add_argument("--text", type=int, default=64)
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=1, help="each distinct prompt and image this many times")
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.requests % args.repeat:
        parser.error("--requests must be a multiple of --repeat")
    distinct = args.requests // args.repeat
    device = torch.device("cuda")
    report = {}
    if not args.skip_tiny:
        report["tiny_fp32_exact"] = exact_tiny(device)
        print("tiny fp32 LLaVA equals stock:", report["tiny_fp32_exact"], flush=True)

    started = time.perf_counter()
    if args.shape == "llava-1.5-7b":
        text = dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                    num_key_value_heads=32, vocab_size=32064, max_position_embeddings=4096)
        vision = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                      projection_dim=768)
        model = llava(text, vision, 336, 14, torch.bfloat16, device)
        image_tokens = (336 // 14) ** 2
        ids, mask, pixels = batch(model, distinct, args.text, image_tokens, 336, device)
        inputs = dict(input_ids=ids, attention_mask=mask, pixel_values=pixels)
        tower, vision_tokens = model.model.vision_tower, image_tokens + 1
    elif args.shape == "qwen2.5-vl-7b":
        text = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                    num_key_value_heads=4, vocab_size=152064, max_position_embeddings=32768)
        vision = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                      patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                      fullatt_block_indexes=[7, 15, 23, 31])
        model = qwen_vl(text, vision, torch.bfloat16, device)
        grid = 48
        inputs = qwen_batch(model, distinct, args.text, grid, device)
        image_tokens, ids = grid * grid // 4, inputs["input_ids"]
        tower, vision_tokens = model.model.visual, grid * grid
    else:
        text = dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                    num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=32768)
        vision = dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=4096,
                      patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=2304,
                      deepstack_visual_indexes=[8, 16, 24])
        model = qwen_vl(text, vision, torch.bfloat16, device, version="3")
        grid = 48
        inputs = qwen_batch(model, distinct, args.text, grid, device)
        image_tokens, ids = grid * grid // 4, inputs["input_ids"]
        tower, vision_tokens = model.model.visual, grid * grid
    inputs = repeated(inputs, args.repeat)
    ids = inputs["input_ids"]
    built = time.perf_counter() - started
    kw = dict(inputs, max_new_tokens=args.new, do_sample=False)
    first, _ = timed(lambda: model.generate(**kw, batching="async"))
    # The images' part of a call: the model's own forward up to its language model (vision tower, merge).
    from hf_async_cb.model.vision import merged_prompts

    media = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
    merge, _ = timed(lambda: merged_prompts(model, inputs["input_ids"], inputs["attention_mask"], media))
    if args.repeat > 1:  # the same merge with every copy encoded, as before model/vision_dedupe.py
        import contextlib

        from hf_async_cb.model import vision

        every = vision.distinct_images
        vision.distinct_images = lambda model, towers=None: contextlib.nullcontext()
        try:
            report["vision_and_merge_every_copy_s"] = round(
                timed(lambda: merged_prompts(model, inputs["input_ids"], inputs["attention_mask"], media))[0], 3)
        finally:
            vision.distinct_images = every
    hf_async_cb.clear_prefix_cache(model)
    ours, out = timed(lambda: model.generate(**kw, batching="async"))
    # The same call again (an RL epoch, an evaluation rerun): prompt pages and tower outputs cached.
    again, again_out = timed(lambda: model.generate(**kw, batching="async"))
    stock, ref = timed(lambda: model.generate(**kw))
    rows_equal = int((out == ref).all(dim=1).sum())
    new_tokens = args.requests * args.new
    # Roofline.
    params = sum(p.numel() for p in model.parameters())
    vision_params = sum(p.numel() for p in tower.parameters())
    text_params = params - vision_params
    prompt = ids.shape[1]
    # (each distinct image encoded and each distinct prompt prefilled once: the rest is cached or shared)
    flops = 2 * vision_params * vision_tokens * distinct + 2 * text_params * prompt * distinct
    bandwidth = copy_bandwidth(device)
    head_dim = text["hidden_size"] // text["num_attention_heads"]
    kv_per_token = 2 * text["num_hidden_layers"] * text["num_key_value_heads"] * head_dim * 2
    weight_bytes = text_params * 2
    decode = sum((weight_bytes + kv_per_token * args.requests * (prompt + t)) / bandwidth for t in range(args.new))
    roofline = flops / PEAK_FLOPS + decode
    report.update(
        shape=args.shape, requests=args.requests, repeat=args.repeat, prompt_tokens=prompt, image_tokens=image_tokens, new=args.new,
        build_s=round(built, 2), first_call_s=round(first, 3), async_s=round(ours, 3), stock_s=round(stock, 3),
        vision_and_merge_s=round(merge, 3), again_s=round(again, 3),
        again_rows_equal_first=int((again_out == out).all(dim=1).sum()),
        speedup=round(stock / ours, 2), async_tok_s=round(new_tokens / ours), stock_tok_s=round(new_tokens / stock),
        roofline_s=round(roofline, 3), fraction_of_roofline=round(roofline / ours, 3),
        copy_bandwidth_tb_s=round(bandwidth / 1e12, 2), rows_equal_to_stock=rows_equal,
        prefix_cache=hf_async_cb.prefix_cache_stats(model))
    print(json.dumps(report, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
