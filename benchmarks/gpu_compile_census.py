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
import time

import torch
from triton.runtime.jit import JITFunction

import hf_async_cb
from hf_async_cb.tools.bench import SAMPLING, _prompts, build_model

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
    ids = torch.tensor(_prompts(n, prompt, model.config.vocab_size), device="cuda")
    decoding = dict(SAMPLING) if sample else dict(do_sample=False)
    torch.cuda.synchronize()
    start = time.perf_counter()
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, batching="async",
                   batching_config=hf_async_cb.BatchingConfig(seed=0), pad_token_id=0, **decoding)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama3.2-1b")
    parser.add_argument("--calls", default="64:128:256:s,7:128:256:s,64:128:256:g,48:300:64:g",
                        help="rows:prompt:new:(s)ampled|(g)reedy, comma-separated")
    parser.add_argument("--json")
    args = parser.parse_args()
    t0 = time.perf_counter()
    model = build_model(args.shape, torch.device("cuda"), torch.bfloat16)
    report = dict(shape=args.shape, build_s=round(time.perf_counter() - t0, 2), calls=[])
    for spec in args.calls.split(","):
        n, prompt, new, kind = spec.split(":")
        before = len(COMPILES)
        seconds = call(model, int(n), int(prompt), int(new), kind == "s")
        new_compiles = COMPILES[before:]
        report["calls"].append(dict(call=spec, seconds=round(seconds, 3), compiles=new_compiles,
                                    compile_s=round(sum(c["seconds"] for c in new_compiles), 2)))
        print(f"{spec:<16} {seconds:8.2f} s, {len(new_compiles)} compiles "
              f"({sum(c['seconds'] for c in new_compiles):.1f} s)", flush=True)
        for c in new_compiles:
            print(f"   {c['seconds']:6.2f} s  {c['kernel']:<40} {c['constexprs']}", flush=True)
        ahead = getattr(getattr(runtime_of(model), "engine", None), "_precompile", None)
        if ahead is not None and "precompile" not in report:  # kernels/precompile.py, at the runtime's build
            report["precompile"] = ahead.summary()
            report["precompiled_keys"] = _precompiled_keys(ahead)
            print(f"   compiled ahead: {report['precompile']}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
