#!/usr/bin/env python
"""How many CUDA-graph buckets a serving workload's prefill and mixed steps fall into, with prefix
caching on and off (a CPU run of the tiny shape; the keys computed as DecodeGraphs.key_for computes
them on CUDA, none captured).

    PYTHONPATH=. python benchmarks/serving_graph_keys.py [--requests 96 --rate 16 --system-prompt 1024]

Why: on the H200, serving with a shared 1024-token system prompt ran 22 eager steps with caching
against 3 without, and its TTFT p90 was 2.4x worse (docs/benchmarks.md, 2026-12-03 fourth session).
A graph bucket is (batch, context, tokens, tall); only 16 prefill buckets are captured (and the
serving benchmark freezes them after its warm-up), so a workload whose steps spread over more
buckets runs the rest eagerly, or, since then, replays a larger captured bucket that holds the step
(DecodeGraphs._padded_into_captured). The warm-up's steps are counted too; the batch composition depends
on the CPU's pace, so the counts indicate, not measure.
"""

from __future__ import annotations

import argparse
import collections

from hf_async_cb.engine import scheduler as scheduler_module
from hf_async_cb.engine.cuda_graphs import DecodeGraphs
from hf_async_cb.tools import serving
from hf_async_cb.tools.bench import SHAPES


def _capped_run(steps, evict_after: int) -> tuple[int, int, int]:
    """(eager steps, steps padded up, places changed) of `steps` with 16 prefill buckets captured as they
    come (as DecodeGraphs.step does), and a place changing hands after `evict_after` eager steps (0: never)."""
    graphs = DecodeGraphs(runner=None, max_batch=256, is_cuda=False, prefill=True, tall_query_len=64,
                          max_prefill_graphs=16)
    graphs.evict_after = evict_after
    eager = 0
    for plan in steps:
        key = graphs.key_for(plan)
        if key is None:
            eager += 1
        elif key not in graphs:
            graphs._graphs[key] = None
            graphs.num_prefill_graphs += key.tokens > 0
        elif key.tokens:
            graphs._replays[key] += 1
    return eager, graphs.num_padded_up, graphs.num_evicted


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=96)
    p.add_argument("--rate", type=float, default=16.0)
    p.add_argument("--system-prompt", type=int, default=1024)
    p.add_argument("--lengths", default="sharegpt")
    args = p.parse_args(argv)
    SHAPES["tiny"]["max_position_embeddings"] = 4096  # room for the system prompt and ShareGPT's longest
    steps: list[tuple] = []
    schedule = scheduler_module.Scheduler.schedule

    def recording(self):
        plan = schedule(self)
        if not plan.is_empty and not all(c.num_tokens == 1 for c in plan.chunks):
            steps.append(plan)
        return plan

    scheduler_module.Scheduler.schedule = recording
    for path in ("async", "async-nocache"):
        steps.clear()
        serving.run("tiny", args.requests, rate=args.rate, lengths=args.lengths, paths=(path,), device="cpu",
                    system_prompt=args.system_prompt, warmup="short")
        uncapped = DecodeGraphs(runner=None, max_batch=256, is_cuda=False, prefill=True, tall_query_len=64,
                                max_prefill_graphs=10**9)
        keys = [k for k in map(uncapped.key_for, steps) if k is not None]
        eager, padded, evicted = {}, {}, {}
        for evict_after in (0, 8):
            eager[evict_after], padded[evict_after], evicted[evict_after] = _capped_run(steps, evict_after)
        print(f"{path}: {len(steps)} prefill/mixed steps, {len(steps) - len(keys)} over the graphs' token limit, "
              f"{len(collections.Counter(keys))} buckets; capped at 16: {padded[0]} steps padded up "
              f"into a captured bucket, {eager[0]} eager; with places changing hands after 8 eager steps "
              f"(PREFILL_EVICT_AFTER_MISSES): {evicted[8]} changes, {padded[8]} padded up, {eager[8]} eager", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
