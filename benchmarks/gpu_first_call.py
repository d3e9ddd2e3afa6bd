"""The first generate() call of a fresh process, with an empty Triton cache and then a warm one.

    python benchmarks/gpu_first_call.py --shape llama3.2-1b [--calls 64:128:256:s,7:128:256:s]

Runs benchmarks/gpu_compile_census.py twice, each in a fresh process, sharing one new
TRITON_CACHE_DIR (and HF_ASYNC_CB_CACHE): the first meets empty caches (what a new machine,
container or CI job meets), the second finds everything the first compiled and checked. Prints each call's wall time in both, the kernel
variants compiled in each call (loads from the disk cache count, at their milliseconds), and what
the runtime compiled ahead (kernels/precompile.py). The issue's targets: 1B, 64 x 128 -> 256 sampled,
first call <= 8 s cold and <= 1.5 s warm; later calls with a new batch size compile nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama3.2-1b")
    parser.add_argument("--calls", default="64:128:256:s,7:128:256:s,64:128:256:g")
    parser.add_argument("--json")
    parser.add_argument("--sample", action="store_true", help="sample each first call's stack and print its timeline")
    parser.add_argument("--warm-with", default="", metavar="VAR=VALUE,...",
                        help="after the warm run, one more warm process per setting, each with that variable set "
                             "(an A/B in one run, e.g. HF_ASYNC_CB_LOAD_AHEAD=0,HF_ASYNC_CB_LOAD_AHEAD=1)")
    args = parser.parse_args()
    census = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_compile_census.py")
    cache = tempfile.mkdtemp(prefix="triton-first-call-")
    # (parity passes kept on disk, engine/parity_store.py: in the same fresh folder, so "cold" is a new machine)
    env = dict(os.environ, TRITON_CACHE_DIR=cache, HF_ASYNC_CB_CACHE=os.path.join(cache, "hf_async_cb"))
    env.pop("TRITON_INTERPRET", None)
    report = {}
    runs = {"cold": {}, "warm": {}}
    for setting in filter(None, args.warm_with.split(",")):
        name, value = setting.split("=", 1)
        runs[f"warm {setting}"] = {name: value}
    for i, (run, extra) in enumerate(runs.items()):
        out = os.path.join(cache, f"run{i}.json")
        print(f"--- {run} Triton cache ({cache})", flush=True)
        subprocess.run([sys.executable, census, "--shape", args.shape, "--calls", args.calls, "--json", out]
                       + ["--sample"] * args.sample,
                       env={**env, **extra}, check=True)
        with open(out) as f:
            report[run] = json.load(f)
    print()
    for run in runs:
        calls = report[run]["calls"]
        print(f"{run}: model built in {report[run]['build_s']:.1f} s; first call {calls[0]['seconds']:.2f} s "
              f"({len(calls[0]['compiles'])} variants, {calls[0]['compile_s']:.1f} s in the JIT); later calls: "
              + ", ".join(f"{c['call']} {c['seconds']:.2f} s / {len(c['compiles'])} compiles" for c in calls[1:]))
        if report[run].get("precompile"):
            print(f"    compiled ahead: {report[run]['precompile']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
