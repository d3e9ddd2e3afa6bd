"""What a later generate() call with a new batch size pays for its graph captures, and whether the
eager warm-up before each capture can go once the capture stream has had one (issue 29: a later call
<= 50 ms over the same call warm).

    python benchmarks/gpu_capture_cost.py --shape llama3.2-1b

Two copies of one model (same weights), each with its own runtime, run the same calls: a first call
of 64 rows, then for each new batch size a call and the same call again. Copy A warms every capture
up (an eager run of the step first: cuda_graphs.WARM_UP_EVERY_CAPTURE); copy B as the engine does,
only a thread's first capture (a later one that fails is retried with it). Per call: wall time,
graphs captured, the warm-up's and the recording's seconds (tools/phases.py), captures retried, and
whether B's tokens equal A's (both sampled from per-call seeds, so equal graphs give equal tokens).
"""

from __future__ import annotations

import argparse
import copy
import json
import time

import torch

import hf_async_cb
from hf_async_cb.devices import synchronize
from hf_async_cb.engine import cuda_graphs
from hf_async_cb.generate import runtime
from hf_async_cb.tools.bench import SAMPLING, _prompts, build_model
from hf_async_cb.tools.phases import PHASE_SECONDS, time_phases


def _call(model, n, prompt, new, sample):
    ids = torch.tensor(_prompts(n, prompt, model.config.vocab_size), device=model.device)
    decoding = dict(SAMPLING) if sample else dict(do_sample=False)
    graphs = getattr(getattr(runtime._RUNTIMES.get(model), "engine", None), "graphs", None)
    before = graphs.num_captured if graphs is not None else 0
    PHASE_SECONDS.clear()
    synchronize(model.device)
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, batching="async",
                         batching_config=hf_async_cb.BatchingConfig(seed=0), pad_token_id=0, **decoding)
    synchronize(model.device)
    seconds = time.perf_counter() - start
    graphs = runtime._RUNTIMES[model].engine.graphs
    return out.cpu(), dict(seconds=round(seconds, 4), captured=graphs.num_captured - before if graphs else 0,
                           failed=len(graphs.failed) if graphs else 0,
                           retried=graphs.num_warm_up_retries if graphs else 0,
                           warm_up_s=round(PHASE_SECONDS.get("CapturedGraph._warm_up", 0.0), 4),
                           record_s=round(PHASE_SECONDS.get("CapturedGraph._record", 0.0), 4))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama3.2-1b")
    parser.add_argument("--sizes", default="7,3,13,24,40", help="the later calls' batch sizes")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of the script (nothing is captured)")
    parser.add_argument("--json")
    args = parser.parse_args()
    time_phases()
    first = build_model(args.shape, torch.device(args.device),
                        torch.bfloat16 if args.device == "cuda" else torch.float32)
    second = copy.deepcopy(first)
    calls = [(64, 256, True)] + [(int(n), args.new, n_i % 2 == 0) for n_i, n in enumerate(args.sizes.split(","))]
    rows = []
    tokens = {}
    for label, model in (("A: warm-up before each capture", first), ("B: warm-up only before the first", second)):
        cuda_graphs.WARM_UP_EVERY_CAPTURE = label.startswith("A")
        for n, new, sample in calls:
            for again in (False, True):
                out, row = _call(model, n, args.prompt, new, sample)
                key = (n, new, sample, again)
                if label.startswith("B"):
                    row["tokens_equal_A"] = bool(torch.equal(out, tokens[key]))
                tokens[key] = out
                row.update(copy=label[0], call=f"{n}x{args.prompt}->{new} {'sampled' if sample else 'greedy'}"
                           + (" again" if again else ""))
                rows.append(row)
                print(json.dumps(row), flush=True)
    cuda_graphs.WARM_UP_EVERY_CAPTURE = False
    print()
    print("| copy | call | s | graphs captured | warm-up s | recording s | retried (total) | tokens equal A |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['copy']} | {r['call']} | {r['seconds']:.3f} | {r['captured']} | {r['warm_up_s']:.3f} | "
              f"{r['record_s']:.3f} | {r['retried']} | {r.get('tokens_equal_A', '')} |")
    for c in "AB":
        own = [r for r in rows if r["copy"] == c]
        gaps = [a["seconds"] - b["seconds"] for a, b in zip(own[2::2], own[3::2])]
        print(f"{c}: later calls over the same call again: " + ", ".join(f"{1e3 * g:+.0f} ms" for g in gaps))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
