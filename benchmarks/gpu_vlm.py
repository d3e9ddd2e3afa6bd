"""Vision-language generate on the GPU: exactness on a tiny fp32 LLaVA, then a LLaVA-1.5-7B shape
(random bf16 weights) with 64 requests x (1 image of 576 tokens + 64 text tokens) -> 256 new,
stock generate beside generate(batching="async") in one process, and the roofline.

    PYTHONPATH=. python benchmarks/gpu_vlm.py [--requests 64] [--new 256] [--json out.json]

Roofline: the vision tower's and the prefill's FLOPs at 790 TFLOP/s, plus every decode step at
the bandwidth floor (weights + the K/V it reads, at the measured copy bandwidth).
"""

from __future__ import annotations

import argparse
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
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--text", type=int, default=64)
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument("--json")
    args = parser.parse_args()
    device = torch.device("cuda")
    report = {"tiny_fp32_exact": exact_tiny(device)}
    print("tiny fp32 LLaVA equals stock:", report["tiny_fp32_exact"], flush=True)

    text = dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=32, vocab_size=32064, max_position_embeddings=4096)
    vision = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                  projection_dim=768)
    started = time.perf_counter()
    model = llava(text, vision, 336, 14, torch.bfloat16, device)
    built = time.perf_counter() - started
    image_tokens = (336 // 14) ** 2
    ids, mask, pixels = batch(model, args.requests, args.text, image_tokens, 336, device)
    kw = dict(input_ids=ids, attention_mask=mask, pixel_values=pixels, max_new_tokens=args.new, do_sample=False)
    first, _ = timed(lambda: model.generate(**kw, batching="async"))
    hf_async_cb.clear_prefix_cache(model)
    ours, out = timed(lambda: model.generate(**kw, batching="async"))
    stock, ref = timed(lambda: model.generate(**kw))
    rows_equal = int((out == ref).all(dim=1).sum())
    new_tokens = args.requests * args.new
    # Roofline.
    params = sum(p.numel() for p in model.parameters())
    vision_params = sum(p.numel() for p in model.model.vision_tower.parameters())
    text_params = params - vision_params
    prompt = ids.shape[1]
    flops = 2 * vision_params * (image_tokens + 1) * args.requests + 2 * text_params * prompt * args.requests
    bandwidth = copy_bandwidth(device)
    kv_per_token = 2 * text["num_hidden_layers"] * text["num_key_value_heads"] * 128 * 2
    weight_bytes = text_params * 2
    decode = sum((weight_bytes + kv_per_token * args.requests * (prompt + t)) / bandwidth for t in range(args.new))
    roofline = flops / PEAK_FLOPS + decode
    report.update(
        shape="llava-1.5-7b", requests=args.requests, prompt_tokens=prompt, image_tokens=image_tokens, new=args.new,
        build_s=round(built, 2), first_call_s=round(first, 3), async_s=round(ours, 3), stock_s=round(stock, 3),
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
