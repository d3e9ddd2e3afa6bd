"""The model side: how a transformers model runs on the engine's paged cache.

    kv_cache.py            PagedKVCache, a transformers Cache over the page pool
    attention.py           our AttentionInterface entry: dispatch to the reference or Triton kernel
    step_metadata.py       what every attention layer of one step needs to know about the batch
    checks.py              which models run, and the reason for those that cannot
    fusion.py              q/k/v and gate/up projections as one GEMM each, reversibly
    elementwise_fusion.py  RMSNorm, rotary and SiLU-mul swapped for the Triton kernels, reversibly
"""
