"""How many K/V pages an engine's pool gets: what the device has free, less what a step needs besides.

On CUDA the pool takes `kv_memory_fraction` of the memory free on the device once torch's allocator
has handed back the blocks it caches unused, but never the bound on a step's own transient memory
(activation_bytes): a pool that left too little would fail the first wide step with an out-of-memory
error. Cached blocks are handed back rather than counted as free because not all of them can hold a
pool layer: a closed engine's CUDA graphs leave their private pools cached, which only their graphs
could reuse, and a 1 GiB layer does not fit in the free ends of partly used segments. Counting them
failed a second engine's build on an 80 GB card with 6 GiB "reserved but unallocated". On the CPU
the pool is `cpu_kv_cache_bytes`. `num_pages` set in the config wins over both.
"""

from __future__ import annotations

import gc
import logging

import torch

from hf_async_cb.config import BatchingConfig
from hf_async_cb.model.kv_cache import PagedKVCache, pools_alive

logger = logging.getLogger(__name__)


def activation_bytes(config: BatchingConfig, model_config, dtype: torch.dtype, vocab_size: int) -> int:
    """A bound on a step's transient memory beyond the KV pool: the widest step's hidden states,
    projections and MLP activations (a few live at once), and logits at every sampled row (in
    the model dtype, in fp32, and the sampler's fp32 working copies), doubled for the CUDA-graph
    pool and the allocator's fragmentation."""
    hidden = model_config.hidden_size
    inter = getattr(model_config, "intermediate_size", None) or getattr(model_config, "n_inner", None) or 4 * hidden
    item = torch.finfo(dtype).bits // 8
    per_token = (6 * hidden + 4 * inter) * item
    rows = min(config.max_running_requests, config.max_batch_tokens)
    logits = rows * vocab_size * (item + 3 * 4)
    return 2 * (config.max_batch_tokens * per_token + logits)


def pool_pages(config: BatchingConfig, layout, dtype: torch.dtype, device: torch.device, model_config,
               vocab_size: int, freed_bytes: int = 0) -> int:
    """The pool's pages for a model of this K/V `layout` (model/kv_layout.py) and text config.
    `freed_bytes`: device memory counted free besides what is (a pool a rebuild would drop first):
    then nothing is logged, it is a bound, not a build."""
    if config.num_pages is not None:
        return config.num_pages
    bytes_per_page = layout.bytes_per_token(dtype) * config.page_size
    if device.type == "cuda":
        if pools_alive():  # a dropped engine's pool may still wait in a reference cycle of the caller's
            gc.collect()  # (a tenth of a second or more with transformers loaded: not on a first build)
        torch.cuda.empty_cache()  # what the allocator caches unused becomes free device memory (docstring)
        free = torch.cuda.mem_get_info(device)[0] + freed_bytes
        reserve = activation_bytes(config, model_config, dtype, vocab_size)
        budget = max(0, min(int(free * config.kv_memory_fraction), free - reserve))
        if not freed_bytes:
            logger.info("hf_async_cb: KV pool of %.1f GiB (%.1f GiB free, %.1f GiB kept for activations and "
                        "logits)", budget / 2**30, free / 2**30, reserve / 2**30)
    else:
        budget = config.cpu_kv_cache_bytes
    num_pages = budget // bytes_per_page
    if num_pages < 1:
        raise ValueError(
            f"no room for a single KV page ({bytes_per_page} bytes): give the pool more memory "
            "(BatchingConfig.kv_memory_fraction / cpu_kv_cache_bytes) or set num_pages."
        )
    return num_pages


def allocate_pool(layout, num_pages: int, page_size: int, dtype: torch.dtype, device: torch.device) -> PagedKVCache:
    """The KV pool: `num_pages` pages and one more, the trash page that CUDA-graph padding rows use. A
    size past torch's integers or the host allocator's refusal is a ValueError naming the fields to
    change; a GPU's out-of-memory error (which the caller explains) and any other error pass on."""
    try:
        return PagedKVCache(layout, num_pages + 1, page_size, dtype, device)
    except (RuntimeError, TypeError, OverflowError, MemoryError) as error:
        too_big = isinstance(error, (TypeError, OverflowError, MemoryError)) or "alloc" in str(error).lower()
        if isinstance(error, torch.OutOfMemoryError) or not too_big:
            raise
        size = (num_pages + 1) * page_size * layout.bytes_per_token(dtype)
        raise ValueError(f"the KV pool of {num_pages} pages of {page_size} tokens ({size / 2**30:.1f} GiB) cannot be "
                         f"allocated on {device} ({type(error).__name__}: {str(error).splitlines()[0][:120]}): "
                         "give BatchingConfig fewer pages (num_pages, cpu_kv_cache_bytes, "
                         "kv_memory_fraction).") from error
