"""Compile every kernel variant a model can need at its engine's build: at once, in parallel worker
processes, while the build goes on; then no call compiles.

Why: compiled one at a time as steps first meet them, a 1B model's variants took 29.5 s of its
first sampled call on a fresh H200 (stock generate: 19 s for the whole job), and a later call with a
new batch size could compile for 20 s mid-run. The variants follow from the model and the engine
(kernels/model_variants.py), so the build starts compiling them all in forked workers
(kernels/compile_workers.py, into Triton's disk cache), and a background thread then loads each one
into the JIT's in-process cache (milliseconds each), so that no step of any later call compiles or
even reads the disk. Engine.__init__ waits for it before the first kernel runs (the parity check).

Timeline of an engine's build on CUDA:

    main thread    : pool, scheduler, graphs ... | wait | decode GEMM tuning, parity check, steps
    precompile     : list variants, fork workers --compile in parallel-- load each into the JIT
    workers (N-1)  :                 compile, compile, ...   (exit)

On the CPU (Triton's interpreter) nothing is compiled, so nothing is done. HF_ASYNC_CB_COMPILE_WORKERS
sets the number of workers, or with 0 turns compiling ahead off (A/B runs).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time

import torch

from hf_async_cb.kernels.compile_workers import Compiled, compile_in_workers, default_workers
from hf_async_cb.kernels.variant import Variant, settle_cache_keys

logger = logging.getLogger(__name__)
_ONE_AT_A_TIME = threading.Lock()
_LOAD_IS_A_COMPILE = 0.3  # seconds: a load from the disk cache takes milliseconds, a compile far longer
# Compile workers: unset for one per core but one; a number for that many; 0 for none (compile
# as steps need them, as before: for A/B runs).
WORKERS_VARIABLE = "HF_ASYNC_CB_COMPILE_WORKERS"


class Precompile:
    """Variants being compiled in workers and loaded, on a background thread; `wait()` joins it.
    Failures are logged, never raised: a variant that does not build raises where it is launched."""

    def __init__(self, variants: list[Variant], device: torch.device, what: str = "the model",
                 workers: int | None = None) -> None:
        from triton.runtime.driver import driver

        self.what = what
        self.device = device
        self.variants = variants
        self.workers = min(len(variants), workers or default_workers())
        self.compiled: list[Compiled] = []
        self.loaded = 0
        self.failed: list[str] = []
        self.compiled_on_load: list[str] = []  # variants the workers compiled but this process compiled again
        self.seconds = 0.0
        with _on(device):
            self._target = driver.active.get_current_target()
        settle_cache_keys({id(v.kernel): v.kernel for v in variants}.values())  # before any launch can key them
        self._thread = threading.Thread(target=self._run, name="hf_async_cb-precompile", daemon=True)
        self._started = time.perf_counter()
        self._thread.start()

    def _run(self) -> None:
        try:
            with _ONE_AT_A_TIME:  # engines built together (one per GPU) share the disk cache: the later finds it full
                missing = _not_loaded(self.variants, self.device)
                if missing:
                    self.compiled = compile_in_workers(missing, self._target, self.workers)
                    self.failed += [f"{c.name} ({c.described}) in a worker: {c.error}" for c in self.compiled if c.error]
            with _on(self.device):
                for variant in missing:
                    try:
                        start = time.perf_counter()
                        variant.warmup()  # from the disk cache the workers filled
                        self.loaded += 1
                        if time.perf_counter() - start > _LOAD_IS_A_COMPILE:  # the workers' entry was not found
                            self.compiled_on_load.append(f"{variant.name} ({variant.describe()}): "
                                                         f"{time.perf_counter() - start:.2f} s")
                    except Exception as e:  # noqa: BLE001 (it raises again where the step launches it)
                        self.failed.append(f"{variant.name} ({variant.describe()}): {type(e).__name__}")
        except Exception:  # noqa: BLE001 (the steps compile what is missing, as without precompiling)
            logger.exception("hf_async_cb: compiling the kernels ahead failed; steps compile them as they need them")
        finally:
            self.seconds = time.perf_counter() - self._started

    def wait(self) -> "Precompile":
        """Block until every variant is compiled and loaded (or failed); say so once if it was slow."""
        self._thread.join()
        if self.compiled:
            logger.info("hf_async_cb: %s", self.summary())
        note_slow_preparation(self.what, self.seconds, f"compiling its kernels: {self.summary()}")
        return self

    def summary(self) -> str:
        """One line: how many variants, compiled in how many workers, how long."""
        work = sum(c.seconds for c in self.compiled)
        text = (f"{len(self.compiled)} of {len(self.variants)} kernel variants compiled on {self.workers} workers "
                f"in {self.seconds:.1f} s ({work:.1f} s of compiling)")
        if self.failed:
            text += f"; {len(self.failed)} failed: {', '.join(self.failed[:3])}"
        if self.compiled_on_load:
            text += f"; {len(self.compiled_on_load)} compiled again on loading: {', '.join(self.compiled_on_load[:3])}"
        return text


def precompile(engine, model: torch.nn.Module) -> Precompile | None:
    """Start compiling every kernel variant `model` can need on `engine`, which Engine._build calls
    once its pool and attention backend exist (CUDA only; None elsewhere: the interpreter compiles
    nothing). The engine waits for it before its first kernel runs."""
    if engine.device.type != "cuda" or os.environ.get(WORKERS_VARIABLE, "").strip() == "0":
        return None
    try:
        import triton  # noqa: F401
    except ImportError:
        return None
    from hf_async_cb.kernels.model_variants import facts_of, model_variants

    try:
        variants = model_variants(facts_of(engine, model))
    except Exception:  # noqa: BLE001 (facts not as expected: this model's steps compile as they go, as before)
        logger.warning("hf_async_cb: could not compile %s's kernels ahead; its first steps will compile them",
                       type(model).__name__, exc_info=True)
        return None
    logger.info("hf_async_cb: compiling up to %d kernel variants ahead, in worker processes", len(variants))
    return precompile_variants(variants, engine.device, f"{type(model).__name__} on {engine.device}")


def precompile_variants(variants: list[Variant], device: torch.device, what: str) -> Precompile | None:
    """Start compiling `variants` ahead in workers (as precompile() does for an engine's), or None
    where nothing is compiled ahead (off CUDA, no Triton, HF_ASYNC_CB_COMPILE_WORKERS=0, nothing
    listed). precompile() uses it for an engine's variants, the model's preparation for the kernels
    its own checks run."""
    workers = os.environ.get(WORKERS_VARIABLE, "").strip()
    if not variants or device.type != "cuda" or workers == "0":
        return None
    try:
        return Precompile(variants, device, what, int(workers) if workers else None)
    except Exception:  # noqa: BLE001 (the checks compile as they run, as before)
        logger.warning("hf_async_cb: could not compile %s's kernels ahead", what, exc_info=True)
        return None


def _not_loaded(variants: list[Variant], device: torch.device) -> list[Variant]:
    """The variants not yet in their kernel's in-process JIT cache on `device` (a later engine of the
    same model finds them all there). Asked through Triton's cache hook, which sees exactly the
    launches that would compile; it answers only for this thread, so that other threads' launches
    compile as usual meanwhile."""
    from triton import knobs

    me = threading.get_ident()
    saved = knobs.runtime.jit_cache_hook
    missing: list[Variant] = []
    asked: list[bool] = []

    def hook(**kwargs):
        if threading.get_ident() != me:
            return saved(**kwargs) if saved is not None else None
        asked.append(True)
        return True  # not compiled here: the workers do it

    knobs.runtime.jit_cache_hook = hook
    try:
        with _on(device):
            for variant in variants:
                asked.clear()
                variant.warmup()
                if asked:
                    missing.append(variant)
    finally:
        knobs.runtime.jit_cache_hook = saved
    return missing


def _on(device: torch.device):
    """`device` as the current CUDA device (where the JIT files what it loads); nothing elsewhere."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


_NOTED: set[str] = set()


def note_slow_preparation(what: str, seconds: float, details: str = "") -> None:
    """Say once per process, when it took more than a second, what a first call prepared and for how
    long (a user waiting seconds should know why, and that later calls will not)."""
    if seconds <= 1.0 or what in _NOTED:
        return
    _NOTED.add(what)
    logger.warning("hf_async_cb: first use of %s took %.1f s%s; later calls reuse it", what, seconds,
                   f" ({details})" if details else "")
