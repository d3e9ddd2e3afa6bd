"""`cache_implementation`: options that only choose stock's memory layout run, the rest are refused.

Stock generate picks its K/V cache from GenerationConfig.cache_implementation (set on the call, on
a GenerationConfig passed in, or on model.generation_config). Some options only choose how stock
lays out the same keys and values in memory: a cache that grows ("dynamic"), one allocated up
front ("static"; "sliding_window", "hybrid" and "hybrid_chunked" are its older names, which keep
sliding-window layers to their window), and "paged" on a GenerationConfig (where stock's generate
takes it as a dynamic cache). Attention reads the same keys and values from any of them, so
greedy tokens are the same, and the engine's paged pool is one more layout of them: with batching
on, these options run and the pool replaces stock's layout. (`generate(cache_implementation="paged")`
as an argument is another thing: stock hands the call to transformers' own continuous batching,
which reads the padding as prompt tokens and answers in another shape; with batching on, that
is refused as asking for two engines at once.)

The others change what attention reads or where the cache lives, which the engine does not do:
"quantized" stores the cache in fewer bits (quanto or HQQ integers with per-group scales, or
fp8), and stock's tokens are those of the rounded keys and values; "offloaded", "offloaded_static",
"offloaded_hybrid" and "offloaded_hybrid_chunked" keep it in CPU memory and bring each layer's
back as it runs, a placement asked for to save accelerator memory. They are refused by name, with
the reason, before any work, as is any option this module does not know (transformers 5.17 to
5.24 have these eleven; a new one may change the numerics).
"""

from __future__ import annotations

LAYOUT_ONLY = ("dynamic", "static", "sliding_window", "hybrid", "hybrid_chunked", "paged")

_QUANTIZED = ("stores the K/V cache quantized ({detail}) and stock's tokens are those of the rounded keys and "
              "values, while the engine keeps them in the model's dtype: its tokens would differ")
_OFFLOADED = ("keeps the K/V cache in CPU memory and brings each layer's back as it runs, while the engine keeps "
              "its paged pool on the model's device (sized to the pages in use, see BatchingConfig."
              "kv_memory_fraction): the placement asked for would be ignored")
REFUSED = {
    "quantized": _QUANTIZED,
    "offloaded": _OFFLOADED,
    "offloaded_static": _OFFLOADED,
    "offloaded_hybrid": _OFFLOADED,
    "offloaded_hybrid_chunked": _OFFLOADED,
}


def _quantized_detail(gc) -> str:
    config = getattr(gc, "cache_config", None) or {}
    get = config.get if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
    nbits = get("nbits", None)
    return f"backend {get('backend', 'quanto')!r}" + (f", {nbits} bits" if nbits else "")


def check_cache_implementation(gc, mode: str, call_kwargs: dict) -> None:
    """Raise ValueError naming the option when `gc.cache_implementation` is one the engine does not
    reproduce (see the module docstring); layout-only options and None pass. `call_kwargs`: the
    generate call's own keyword arguments."""
    if call_kwargs.get("cache_implementation") == "paged":
        raise ValueError(f"generate(batching={mode!r}, cache_implementation='paged'): that argument switches stock "
                         "generate to transformers' own continuous batching (generate_batch), and batching= to this "
                         "engine: choose one (drop cache_implementation, or use batching='off').")
    option = getattr(gc, "cache_implementation", None)
    if option is None or option in LAYOUT_ONLY:
        return
    reason = REFUSED.get(option)
    if reason is None:
        raise ValueError(f"generate(batching={mode!r}) does not know cache_implementation={option!r}: it runs the "
                         f"options that only choose stock's memory layout ({', '.join(LAYOUT_ONLY)}). Drop it or use "
                         "batching='off'.")
    raise ValueError(f"generate(batching={mode!r}) does not run cache_implementation={option!r}: it "
                     f"{reason.format(detail=_quantized_detail(gc))}. Drop it or use batching='off'.")
