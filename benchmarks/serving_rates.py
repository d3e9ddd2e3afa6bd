#!/usr/bin/env python
"""TTFT and ITL of the sync and async loops across arrival rates, in one process (the model built once).

    PYTHONPATH=. python benchmarks/serving_rates.py --json serving_rates.json  # 1B shape, CUDA: 4/16/32/64 req/s
    PYTHONPATH=. python benchmarks/serving_rates.py --device cpu --shape tiny --lengths uniform --rates 8,32 --seconds 1

Per rate, rate x --seconds requests (at least --min-requests) with ShareGPT-like lengths arrive as a
Poisson process, through our sync and async loops (each warmed up as `bench --serve` does:
tools/serving.py), and at --peer-rate through transformers' own continuous batching as well
(hf-cb-sync, after ours, within --peer-limit seconds: past it, its row says how far it got). Each
run's table is printed as it is done, then a summary with a line per rate and loop: TTFT p50/p99, ITL
p50/p99/mean, E2E p50, requests/s, and from the timed run the graphs captured, the eager steps and
the steps from a request's submission to its first token (p50/p99). Runs left when --budget
seconds have passed are skipped, and said so.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch

from hf_async_cb.config import BatchingConfig
from hf_async_cb.engine import cuda_graphs, graph_keys, late_admission
from hf_async_cb.tools import bench, serving


def _ms(value) -> str:
    return "-" if value is None else f"{value:.1f}"


def _eager(extra: dict) -> str:
    """The run's eager steps, with why where counted (DecodeGraphs.eager): "45 (prefill_cap 30, too_large 15)"."""
    total = extra.get("eager_steps_in_run")
    if total is None:
        return "-"
    why = sorted(((n, k[len("eager_"):]) for k, n in extra.items() if k.startswith("eager_")
                  and k != "eager_steps_in_run" and n), reverse=True)
    return f"{total} ({', '.join(f'{k} {n}' for n, k in why)})" if why else str(total)


def summary_lines(reports: list[dict]) -> list[str]:
    lines = ["| req/s offered | path | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | ITL mean | E2E p50 s | req/s | "
             "captures | eager steps | 1st-token steps p50/p99 | TTFT to build / after, p50 | note |", "|---" * 14 + "|"]
    for report in reports:
        for r in report["results"]:
            extra = r.get("extra", {})
            steps = extra.get("first_token_steps") or {}
            first = "-" if not steps else f"{steps['p50']:.0f}/{steps['p99']:.0f}"
            split = extra.get("ttft_split_ms")
            split = "-" if not split else f"{split['to_build']['p50']:.1f} / {split['after_build']['p50']:.1f}"
            e2e = r["e2e_s"]["p50"]
            lines.append(" | ".join([
                f"| {report['rate']:g}", r["path"], _ms(r["ttft_ms"]["p50"]), _ms(r["ttft_ms"]["p99"]),
                _ms(r["itl_ms"]["p50"]), _ms(r["itl_ms"]["p99"]), _ms(r["itl_ms"]["mean"]),
                "-" if e2e is None else f"{e2e:.3f}",
                "-" if r["request_throughput"] is None else f"{r['request_throughput']:.1f}",
                str(extra.get("graphs_captured_in_run", "-")), _eager(extra), first, split,
                (r.get("note") or "") + " |"]))
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llama3.2-1b")
    p.add_argument("--device", default=None)
    p.add_argument("--rates", default="4,16,32,64", help="requests/s, comma-separated")
    p.add_argument("--seconds", type=float, default=5.0, help="arrivals span about this long at every rate")
    p.add_argument("--min-requests", type=int, default=24)
    p.add_argument("--lengths", default="sharegpt", choices=serving.LENGTHS)
    p.add_argument("--prompt", type=int, default=128, help="with fixed or uniform lengths")
    p.add_argument("--new", type=int, default=256, help="with fixed or uniform lengths")
    p.add_argument("--peer-rate", type=float, default=4.0, help="the rate transformers' batching runs at too (0: none)")
    p.add_argument("--peer-limit", type=float, default=75.0, help="seconds for its warm-up and timed run")
    p.add_argument("--budget", type=float, default=380.0, help="start no run after this many seconds")
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="our paths' BatchingConfig.cuda_graphs (default: on CUDA; on the CPU, the same keys eagerly)")
    p.add_argument("--paths", default="sync,async", help="our loops at every rate (e.g. sync,async,async-early: "
                   "bench's path names)")
    p.add_argument("--prefill-context-steps", default=None,
                   help="A/B of graph_keys.PREFILL_CONTEXT_STEP: our paths run once per value, e.g. 2,1")
    p.add_argument("--evict-after", default=None,
                   help="A/B of cuda_graphs.PREFILL_EVICT_AFTER_MISSES: our paths run once per value, e.g. 8,0 "
                        "(with --prefill-context-steps: every pair)")
    p.add_argument("--arrivals-end-wait", default=None,
                   help="A/B of late_admission.ARRIVALS_END_THE_WAIT (1: an arrival ends the async loop's wait and "
                        "the step is built at once, the earlier rule; 0: the build is held, the default), e.g. 0,1")
    p.add_argument("--late-min-share", default=None,
                   help="A/B of the async loop's margin floor (late_admission's HF_ASYNC_CB_LATE_MIN_SHARE: the least "
                        "share of a step kept for its build), e.g. 0.25,0.1")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    bench.check_paths(args.paths.split(","))

    started = time.perf_counter()
    device = torch.device(args.device) if args.device else bench.default_device()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = bench.build_model(args.shape, device, dtype)
    steps = [int(s) for s in args.prefill_context_steps.split(",")] if args.prefill_context_steps else [None]
    evictions = [int(e) for e in args.evict_after.split(",")] if args.evict_after else [None]
    cuts = [bool(int(c)) for c in args.arrivals_end_wait.split(",")] if args.arrivals_end_wait else [None]
    shares = [float(m) for m in args.late_min_share.split(",")] if args.late_min_share else [None]
    runs = [(float(r), tuple(args.paths.split(",")), (s, e, c, m)) for r in args.rates.split(",") for s in steps
            for e in evictions for c in cuts for m in shares]
    if args.peer_rate:  # last: ours come first within the budget
        paths, notes = serving.runnable_paths(("hf-cb-sync",), device)
        print(*notes, sep="\n")
        runs += [(args.peer_rate, paths, (None, None, None, None))] if paths else []
    reports, skipped = [], []
    default_step, default_evict = graph_keys.PREFILL_CONTEXT_STEP, cuda_graphs.PREFILL_EVICT_AFTER_MISSES
    default_cut = late_admission.ARRIVALS_END_THE_WAIT
    default_share = os.environ.get(late_admission.MIN_SHARE_VARIABLE)
    for rate, paths, (step, evict, cut, share) in runs:
        if time.perf_counter() - started > args.budget:
            skipped.append(f"{'/'.join(paths)} at {rate:g} req/s")
            continue
        requests = max(args.min_requests, math.ceil(rate * args.seconds))
        config = BatchingConfig(max_running_requests=requests, cuda_graphs=args.cuda_graphs)
        graph_keys.PREFILL_CONTEXT_STEP = default_step if step is None else step
        cuda_graphs.PREFILL_EVICT_AFTER_MISSES = default_evict if evict is None else evict
        late_admission.ARRIVALS_END_THE_WAIT = default_cut if cut is None else cut
        if share is not None:  # read where each loop's StepCadence is made
            os.environ[late_admission.MIN_SHARE_VARIABLE] = str(share)
        elif default_share is None:
            os.environ.pop(late_admission.MIN_SHARE_VARIABLE, None)
        else:
            os.environ[late_admission.MIN_SHARE_VARIABLE] = default_share
        report = serving.run(args.shape, requests, rate, args.lengths, args.prompt, args.new, paths, device, dtype,
                             config, model=model, peer_limit_s=args.peer_limit)
        report["elapsed_s"] = time.perf_counter() - started
        setting = "; ".join(f"{name} {value}" for name, value in (
            ("prefill context step", step), ("evict after", evict), ("arrivals end the wait", cut),
            ("late min share", share)) if value is not None)
        if setting:
            report["setting"] = setting
            for r in report["results"]:
                r["note"] = setting + (f"; {r['note']}" if r.get("note") else "")
        reports.append(report)
        print(serving.format_table(report))
        for r in report["results"]:  # the buckets its eager prefill steps missed, and those it had
            missed = r.get("extra", {}).get("missed_buckets")
            if missed:
                print(f"{r['path']}: eager steps' buckets {missed}; captured {r['extra']['captured_prefill_buckets']}")
        print(f"(done after {report['elapsed_s']:.0f} s)\n", flush=True)
        if args.json:  # after every run: a run cut short by an outer timeout keeps the ones before
            with open(args.json, "w") as f:
                json.dump({"reports": reports, "skipped": skipped}, f, indent=1)
    print("\n".join(summary_lines(reports)))
    if skipped:
        print(f"skipped (past the {args.budget:g} s budget): {', '.join(skipped)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"reports": reports, "skipped": skipped}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
