"""Every Triton compile a user's first generate() calls trigger: kernel, constexprs, seconds.

    TRITON_CACHE_DIR=$(mktemp -d) python benchmarks/gpu_compile_census.py --shape llama3.2-1b --json out.json

In one fresh process: the issue's sequence of first calls (64 x 128 -> 256 sampled; then 7 rows
sampled; then 64 rows greedy), each call's wall time, and every kernel compile inside it with its
specialisation (which constexpr made it a variant of its own). Run it with an empty
TRITON_CACHE_DIR for the cold figures and again with the same folder for the warm ones.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from triton.runtime.jit import JITFunction

import hf_async_cb
from hf_async_cb.devices import synchronize
from hf_async_cb.tools.bench import SAMPLING, _prompts, build_model
from hf_async_cb.tools.phases import PHASE_SECONDS, PHASE_SPANS, time_phases, timeline

COMPILES: list[dict] = []
_original = JITFunction._do_compile


def _timed_compile(self, key, signature, device, constexprs, options, attrs, warmup):
    start = time.perf_counter()
    try:
        return _original(self, key, signature, device, constexprs, options, attrs, warmup)
    finally:
        COMPILES.append(dict(kernel=self.fn.__module__.rsplit(".", 1)[-1] + "." + self.fn.__name__,
                             constexprs={str(k): str(v) for k, v in constexprs.items()},
                             seconds=round(time.perf_counter() - start, 3),
                             key=str(key)))  # the JIT's specialisation key: compare with the precompiled ones


JITFunction._do_compile = _timed_compile

def cache_entries(folder: str) -> dict[str, list[dict]]:
    """Triton's disk cache, per kernel: each compiled entry's folder and metadata (what differs
    between two entries of one kernel with the same constexprs is why a load missed a compile)."""
    import glob
    import os

    found: dict[str, list[dict]] = {}
    for path in glob.glob(os.path.join(folder, "*", "*.json")):
        if os.path.basename(path).startswith("__grp__"):
            continue
        try:
            with open(path) as f:
                meta = json.load(f)
        except Exception:  # noqa: BLE001 (a diagnostic)
            continue
        name = meta.get("name") or os.path.basename(path)[:-5]
        found.setdefault(name, []).append(dict(folder=os.path.basename(os.path.dirname(path)), **{
            k: v for k, v in meta.items() if isinstance(v, (int, float, str, bool, type(None))) or k in (
                "target", "constants", "signature")}))
    return found


def _differences(entries: list[dict]) -> dict:
    """The metadata fields whose values differ between a kernel's cache entries."""
    keys = set().union(*(e.keys() for e in entries)) - {"folder", "hash"}
    return {k: [str(e.get(k))[:200] for e in entries] for k in sorted(keys)
            if len({json.dumps(e.get(k), sort_keys=True, default=str) for e in entries}) > 1}


def _graph_counts(model) -> tuple[int, int]:
    """(graphs captured, greedy steps lent a sampled graph) so far by the model's runtime engine."""
    graphs = getattr(getattr(runtime_of(model), "engine", None), "graphs", None)
    return (graphs.num_captured, graphs.num_lent) if graphs is not None else (0, 0)


def _precompiled_keys(ahead) -> dict[str, list[str]]:
    """The JIT keys of the variants compiled ahead, per kernel: a compile in a call whose key is not
    among them is a variant the list missed (or a launch specialised otherwise)."""
    from hf_async_cb.kernels.variant import variant_key

    keys: dict[str, list[str]] = {}
    for variant in ahead.variants:
        try:
            keys.setdefault(variant.name, []).append(variant_key(variant))
        except Exception as e:  # noqa: BLE001 (a diagnostic)
            keys.setdefault(variant.name, []).append(f"(no key: {type(e).__name__})")
    return keys


def runtime_of(model):
    from hf_async_cb.generate import runtime

    return runtime._RUNTIMES.get(model)


def call(model, n, prompt, new, sample):
    ids = torch.tensor(_prompts(n, prompt, model.config.vocab_size), device=model.device)
    decoding = dict(SAMPLING) if sample else dict(do_sample=False)
    synchronize(model.device)
    start = time.perf_counter()
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, batching="async",
                   batching_config=hf_async_cb.BatchingConfig(seed=0), pad_token_id=0, **decoding)
    synchronize(model.device)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama3.2-1b")
    parser.add_argument("--calls", default="64:128:256:s,7:128:256:s,64:128:256:g,48:300:64:g",
                        help="rows:prompt:new:(s)ampled|(g)reedy, comma-separated")
    parser.add_argument("--json")
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of the script (the interpreter compiles nothing)")
    parser.add_argument("--sample", action="store_true",
                        help="sample the first two calls' stacks (benchmarks/wall_sampler.py) and print their phases' timeline")
    args = parser.parse_args()
    time_phases()
    t0 = time.perf_counter()
    model = build_model(args.shape, torch.device(args.device), torch.bfloat16 if args.device == "cuda" else torch.float32)
    report = dict(shape=args.shape, build_s=round(time.perf_counter() - t0, 2), calls=[])
    for spec in args.calls.split(","):
        n, prompt, new, kind = spec.split(":")
        before = len(COMPILES)
        graphs_before = _graph_counts(model)
        PHASE_SECONDS.clear()
        PHASE_SPANS.clear()
        sampler = None
        started = time.perf_counter()
        if args.sample and len(report["calls"]) < 2:  # the first call and the first later one
            import sys

            sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
            from wall_sampler import WallSampler

            with WallSampler() as sampler:
                seconds = call(model, int(n), int(prompt), int(new), kind == "s")
        else:
            seconds = call(model, int(n), int(prompt), int(new), kind == "s")
        new_compiles = COMPILES[before:]
        captured, lent = (a - b for a, b in zip(_graph_counts(model), graphs_before))
        report["calls"].append(dict(call=spec, seconds=round(seconds, 3), compiles=new_compiles,
                                    compile_s=round(sum(c["seconds"] for c in new_compiles), 2),
                                    captured=captured, lent=lent,
                                    phases={k: round(v, 3) for k, v in PHASE_SECONDS.items()}))
        print(f"{spec:<16} {seconds:8.2f} s, {len(new_compiles)} compiles "
              f"({sum(c['seconds'] for c in new_compiles):.1f} s), {captured} graphs captured, "
              f"{lent} greedy steps on sampled graphs", flush=True)
        for c in new_compiles:
            print(f"   {c['seconds']:6.2f} s  {c['kernel']:<40} {c['constexprs']}", flush=True)
        if PHASE_SECONDS:
            print("   phases: " + ", ".join(f"{k} {v:.2f} s" for k, v in PHASE_SECONDS.items()), flush=True)
        if sampler is not None:
            report["calls"][-1]["timeline"] = timeline(started)
            print("   timeline (s after the call's start):", flush=True)
            for label, a, b in timeline(started):
                print(f"     {a:7.3f} - {b:7.3f}  {label}", flush=True)
            report["calls"][-1]["sampled"] = sampler.report()
            print(sampler.report(), flush=True)
        ahead = getattr(getattr(runtime_of(model), "engine", None), "_precompile", None)
        if ahead is not None and "precompile" not in report:  # kernels/precompile.py, at the runtime's build
            report["precompile"] = ahead.summary()
            report["precompiled_keys"] = _precompiled_keys(ahead)
            print(f"   compiled ahead: {report['precompile']}", flush=True)
    from triton import knobs

    folder = os.environ.get("TRITON_CACHE_DIR") or knobs.cache.dir
    entries = cache_entries(folder)
    report["cache_duplicates"] = {name: dict(entries=len(found), differ=_differences(found))
                                  for name, found in entries.items() if len(found) > 1}
    for name, dup in report["cache_duplicates"].items():
        print(f"   cache: {name} has {dup['entries']} entries; differing fields: {dup['differ']}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
