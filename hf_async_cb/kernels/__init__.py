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
    graph_timing.py               how the tuners time kernels: replayed from a CUDA graph

Kernels never take a per-call count (rows, tokens, requests) as a specialised value: such
arguments are `do_not_specialize`, and constexprs derived from them are powers of two from a short
list, so a process compiles each kernel a bounded number of times and never again after warm-up
(tests/test_gpu.py counts them with compiled_variants()).
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
