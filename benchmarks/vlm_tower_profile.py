"""Where a vision tower's time goes (issue 31: Qwen2.5-VL-7B's tower took 1.31 s of a 3.78 s call for
64 images, against ~0.25 s of FLOPs at 790 TFLOP/s): the tower alone, as the engine runs it
(model/vision_attention.py's packed attention, then each of the engine's other changes added in
turn: the patch embedding as a GEMM, aligned MLPs, the fused rotary, the norms' kernel), timed over all images at once and in smaller
batches, then one profiled run: kernels launched, GPU busy time against the wall, the kernels and
the host-side ops that take the most.

    PYTHONPATH=. python benchmarks/vlm_tower_profile.py [--shape qwen2.5-vl-7b|tiny] [--images 64]
"""
import argparse
import contextlib
import sys
import time

import torch

sys.path.insert(0, "benchmarks")
import gpu_vlm  # noqa: E402

from hf_async_cb.model.aligned_mlp import aligned_mlps  # noqa: E402
from hf_async_cb.model.patch_embed import convolutions_as_gemms  # noqa: E402
from hf_async_cb.model.vision_attention import packed_vision_attention  # noqa: E402
from hf_async_cb.model.tower_norms import fused_tower_norms  # noqa: E402
from hf_async_cb.model.vision_rotary import fused_vision_rotary  # noqa: E402

VISION = {
    "qwen2.5-vl-7b": (dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                           fullatt_block_indexes=[7, 15, 23, 31]), 3584, 48),
    "tiny": (dict(depth=4, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1, 3]), 64, 8),
}


def tower_flops(vision: dict, patches: int, window_patches: int, image_patches: int) -> float:
    """Matmul FLOPs of the tower over `patches` (projections, MLP, attention scores and values)."""
    h, inter, depth = vision["hidden_size"], vision["intermediate_size"], vision["depth"]
    full = len(vision["fullatt_block_indexes"])
    dense = 2 * patches * depth * (4 * h * h + 3 * h * inter)
    attention = 4 * patches * h * (full * image_patches + (depth - full) * window_patches)
    merger = 2 * (patches // 4) * (4 * h) * (4 * h + vision["out_hidden_size"])
    return dense + attention + merger


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=tuple(VISION), default="qwen2.5-vl-7b")
    p.add_argument("--images", type=int, default=64)
    p.add_argument("--batches", default="64,16,4,1", help="images per tower call, timed each")
    p.add_argument("--profile-stage", type=int, default=4, help="the stage profiled (0: the model's own code)")
    p.add_argument("--peak-tflops", type=float, default=790.0)
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    vision, hidden, grid = VISION[args.shape]
    text = dict(hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=1, num_attention_heads=hidden // 128 or 2,
                num_key_value_heads=1, vocab_size=1024, max_position_embeddings=32768)
    if args.shape == "tiny":
        text.update(num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = gpu_vlm.qwen_vl(text, vision, dtype, device)
    inputs = gpu_vlm.qwen_batch(model, args.images, 8, grid, device)
    pixels, grids = inputs["pixel_values"], inputs["image_grid_thw"]
    per_image = grid * grid
    window = (vision["window_size"] // vision["patch_size"]) ** 2
    flops = tower_flops(vision, pixels.shape[0], window, per_image)
    print(f"{args.shape} tower, {args.images} images of {per_image} patches, {device}, {dtype}; "
          f"{flops / 1e12:.1f} TFLOP -> {flops / args.peak_tflops / 1e12 * 1e3:.1f} ms at {args.peak_tflops:.0f} TFLOP/s",
          flush=True)

    # Each stage adds one of the engine's changes to the tower's run (model/vision.py runs them all).
    stages = [("the model's own code (packed attention only)", ()),
              ("+ patch embedding as a GEMM", (convolutions_as_gemms,)),
              ("+ MLPs padded to an aligned width, act(gate) * up in one kernel", (convolutions_as_gemms, aligned_mlps)),
              ("+ the rotary embedding in one kernel", (convolutions_as_gemms, aligned_mlps, fused_vision_rotary)),
              ("+ the RMSNorms on the kernel", (convolutions_as_gemms, aligned_mlps, fused_vision_rotary,
                                                fused_tower_norms))]

    def run(count: int, stage: int = len(stages) - 1):
        with torch.inference_mode(), packed_vision_attention(model), contextlib.ExitStack() as stack:
            for block in stages[stage][1]:
                stack.enter_context(block(model))
            for start in range(0, args.images, count):
                model.get_image_features(pixels[start * per_image:(start + count) * per_image],
                                         grids[start:start + count])

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    cases = [(args.images, i) for i in range(len(stages) - 1)]
    cases += [(int(b), len(stages) - 1) for b in args.batches.split(",") if int(b) <= args.images]
    for count, stage in cases:
        run(count, stage)
        sync()
        times = []
        for _ in range(3):
            start = time.perf_counter()
            run(count, stage)
            sync()
            times.append(time.perf_counter() - start)
        print(f"{count:>3} images per call, {stages[stage][0]}: "
              f"{min(times) * 1e3:8.1f} ms for {args.images} ({flops / min(times) / 1e12:.0f} TFLOP/s)", flush=True)

    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    sync()
    start = time.perf_counter()
    with torch.profiler.profile(activities=activities) as prof:
        run(args.images, args.profile_stage)
        sync()
    wall = time.perf_counter() - start
    events = prof.key_averages()
    kernels = [e for e in events if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
    launched = sum(e.count for e in kernels)
    busy = sum(e.self_device_time_total for e in kernels) / 1e3
    print(f"profiled: wall {wall * 1e3:.1f} ms, {launched} kernels, GPU busy {busy:.1f} ms", flush=True)
    for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:14]:
        print(f"  gpu {e.self_device_time_total / 1e3:8.2f} ms x{e.count:<6} {e.key[:110]}")
    ops = [e for e in events if getattr(e, "device_type", None) != torch.autograd.DeviceType.CUDA]
    for e in sorted(ops, key=lambda e: -e.self_cpu_time_total)[:14]:
        print(f"  cpu {e.self_cpu_time_total / 1e3:8.2f} ms x{e.count:<6} {e.key[:110]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
