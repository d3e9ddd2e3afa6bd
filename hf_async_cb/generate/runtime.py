"""The runtime a model's generate(batching=...) calls share, kept between calls.

A call used to build an Engine: fuse the model, size a pool, capture CUDA graphs (and compile
kernels for shapes not seen before), then give everything back. The runtime keeps all of it for
the next call on the same model:

- the preparation (model/prepared.py): checked and fused once; between calls the model is stock,
  its weights views of the fused tensors;
- the engine: its KV pool, scheduler, graphs (captured lazily, per bucket) and kernels.

It is held in a WeakKeyDictionary keyed by the model and holds the model only weakly, so it dies
with the model. It is rebuilt when what it depends on changes: the parameters (identity, storage,
dtype, device), the config, or the structural fields of the BatchingConfig (all but mode, seed,
progress and profile, which are per call). `release(model)` frees it at once.

Memory: the pool grows on demand, to the next power of two of the pages a call needs (so at most
twice what the largest call needed, and a loop of growing calls regrows it a few times, not every
call), capped by the memory budget (BatchingConfig.kv_memory_fraction of what is free on CUDA,
cpu_kv_cache_bytes on the CPU). A held Engine sizes its pool from that budget at once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import threading
import time
import weakref
from typing import Iterator

import torch

from hf_async_cb.config import BatchingConfig
from hf_async_cb.engine.engine import Engine
from hf_async_cb.engine.parity import probe_pages
from hf_async_cb.model.model_guard import model_guard
from hf_async_cb.model.prepared import PreparedModel
from hf_async_cb.engine.graph_keys import pow2

logger = logging.getLogger(__name__)

_PER_CALL_FIELDS = dict(mode="async", seed=None, progress=False, profile=False)
_RUNTIMES: "weakref.WeakKeyDictionary[torch.nn.Module, ModelRuntime]" = weakref.WeakKeyDictionary()
_RUNTIMES_LOCK = threading.Lock()


def _structure(config: BatchingConfig) -> BatchingConfig:
    """The config without its per-call fields: what the runtime is built from."""
    return dataclasses.replace(config, **_PER_CALL_FIELDS)


class ModelRuntime:
    """One model's preparation and engine, reused by its generate calls (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, config: BatchingConfig) -> None:
        self._started = time.perf_counter()  # (the first engine's build says how long it all took)
        self.structure = _structure(config)
        self.prepared = PreparedModel(model, config.trust_untested_model, config.fuse_projections,
                                      config.fuse_elementwise, config.skinny_gemm, engine_config=self.structure)
        self.engine: Engine | None = None
        self._page_cap = 0  # the pages the engine was asked for (it may have got fewer: memory)
        self.calls = 0
        self.builds = 0

    def fits(self, model: torch.nn.Module, config: BatchingConfig) -> bool:
        return _structure(config) == self.structure and self.prepared.matches(model)

    def check_row_fits(self, row_tokens: int) -> None:
        """Refuse a row holding more KV tokens (`row_tokens`: the longest row's
        Request.max_total_tokens) than the largest pool could, as the engine would, without a
        rebuild (it would drop the pool, its cached prefixes and the CUDA graphs for nothing): the
        pool itself where it already holds all its memory allows (it got fewer pages than it asked
        for), else the pool a rebuild could get with this one's memory freed."""
        engine = self.engine
        if engine is None:
            return
        given = self.structure.num_pages is not None
        if engine.num_pages < self._page_cap:
            engine.scheduler.check_fits_tokens(row_tokens, num_pages_given=given)
        elif row_tokens > engine.num_pages * engine.config.page_size:  # the pool would grow
            engine.scheduler.check_fits_tokens(row_tokens, num_pages_given=given, num_pages=engine.largest_pool_pages())

    def engine_for(self, model: torch.nn.Module, config: BatchingConfig, pages_needed: int) -> Engine:
        """The engine, its pool grown first if this call needs more pages than it has."""
        engine = self.engine
        grow = engine is not None and engine.num_pages < pages_needed and engine.num_pages == self._page_cap
        if engine is None or grow:
            cap = max(pow2(max(pages_needed, probe_pages(self.structure.page_size))), 2 * self._page_cap)
            if engine is not None:
                engine.close()  # the pool and graphs go; the preparation stays
                self.engine = None
                _free_device_memory(self.prepared.device)
            self.engine = Engine(model, self.structure, max_pages_needed=cap, prepared=self.prepared)
            self._page_cap = cap
            self.builds += 1
            if self.builds == 1:
                self.engine.note_first_use(time.perf_counter() - self._started)
            logger.info("hf_async_cb runtime for %s: %s", type(model).__name__, self.describe())
        self.engine.config = config.for_device(self.engine.device)
        self.calls += 1
        return self.engine

    def describe(self) -> str:
        """What the runtime holds, in one line."""
        engine = self.engine
        if engine is None:
            return "no engine"
        graphs = engine.graphs.num_captured if engine.graphs is not None else 0
        stats = engine.prefix_cache_stats()
        cached = ("prefix caching off" if stats is None else
                  f"{stats['cached_pages']} pages of cached prefixes ({stats['hit_tokens']} tokens hit, "
                  f"{stats['prefilled_tokens']} prefilled)")
        return (f"{engine.num_pages} KV pages of {engine.config.page_size} tokens "
                f"({engine.cache.bytes / 2**20:.1f} MiB) on {engine.device}, {graphs} CUDA graphs, {cached}, "
                f"{self.calls} calls, {self.builds} builds")

    def close(self) -> None:
        """Drop the engine (pool, graphs) and the preparation; the model stays stock, untouched."""
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        self.prepared.forget()


@contextlib.contextmanager
def runtime_engine(model: torch.nn.Module, config: BatchingConfig, pages_needed: int,
                   row_tokens: int = 0) -> Iterator[Engine]:
    """The model's engine for one generate call; the caller holds the model's guard for the whole call
    (`model_guard(model).held("generate", kind="outer")`, as engine_generate does)."""
    runtime = _RUNTIMES.get(model)
    if runtime is not None and not runtime.fits(model, config):
        logger.info("hf_async_cb: the model or BatchingConfig changed since the last call; rebuilding its runtime")
        runtime.close()
        runtime = None
        with _RUNTIMES_LOCK:
            _RUNTIMES.pop(model, None)
    if runtime is None:
        runtime = ModelRuntime(model, config)  # raises with the model as it was found
        with _RUNTIMES_LOCK:
            _RUNTIMES[model] = runtime
    runtime.check_row_fits(row_tokens)  # (refused, the runtime kept as it is)
    try:
        engine = runtime.engine_for(model, config, pages_needed)
    except BaseException:
        runtime.close()
        with _RUNTIMES_LOCK:
            _RUNTIMES.pop(model, None)
        raise
    yield engine


def release(model: torch.nn.Module) -> bool:
    """Free the model's generate runtime (KV pool, CUDA graphs, fused weights) now; for a wrapper whose
    generate runs on a model inside it (a PEFT model's base model), that one's. Returns whether there
    was one. The next generate(batching=...) call builds it again."""
    released = False
    for holder in _holders(model, "release"):
        guard = model_guard(holder, create=False)
        if guard is None:
            continue
        with guard.held("release", kind="outer"):  # (the engine's close() holds it again, inside)
            with _RUNTIMES_LOCK:
                runtime = _RUNTIMES.pop(holder, None)
            if runtime is None:
                continue
            device = runtime.prepared.device
            runtime.close()
        _free_device_memory(device)
        released = True
    return released


def clear_prefix_cache(model: torch.nn.Module) -> bool:
    """Forget the prefixes the model's generate runtime cached (e.g. after writing its weights
    through `.data`, which the runtime cannot see); a wrapper's, as release() finds it. Returns
    whether it had a runtime."""
    cleared = False
    for holder in _holders(model, "clear_prefix_cache"):
        guard = model_guard(holder, create=False)
        if guard is None:
            continue
        with guard.held("clear_prefix_cache"):
            runtime = _RUNTIMES.get(holder)
            if runtime is None or runtime.engine is None:
                continue
            runtime.engine.clear_prefix_cache()
            cleared = True
    return cleared


def prefix_cache_stats(model: torch.nn.Module) -> dict | None:
    """The counters of the model's generate runtime's prefix cache (Engine.prefix_cache_stats; a
    wrapper's, as release() finds it), or None without a runtime or with prefix caching off."""
    runtime = next((_RUNTIMES.get(h) for h in _holders(model, "prefix_cache_stats")), None)
    return None if runtime is None or runtime.engine is None else runtime.engine.prefix_cache_stats()


def runtime_info(model: torch.nn.Module) -> str | None:
    """What the model's generate runtime holds (pool, graphs, calls; a wrapper's, as release() finds
    it), or None if it has none."""
    runtime = next((_RUNTIMES.get(h) for h in _holders(model, "runtime_info")), None)
    return None if runtime is None else runtime.describe()


def _holders(model, name: str) -> list[torch.nn.Module]:
    """The modules whose generate runtime `model` names: itself if generate ran on it, else those
    inside it that generate ran on (a wrapper's generate, as PEFT's, calls its base model's)."""
    _check_module(model, name)
    if model in _RUNTIMES:
        return [model]
    return [m for m in model.modules() if m is not model and m in _RUNTIMES]


def _check_module(model, name: str) -> None:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"hf_async_cb.{name}() takes the model generate() ran on (a torch.nn.Module), "
                        f"got {type(model).__name__}.")


def _free_device_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


__all__ = ["ModelRuntime", "PreparedModel", "clear_prefix_cache", "prefix_cache_stats", "release", "runtime_engine",
           "runtime_info"]
