"""A/B of the paged attention's launch choices inside the engine, one process, one model: each
variant patches the kernel wrapper's choices, then runs the same workload on a held Engine (async,
CUDA graphs; bench.run_path: a warm-up call, then the timed one). Microbenchmarks time the kernel
alone; this times what a user's decode steps and prefill chunks get.

    python benchmarks/ab_attention.py --shape llama3-8b --requests 32 --prompt 7168 --new 96 \
        --variants now,decode-old-launch,decode-old-splits
"""

from __future__ import annotations

import argparse
import contextlib

import torch

from hf_async_cb.kernels import attention_launch as launch
from hf_async_cb.kernels import paged_attention as pa
from hf_async_cb.model.kv_cache import PagedKVCache
from hf_async_cb.tools.bench import _prompts, build_model, run_path

_defaults, _splits = launch.launch_defaults, launch.choose_splits


def _old_decode_launch(head_dim, dtype, head_dim_v=None, block_m=16, decode=False):
    """The decode launch before the cold-L2 sweep: the prefill shapes, no early loads."""
    return _defaults(head_dim, dtype, head_dim_v, block_m, decode=False)


def _heads_first(head_dim, dtype, head_dim_v=None, block_m=16, decode=False):
    """Today's launch with the grid's KV heads first: a request's heads read its pool rows together."""
    return {**_defaults(head_dim, dtype, head_dim_v, block_m, decode), "heads_first": True}


def _old_splits(meta, num_kv_heads, device):
    """Splits only while there are fewer (request, KV head) programs than SMs."""
    if not meta.is_decode:
        return 1
    wanted = -(-(launch.num_sms(device) or 1) // (meta.num_requests * num_kv_heads))
    splits = min(wanted, max(1, meta.max_context // 256), 16)
    return 1 << (splits.bit_length() - 1) if splits > 1 else 1


PATCHES = {
    "now": {},
    "decode-old-launch": {"pa.launch_defaults": _old_decode_launch},
    "decode-old-splits": {"pa.choose_splits": _old_splits},
    "decode-old-both": {"pa.launch_defaults": _old_decode_launch, "pa.choose_splits": _old_splits},
    "heads-first": {"pa.launch_defaults": _heads_first},
    "head-major-pools": {"PagedKVCache.HEAD_MAJOR": True},
    "prefill-16rows": {"launch.TALL_TILE_QUERY_LEN": 1 << 30},
    "prefill-128rows": {"launch.TALL_TILE_ROWS": 128},
}


def _target(name: str):
    """(object, attribute) of a patch's name: "pa." the attention wrapper's module (the names it
    calls), "launch." the launch choices' module (their constants), or the KV cache class."""
    owner, attr = name.split(".", 1)
    return {"pa": pa, "launch": launch, "PagedKVCache": PagedKVCache}[owner], attr


@contextlib.contextmanager
def patched(names: dict):
    saved = {k: getattr(*_target(k)) for k in names}
    for k, v in names.items():
        setattr(*_target(k), v)
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(*_target(k), v)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="llama3-8b")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt", type=int, default=7168)
    p.add_argument("--new", type=int, default=96)
    p.add_argument("--variants", default="now,decode-old-launch,decode-old-splits")
    args = p.parse_args()
    device = torch.device("cuda")
    model = build_model(args.shape, device, torch.bfloat16)
    prompts = _prompts(args.requests, args.prompt, model.config.vocab_size)
    print(f"{args.shape}, {args.requests} x {args.prompt} -> {args.new}, async, held Engine")
    print("| variant | s | decode ms/step | first call s |\n|---|---|---|---|")
    for name in args.variants.split(","):
        with patched(PATCHES[name]):
            r = run_path("async", model, prompts, args.new)
        print(f"| {name} | {r.seconds:.2f} | {r.decode_ms_per_step:.2f} | {r.extra['warmup_s']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
