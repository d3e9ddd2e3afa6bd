"""Compile kernel variants in parallel worker processes, filling Triton's disk cache.

Why processes: a Triton compile is mostly single-threaded Python and LLVM (and ptxas, a process of
its own), so variants compiled one after another in the serving process cost their sum; workers
cost the longest chain instead, as torch inductor's compile workers do for its kernels. What a
worker compiles lands in Triton's disk cache (TRITON_CACHE_DIR, or ~/.triton/cache), where the
serving process's JIT then finds it: loading a compiled variant takes milliseconds.

Workers are forked from the serving process, so they start at once, with every module already
imported (a fresh interpreter would import torch and transformers first: seconds on a slow host).
A forked child must not touch CUDA; it does not: the JIT compiles for the target it is given
(variant.TargetDriver), which a compile needs and nothing else. Each variant is compiled through
the kernel's own JIT (Variant.warmup), under the very cache key the serving process will look up.

Forks are taken one thread at a time (two precompiles may start their workers at once), and a fork
that raises is tried again: filelock (imported with transformers) hooks every fork and refuses one
while another thread's fork or lock is between states; that refusal had made a whole precompile fail.

A fork copies the locks other threads hold at that moment, held, into the child: a worker forked while
another thread was inside the compiler can wait forever on a lock nobody in it will release (a cold
H100 machine's first call hung so, for minutes). So no fork is taken while a precompile of this
process loads (or compiles) a variant itself (`no_fork`), and the workers are watched: where none
has finished a variant for STALL_SECONDS, they are stopped and this process compiles what is left
as it loads it (slower, never a hang).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
import time
import warnings
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass

from hf_async_cb.kernels.variant import Variant, from_pickled, settle_cache_keys

logger = logging.getLogger(__name__)

_FORKING = threading.Lock()  # (one thread forks its workers at a time; none while `no_fork` is held)
FORK_ATTEMPTS = 6  # a refused fork is tried again after 10, 30, 90, 270 and 810 ms
# Seconds the workers may go without finishing a variant (the longest compile takes a few seconds);
# HF_ASYNC_CB_COMPILE_STALL_S sets it.
STALL_SECONDS = float(os.environ.get("HF_ASYNC_CB_COMPILE_STALL_S", "60"))


def no_fork():
    """Held while this process compiles or loads a variant in a thread of its own: no worker is forked
    meanwhile (a fork then would copy the compiler's held locks into the child)."""
    return _FORKING


@dataclass
class Compiled:
    """One variant's compile in a worker: its name, the values that make it a variant, seconds, and
    the error if it failed (the serving process then meets that error where it launches it)."""

    name: str
    described: str
    seconds: float
    error: str | None = None


def default_workers() -> int:
    """One worker per core this process may use, leaving one for the serving process."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores - 1)


def _start_worker(target) -> None:
    """In a fresh worker: compile for `target`, with no GPU call and none of the parent's hooks."""
    from triton import knobs
    from triton.runtime.driver import driver

    from hf_async_cb.kernels.variant import TargetDriver

    driver.set_active(TargetDriver(target))
    knobs.runtime.jit_cache_hook = None
    knobs.runtime.jit_post_compile_hook = None


def _compile(pickled: tuple) -> Compiled:
    variant = from_pickled(*pickled)
    start = time.perf_counter()
    try:
        _build_launcher(variant.warmup())
        error = None
    except Exception as e:  # noqa: BLE001 (reported; the serving process meets it where it launches)
        error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return Compiled(variant.name, variant.describe(), time.perf_counter() - start, error)


def _build_launcher(compiled) -> None:
    """Build the variant's launcher into the disk cache too. Up to Triton 3.6 the launcher of a kernel
    signature is C code compiled with the host's C compiler (0.3-1 s) at the variant's first launch in
    a process; built here, the serving process's first launch loads it in milliseconds. Newer Triton
    launches every kernel through one module compiled with the driver: nothing to build then. Best
    effort: a launcher not built here is built at the first launch, as without workers."""
    nvidia = _c_launchers()
    if compiled is None or nvidia is None:
        return
    try:
        nvidia.CudaLauncher(compiled.src, compiled.metadata)  # (no CUDA call: generated C, compiled and loaded)
    except Exception:  # noqa: BLE001
        pass


def _c_launchers():
    """Triton's NVIDIA driver module where it compiles a C launcher per kernel signature (<= 3.6), else None."""
    try:
        from triton.backends.nvidia import driver as nvidia
    except ImportError:
        return None
    return nvidia if hasattr(nvidia, "make_launcher") else None


def compile_in_workers(variants: list[Variant], target, workers: int | None = None) -> list[Compiled]:
    """Compile `variants` for `target` in forked worker processes (into Triton's disk cache), the
    slowest kinds first so that no worker is left with a long one at the end. Returns each compile's
    report, in the order they finished; a variant left when the workers stalled (STALL_SECONDS without a
    finished compile) is reported with its error, and the workers stopped. A worker that dies (a crash
    in the compiler) raises BrokenProcessPool here rather than hanging the build."""
    if not variants:
        return []
    _warm_up_compiler(target)
    settle_cache_keys({id(v.kernel): v.kernel for v in variants}.values())  # the workers inherit the keys
    workers = min(len(variants), workers or default_workers())
    ordered = sorted(variants, key=_expected_cost, reverse=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # (forking a process with threads: see the module doc)
        pool, first = forked_pool(workers, _start_worker, (target,), _compile, ordered[0].pickled())
        futures = {first: ordered[0]}
        try:
            futures.update((pool.submit(_compile, v.pickled()), v) for v in ordered[1:])
            reports, left = finished_in_time(futures, STALL_SECONDS)
        except BaseException:
            _stop(pool)
            raise
        if not left:
            # Not waiting for the workers to exit: their work is on disk, and a forked child of a process
            # holding a CUDA context takes long to tear down (5.3 s of shutdown over an 8B model's three
            # precompiles on an H100); the pool's own thread reaps them.
            pool.shutdown(wait=False)
            return reports
        _stop(pool)
    logger.warning("hf_async_cb: the kernel compile workers finished nothing for %.0f s; stopped, with %d of %d "
                   "variants left, which this process compiles as it loads them", STALL_SECONDS, len(left), len(variants))
    return reports + [Compiled(v.name, v.describe(), STALL_SECONDS, f"stopped: the workers stalled for {STALL_SECONDS:.0f} s")
                      for v in left]


def finished_in_time(futures: dict, stall: float) -> tuple[list, list]:
    """The results of `futures` (future -> what it computes) as they finish, until all have or none has
    for `stall` seconds: (results, the values of the futures left)."""
    results, pending = [], set(futures)
    while pending:
        done, pending = wait(pending, timeout=stall, return_when=FIRST_COMPLETED)
        if not done:
            break
        results += [future.result() for future in done]
    return results, [futures[f] for f in futures if f in pending]


def _stop(pool: ProcessPoolExecutor) -> None:
    """Stop `pool` without waiting for its jobs: its workers killed (a stalled one never returns), then
    the pool's own thread, which finds them gone, joins them (one joiner: two threads waiting on one
    child leave it listed as running)."""
    for process in list((getattr(pool, "_processes", None) or {}).values()):
        process.kill()
    pool.shutdown(wait=True, cancel_futures=True)


def forked_pool(workers: int, initializer, initargs: tuple, fn, arg):
    """A pool of `workers` forked processes and the future of its first job, `fn(arg)`. The pool forks
    its workers at that first submit: under _FORKING, and again after a short wait where a fork
    raised (the workers forked before it are stopped first)."""
    delay = 0.01
    for attempt in range(1, FORK_ATTEMPTS + 1):
        pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"),
                                   initializer=initializer, initargs=initargs)
        try:
            with _FORKING:
                return pool, pool.submit(fn, arg)
        except RuntimeError as e:  # (OSError too, out of processes: not a passing state, raised at once)
            for process in list((getattr(pool, "_processes", None) or {}).values()):
                process.terminate()  # (blocked on the job queue with no manager thread to stop them)
                process.join()
            pool.shutdown(wait=False, cancel_futures=True)
            if attempt == FORK_ATTEMPTS:
                raise
            logger.info("forking a compile worker failed (%s); again in %.0f ms", e, 1e3 * delay)
            time.sleep(delay)
            delay *= 3


_WARMING = threading.Lock()  # (two precompiles at once: the second waits for the first's hashes)


def _warm_up_compiler(target) -> None:
    """Import the compiler and compute what every compile needs once per process (the hash of
    Triton's own files, ~0.5-1.5 s; the backend's), here, so that no worker repeats it."""
    with _WARMING:
        _warm_up(target)


def _warm_up(target) -> None:
    import triton.compiler.compiler  # noqa: F401

    try:
        from triton.compiler import make_backend
        from triton.runtime.cache import triton_key

        triton_key()
        make_backend(target).hash()
    except Exception:  # noqa: BLE001 (an internal that moved: each worker then computes its own)
        pass
    try:  # where a launcher links from (`ldconfig -p`, cached per process), for _build_launcher
        nvidia = _c_launchers()
        if nvidia is not None:
            nvidia.library_dirs()
    except Exception:  # noqa: BLE001
        pass


# Rough compile cost by kernel (the H200 host's seconds are about a third of these), for the order.
_COST = {"_resolve_kernel": 3.5, "_paged_attention_kernel": 3.0, "_ladder_kernel": 2.0, "_draw_parts_kernel": 1.5,
         "_greedy_parts_kernel": 1.2, "_skinny_gemm_kernel": 1.0, "_gather_kernel": 0.8}


def _expected_cost(variant: Variant) -> float:
    return _COST.get(variant.name.rsplit(".", 1)[-1], 0.5)
