"""Shared-prefix workloads: what prefix caching saves, side by side with every other path.

    python -m hf_async_cb.tools.shared_prefix --shape llama3.2-1b --workloads group,few-shot,none

Workloads (rows are separate requests, as an RL trainer or an eval harness sends them):
    group     32 prompts of 1024 tokens, each repeated as 8 consecutive rows (GRPO's groups) -> 128 new
    few-shot  256 rows: one 2048-token prefix (the shots) + 64 tokens of their own -> 64 new
    none      256 distinct prompts of 512 tokens -> 256 new: the cost of caching when nothing hits
Paths, in one process on one model: stock generate, transformers' continuous batching (its block
sharing on, as it ships), and ours through model.generate(batching="async") with prefix caching off
and on (not in the defaults: `cache-on-per-row`, on with every decode row reading its shared prefix
itself, the attention before prefix groups were read once; `cache-on-recompute`, on with a row whose
whole prompt is cached computing its last page again instead of copying it). Ours first runs the same workload on other tokens (kernels, graphs: the first-call cost,
reported beside), so the timed call reuses only what it shares within itself; `second_call_s` is
the same call again, which also reuses what the first one cached.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import torch

from hf_async_cb.tools.timing import timed

WORKLOADS = {
    "group": dict(groups=32, rows=8, prefix=1024, own=0, new=128),
    "few-shot": dict(groups=1, rows=256, prefix=2048, own=64, new=64),
    "none": dict(groups=256, rows=1, prefix=0, own=512, new=256),
}
PATHS = ("stock", "hf-cb-sync", "cache-off", "cache-on")
# Not in the defaults: caching on, each decode row reading its shared prefix itself (the attention
# before kernels/shared_prefix_attention.py): an A/B of reading a group's prefix once.
PER_ROW = "cache-on-per-row"
RECOMPUTE = "cache-on-recompute"  # on, a row whose whole prompt is cached computing its last page again


def workload_prompts(kind: str, vocab: int, seed: int = 1, scale: float = 1.0) -> tuple[list[list[int]], int]:
    """The workload's prompts (rectangular: every row of one length) and new tokens per row;
    `scale` shrinks every count and length (CPU smoke runs)."""
    w = {k: max(1, int(v * scale)) if v else 0 for k, v in WORKLOADS[kind].items()}
    g = torch.Generator().manual_seed(seed)
    prompts = []
    for _ in range(w["groups"]):
        prefix = torch.randint(3, vocab, (w["prefix"],), generator=g).tolist()
        for _ in range(w["rows"]):
            prompts.append(prefix + torch.randint(3, vocab, (w["own"],), generator=g).tolist())
    return prompts, w["new"]


def run_ours(model, prompts, warm_prompts, new: int, caching: bool, more_prompts=()) -> dict:
    """model.generate(batching="async"): a first call on `warm_prompts`, the timed call, the same again;
    then one call on each of `more_prompts` (unseen prompts of the same workload): `seconds` is the
    median of the timed call and these (calls of the same shapes vary by up to 30% with caching on)."""
    import statistics

    import hf_async_cb

    device = model.device
    config = hf_async_cb.BatchingConfig(prefix_caching=caching, seed=0)

    def call(rows):
        ids = torch.tensor(rows, device=device)
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                              batching="async", batching_config=config, eos_token_id=None, pad_token_id=0)

    first_s, _ = timed(lambda: call(warm_prompts), device)
    before = hf_async_cb.prefix_cache_stats(model) or {}
    seconds, out = timed(lambda: call(prompts), device)
    stats = hf_async_cb.prefix_cache_stats(model) or {}
    second_s, _ = timed(lambda: call(prompts), device)
    calls = [seconds] + [timed(lambda rows=rows: call(rows), device)[0] for rows in more_prompts]
    hf_async_cb.release(model)
    hits, prefilled, copied, grouped, once = (stats.get(k, 0) - before.get(k, 0) for k in (
        "hit_tokens", "prefilled_tokens", "copied_pages", "grouped_decode_steps", "keys_read_once"))
    return dict(seconds=statistics.median(calls), calls_s=[round(s, 4) for s in calls], first_call_s=first_s,
                second_call_s=second_s, hit_tokens=hits, prefilled_tokens=prefilled, copied_pages=copied,
                grouped_decode_steps=grouped, keys_read_once=once,
                tokens=out[:, len(prompts[0]):].tolist())


def run(shape: str, kinds, paths=PATHS, device=None, scale: float = 1.0, calls: int = 3) -> dict:
    from hf_async_cb.tools import bench

    device = torch.device(device) if device is not None else bench.default_device()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = bench.build_model(shape, device, dtype)
    vocab = model.config.vocab_size
    bandwidth = bench.copy_bandwidth(device)
    report = dict(shape=shape, device=str(device), dtype=str(dtype),
                  gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                  bandwidth_tb_s=bandwidth / 1e12 if bandwidth else None, workloads={})
    for kind in kinds:
        prompts, new = workload_prompts(kind, vocab, seed=1, scale=scale)
        warm, _ = workload_prompts(kind, vocab, seed=2, scale=scale)
        more = [workload_prompts(kind, vocab, seed=3 + i, scale=scale)[0] for i in range(calls - 1)]
        rows: dict[str, dict] = {}
        floor = (bench.floor_ms_per_step(model, len(prompts), len(prompts[0]), new, bandwidth) * new / 1e3
                 if bandwidth else None)
        for path in paths:
            if path == PER_ROW:
                from hf_async_cb.engine import shared_prefix_groups

                saved = shared_prefix_groups.MIN_SAVED_FRACTION
                shared_prefix_groups.MIN_SAVED_FRACTION = float("inf")  # no step is worth grouping
                try:
                    result = run_ours(model, prompts, warm, new, caching=True, more_prompts=more)
                finally:
                    shared_prefix_groups.MIN_SAVED_FRACTION = saved
            elif path == RECOMPUTE:
                from hf_async_cb.engine import scheduler

                scheduler.COPY_CACHED_LAST_PAGE = False
                try:
                    result = run_ours(model, prompts, warm, new, caching=True, more_prompts=more)
                finally:
                    scheduler.COPY_CACHED_LAST_PAGE = True
            elif path.startswith("cache-"):
                result = run_ours(model, prompts, warm, new, caching=path == "cache-on", more_prompts=more)
            else:
                bench.run_path(path, model, prompts[:2], 2, phase="warm-up")
                r = bench.run_path(path, model, prompts, new)
                result = dict(seconds=r.seconds)
            result["tokens_per_s"] = len(prompts) * new / result["seconds"]
            rows[path] = result
            print(f"[shared-prefix] {kind:<8} {path:<10} {result['seconds']:8.3f} s "
                  f"{result['tokens_per_s']:10,.0f} tok/s" + "".join(
                      f"  {k} {result[k]:.3f}" if isinstance(result[k], float) else f"  {k} {result[k]}"
                      for k in ("calls_s", "first_call_s", "second_call_s", "hit_tokens", "prefilled_tokens",
                                "copied_pages", "grouped_decode_steps") if k in result),
                  flush=True)
        if "cache-on" in rows and "cache-off" in rows:
            on, off = rows["cache-on"].pop("tokens"), rows["cache-off"].pop("tokens")
            rows["cache-on"]["same_tokens_as_off"] = sum(a == b for a, b in zip(on, off)) / len(on)
            rows["cache-on"]["speedup_vs_off"] = rows["cache-off"]["seconds"] / rows["cache-on"]["seconds"]
        for r in rows.values():
            r.pop("tokens", None)
        report["workloads"][kind] = dict(requests=len(prompts), prompt=len(prompts[0]), new=new, floor_s=floor,
                                         paths=rows)
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama3.2-1b")
    parser.add_argument("--workloads", default="group,few-shot,none")
    parser.add_argument("--paths", default=",".join(PATHS))
    parser.add_argument("--scale", type=float, default=1.0, help="shrink every count and length (CPU smoke runs)")
    parser.add_argument("--calls", type=int, default=3,
                        help="ours: timed calls on unseen prompts, the median reported (each one beside)")
    parser.add_argument("--device")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    kinds = args.workloads.split(",")
    unknown = [k for k in kinds if k not in WORKLOADS]
    if unknown:
        parser.error(f"unknown workloads {unknown}; choose from {list(WORKLOADS)}")
    report = run(args.shape, kinds, tuple(args.paths.split(",")), args.device, args.scale, max(1, args.calls))
    for kind, w in report["workloads"].items():
        on = w["paths"].get("cache-on", {})
        if "speedup_vs_off" in on:
            print(f"[shared-prefix] {kind}: caching on is {on['speedup_vs_off']:.2f}x caching off, "
                  f"{on['same_tokens_as_off']:.0%} of rows token-equal", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
