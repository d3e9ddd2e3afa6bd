"""Triton kernels, each tested against its torch reference.

    paged_attention.py            decode and chunked-prefill attention over the page pool
    paged_attention_reference.py  its pure-torch reference (and the CPU path)
    store_kv.py                   a step's new K/V into their page slots (reference: index_copy_)
    elementwise.py                RMSNorm, rotary, SiLU-mul (reference: the model's own modules)
    draw_greedy.py                greedy picks + log-probs in one pass (reference: sampling/sampler.py)
    draw_sampled.py               filtered, seeded sampling without a sort (reference: sampling/sampler.py)
    sampling_threshold.py         its threshold search (the kept scores' edge), spread over the GPU
    skinny_gemm.py                x @ weight.T for decode's few rows, and the measured choice against
                                  cuBLAS (reference: F.linear; model/decode_gemm.py routes to it)
    skinny_gemm_forms.py          its quantized weight forms (int8, HQQ 4-bit, quanto 8-bit): tile
                                  rebuilds and the WeightForm record that names one
    graph_timing.py               how the tuners time kernels: replayed from a CUDA graph
    variant.py                    a kernel variant named without running it (and the JIT's key for it)
    model_variants.py             every variant a model's runs can launch, from facts of its engine
    compile_workers.py            variants compiled in forked worker processes, into Triton's disk cache
    precompile.py                 all of them compiled at an engine's build, ahead of any step

Kernels never take a per-call count (rows, tokens, requests, splits, parts) as a specialised value:
such arguments are `do_not_specialize` (strides of the model's tensors too, with an ALIGNED flag
for their loads), and constexprs derived from them come from short lists (rows per program,
tile heights), so the variants a model needs are known at its engine's build, compiled there at
once (precompile.py), and never again (tests/test_gpu.py and tests/test_first_use.py count them
with compiled_variants()). Nothing is unrolled at compile time beyond a few lanes' worth: a
compile takes well under a second on the H200's host.
"""


def compiled_variants() -> int:
    """How many compiled variants of the package's Triton kernels this process holds (0 without
    Triton): a count that must stop growing once every bucket has been seen."""
    return sum(len(keys) for keys in compiled_keys().values())


def compiled_keys() -> dict[str, list[str]]:
    """Each kernel's compiled variants, by their specialisation keys (to see what compiled anew)."""
    import importlib

    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        return {}
    keys: dict[str, list[str]] = {}
    seen: set[int] = set()  # helpers imported into another kernel module count once
    for name in ("paged_attention", "store_kv", "elementwise", "draw_greedy", "sampling_threshold", "draw_sampled",
                 "skinny_gemm"):
        module = importlib.import_module(f"hf_async_cb.kernels.{name}")
        for attr, fn in vars(module).items():
            if isinstance(fn, JITFunction) and id(fn) not in seen:
                seen.add(id(fn))
                keys[f"{name}.{attr}"] = [str(k) for cache in fn.device_caches.values() for k in cache[0]]
    return keys
