"""Decode attention when rows share their prompt's pages (GRPO-style groups, a common few-shot
prefix), timed on the GPU inside CUDA graphs with cold L2, beside the same step with every row on
pages of its own.

Why: with prefix caching the rows of a group point at the same physical pages for their shared
prompt. Whether the decode step then reads those pages once per group (the group's programs run
side by side and meet in L2) or once per row decides how far a group workload gains over caching
off. Three layouts of one step:
  distinct   every row's context on its own pages (caching off);
  adjacent   rows of a group next to each other in the batch, prefix pages shared (a GRPO batch);
  spread     the same sharing, the group's rows spread over the batch (requests arriving mixed);
  adjacent, read once per group: the adjacent layout with the engine's groups, the shared prefix
             read once per group (kernels/shared_prefix_attention.py).

    python benchmarks/shared_prefix_attention.py [--rows 256 --group 8 --prefix 1024 --own 64]
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch

from hf_async_cb.engine.shared_prefix_groups import shared_prefix_groups
from hf_async_cb.kernels import graph_timing
from hf_async_cb.kernels import shared_prefix_attention as shared_kernel
from hf_async_cb.kernels.attention_launch import choose_splits
from hf_async_cb.kernels.paged_attention import paged_attention_triton
from hf_async_cb.model.step_metadata import StepMetadata, block_table


def layouts(rows: int, group: int, prefix: int, own: int, page: int, seed: int = 0) -> dict[str, list[list[int]]]:
    """Each layout's page list per row (pages numbered in one pool of rows x pages-per-row)."""
    g = torch.Generator().manual_seed(seed)
    prefix_pages, own_pages = prefix // page, -(-own // page)
    per = prefix_pages + own_pages
    free = torch.randperm(rows * per, generator=g).tolist()  # scattered, as a used pool's are
    distinct = [free[r * per:(r + 1) * per] for r in range(rows)]
    groups = rows // group
    shared = [free[i * prefix_pages:(i + 1) * prefix_pages] for i in range(groups)]
    rest = free[groups * prefix_pages:]
    owned = [rest[r * own_pages:(r + 1) * own_pages] for r in range(rows)]
    adjacent = [shared[r // group] + owned[r] for r in range(rows)]
    spread = [shared[r % groups] + owned[r] for r in range(rows)]
    return {"distinct": distinct, "adjacent": adjacent, "spread": spread}


def step(page_lists: list[list[int]], lens: list[int], page: int) -> StepMetadata:
    """A decode step's metadata over these pages (each row's new token at its last slot)."""
    width = -(-max(lens) // 64) * 64 // page
    last = [p[(n - 1) // page] * page + (n - 1) % page for p, n in zip(page_lists, lens)]
    rows = len(lens)
    meta = StepMetadata(slot_mapping=torch.tensor(last, device="cuda"),
                        block_table=torch.from_numpy(block_table(page_lists, lens, page, width)).cuda(),
                        query_start=torch.arange(rows + 1, device="cuda"),
                        context_lens=torch.tensor(lens, device="cuda"), page_size=page, max_query_len=1,
                        max_context=width * page)
    return meta


def sweep(q, pools, new_kv, meta, copies) -> list[dict]:
    """The grouped step (`meta`, with its groups) at each prefix-kernel launch choice, fastest first."""
    found = []
    defaults = (shared_kernel.prefix_splits, shared_kernel.BLOCK_N, dict(shared_kernel.LAUNCH))
    try:
        for psplits, block_n, warps, stages in itertools.product((1, 2, 4, 8), (32, 64, 128), (4, 8), (2, 3)):
            shared_kernel.prefix_splits = lambda *args, n=psplits: n
            shared_kernel.BLOCK_N = block_n
            shared_kernel.LAUNCH.update(num_warps=warps, num_stages=stages)
            try:
                ms = graph_timing.graph_ms(lambda i: paged_attention_triton(q, *pools[i % copies], meta, None,
                                                                            new_kv=new_kv), calls=20)
            except Exception as error:  # noqa: BLE001 - a launch that does not compile or fit
                print(f"  skip psplits {psplits} block_n {block_n} warps {warps}: {type(error).__name__}")
                continue
            found.append(dict(us=round(ms * 1e3, 1), psplits=psplits, block_n=block_n, warps=warps, stages=stages))
    finally:
        shared_kernel.prefix_splits, shared_kernel.BLOCK_N = defaults[:2]
        shared_kernel.LAUNCH.clear()
        shared_kernel.LAUNCH.update(defaults[2])
    found.sort(key=lambda r: r["us"])
    for row in found[:8]:
        print("sweep", row, flush=True)
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--prefix", type=int, default=1024, help="shared tokens (a multiple of the page)")
    parser.add_argument("--own", type=int, default=64, help="each row's own tokens after the prefix")
    parser.add_argument("--shape", default="8b", choices=("8b", "1b"))
    parser.add_argument("--sweep", action="store_true",
                        help="also time the prefix kernel's splits, key block and warps on the grouped step")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    heads, kv_heads, head_dim = (32, 8, 128) if args.shape == "8b" else (32, 8, 64)
    page = 16
    g = torch.Generator().manual_seed(1)
    lens = [args.prefix + max(1, args.own - int(x)) for x in torch.randint(0, 16, (args.rows,), generator=g)]
    plans = layouts(args.rows, args.group, args.prefix, args.own, page)
    per = len(plans["distinct"][0])
    slots = args.rows * per * page
    token_bytes = 2 * kv_heads * head_dim * 2
    copies = graph_timing.cold_copies(slots * token_bytes)
    pools = [(torch.randn(slots, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16),
              torch.randn(slots, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)) for _ in range(copies)]
    q = torch.randn(1, heads, args.rows, head_dim, device="cuda", dtype=torch.bfloat16)
    new_kv = (torch.randn(1, kv_heads, args.rows, head_dim, device="cuda", dtype=torch.bfloat16),
              torch.randn(1, kv_heads, args.rows, head_dim, device="cuda", dtype=torch.bfloat16))
    results = {"rows": args.rows, "group": args.group, "prefix": args.prefix, "own": args.own, "shape": args.shape,
               "pool_copies": copies}
    plans["adjacent, read once per group"] = plans["adjacent"]
    for name, page_lists in plans.items():
        meta = step(page_lists, lens, page)
        if name.endswith("once per group"):  # the engine's groups (engine/shared_prefix_groups.py)
            table = meta.block_table.cpu().numpy()
            meta.group_start, meta.group_rows, meta.shared_len = (torch.from_numpy(a).cuda() for a in shared_prefix_groups(
                table, meta.context_lens.cpu().numpy(), args.rows, page)[:3])
        read = sum(lens) if name == "distinct" else (args.rows // args.group) * args.prefix + sum(lens) - \
            args.rows * args.prefix
        ms = graph_timing.graph_ms(lambda i: paged_attention_triton(q, *pools[i % copies], meta, None, new_kv=new_kv),
                                   calls=20)
        results[name] = {"us": round(ms * 1e3, 1), "splits": choose_splits(meta, kv_heads, q.device),
                         "every_row_GB_s": round(sum(lens) * token_bytes / ms / 1e6),
                         "distinct_bytes_GB_s": round(read * token_bytes / ms / 1e6)}
        print(name, results[name], flush=True)
    if args.sweep:
        results["sweep"] = sweep(q, pools, new_kv, meta, copies)
    print(json.dumps(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
