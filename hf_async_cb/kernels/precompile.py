"""Compile every kernel variant a model can need at its engine's build: at once, in parallel worker
processes, while the build goes on; then no call compiles.

Why: compiled one at a time as steps first meet them, a 1B model's variants took 29.5 s of its
first sampled call on a fresh H200 (stock generate: 19 s for the whole job), and a later call with a
new batch size could compile for 20 s mid-run. The variants follow from the model and the engine
(kernels/model_variants.py), so the build starts compiling them all in forked workers
(kernels/compile_workers.py, into Triton's disk cache), and a background thread then loads each one
into the JIT's in-process cache (milliseconds each), so that no step of any later call compiles or
even reads the disk. Engine.__init__ waits for it before the first kernel runs (the parity check).

Timeline of a model's first engine on CUDA (model/prepared.py, engine/engine.py):

    main thread    : prepare the model (masks, fusion, element-wise checks) | build: pool, graphs | wait | parity, steps
    precompile 1   : the checks' kernels (the preparation waits for them)
    precompile 2   : the attention and the draws                           | 3: the rest the build lists
    workers        : compile, compile, ... (each precompile its own)

The attention and draw kernels (most of the compiling) follow from the model before it is prepared
(model_variants.facts_before_preparation), so they compile while it is; the build lists everything and
compiles what was not compiled already. Precompiles of different variants compile at the same time;
one listing a variant an earlier one lists waits for it (kernels/precompile._Turns).

On the CPU (Triton's interpreter) nothing is compiled, so nothing is done. HF_ASYNC_CB_COMPILE_WORKERS
sets the number of workers, or with 0 turns compiling ahead off (A/B runs).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import threading
import time

import torch

from hf_async_cb.kernels.compile_workers import Compiled, compile_in_workers, default_workers, no_fork
from hf_async_cb.kernels.variant import Variant, settle_cache_keys

logger = logging.getLogger(__name__)
_LOAD_IS_A_COMPILE = 0.3  # seconds: a load from the disk cache takes milliseconds, a compile far longer
# Compile workers: unset for one per core but one; a number for that many; 0 for none (compile
# as steps need them, as before: for A/B runs).
WORKERS_VARIABLE = "HF_ASYNC_CB_COMPILE_WORKERS"
# Loading each variant onto the device (its module, its launcher) in the precompile's thread: "0" leaves
# it to the variant's first launch, which may fall inside a call's graph capture (A/B runs).
LOAD_VARIABLE = "HF_ASYNC_CB_LOAD_AHEAD"


class _Turns:
    """A precompile compiles once every precompile started before it that lists one of its variants
    has compiled: engines built together (one per GPU) list the same variants, and the later then
    finds them in the disk cache. Precompiles of different variants (a preparation's element-wise
    checks, the engine's attention and draws) compile at the same time, each on its workers."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: list[tuple[frozenset, threading.Event]] = []

    def enter(self, identities: frozenset) -> tuple[list[threading.Event], threading.Event]:
        """Take a place: the events of the earlier precompiles to wait for, and this one's own, to set
        when it has compiled (or given up)."""
        own = threading.Event()
        with self._lock:
            self._running = [(ids, done) for ids, done in self._running if not done.is_set()]
            before = [done for ids, done in self._running if ids & identities]
            self._running.append((identities, own))
        return before, own

    @contextlib.contextmanager
    def turn(self, before: list[threading.Event], own: threading.Event):
        try:
            for done in before:
                done.wait()
            yield
        finally:
            own.set()


_TURNS = _Turns()
_DRIVER = threading.Lock()  # Triton's active driver is made on first use, by one thread at a time
_HOOK = threading.Lock()  # Triton's JIT cache hook, swapped by one precompile at a time (_not_loaded)


class Precompile:
    """Variants being compiled in workers and loaded, on a background thread; `wait()` joins it.
    Failures are logged, never raised: a variant that does not build raises where it is launched."""

    def __init__(self, variants: list[Variant], device: torch.device, what: str = "the model",
                 workers: int | None = None) -> None:
        self.what = what
        self.device = device
        self.variants = variants
        self.workers = min(len(variants), workers or default_workers())
        self.compiled: list[Compiled] = []
        self.loaded = 0
        self.on_device = 0  # variants also loaded onto the device here (LOAD_VARIABLE), not at a first launch
        self.failed: list[str] = []
        self.compiled_on_load: list[str] = []  # variants the workers compiled but this process compiled again
        self.on_disk = False  # every variant missing here was compiled by an earlier process: no workers started
        self.missing: int | None = None  # variants not in this process's JIT when its turn came
        self.seconds = 0.0
        settle_cache_keys({id(v.kernel): v.kernel for v in variants}.values())  # before any launch can key them
        before, own = _TURNS.enter(frozenset(self.identities()))
        self._thread = threading.Thread(target=self._run, args=(before, own), name="hf_async_cb-precompile",
                                        daemon=True)
        self._started = time.perf_counter()
        try:
            self._thread.start()
        except BaseException:
            own.set()  # (later precompiles must not wait for a turn never taken)
            raise

    def identities(self) -> set[tuple]:
        """The variants this precompile covers (Variant.identity), for a later one to leave out."""
        return {v.identity() for v in self.variants}

    def _run(self, before: list[threading.Event], own: threading.Event) -> None:
        from triton.runtime.driver import driver

        missing: list[Variant] = []
        try:
            with _TURNS.turn(before, own):
                with _DRIVER, _on(self.device):
                    # (here, not in the caller's thread: on a new machine Triton 3.6 first compiles its
                    # driver module, 0.26 s on an H200's host, which the caller's forwards now overlap)
                    self._target = driver.active.get_current_target()
                missing, keys = _not_loaded(self.variants, self.device)
                self.missing = len(missing)
                marker = _marker(missing, keys, self._target)
                self.on_disk = marker is not None and os.path.exists(marker)
                if missing and not self.on_disk:
                    self.compiled = compile_in_workers(missing, self._target, self.workers)
                    self.failed += [f"{c.name} ({c.described}) in a worker: {c.error}" for c in self.compiled if c.error]
            load_ahead = self.device.type == "cuda" and os.environ.get(LOAD_VARIABLE, "1").strip() != "0"
            with _on(self.device):
                for variant in missing:
                    try:
                        start = time.perf_counter()
                        with no_fork():  # (a fork now would copy the compiler's held locks: compile_workers)
                            kernel = variant.warmup()  # from the disk cache the workers filled
                            self.loaded += 1
                            if load_ahead and _load_onto_device(kernel):
                                self.on_device += 1
                        if time.perf_counter() - start > _LOAD_IS_A_COMPILE:  # the workers' entry was not found
                            self.compiled_on_load.append(f"{variant.name} ({variant.describe()}): "
                                                         f"{time.perf_counter() - start:.2f} s")
                    except Exception as e:  # noqa: BLE001 (it raises again where the step launches it)
                        self.failed.append(f"{variant.name} ({variant.describe()}): {type(e).__name__}")
            if missing and marker is not None and not self.on_disk and not self.failed and not self.compiled_on_load:
                _write_marker(marker)
        except Exception:  # noqa: BLE001 (the steps compile what is missing, as without precompiling)
            logger.exception("hf_async_cb: compiling the kernels ahead failed; steps compile them as they need them")
        finally:
            self.seconds = time.perf_counter() - self._started

    def wait(self, note: bool = True) -> "Precompile":
        """Block until every variant is compiled and loaded (or failed); say so once if it was slow
        (`note`; an engine's first use says it once for all its precompiles: note_first_use)."""
        self._thread.join()
        if self.compiled:
            logger.info("hf_async_cb: %s", self.summary())
        if note:
            note_slow_preparation(self.what, self.seconds, f"compiling its kernels: {self.summary()}")
        return self

    def summary(self) -> str:
        """One line: how many variants, compiled in how many workers, how long."""
        work = sum(c.seconds for c in self.compiled)
        if self.on_disk:
            text = f"{self.loaded} of {len(self.variants)} kernel variants loaded from the disk cache in {self.seconds:.1f} s"
        elif self.missing == 0:
            text = f"all {len(self.variants)} kernel variants were loaded already"
        else:
            text = (f"{len(self.compiled)} of {len(self.variants)} kernel variants compiled on {self.workers} workers "
                    f"in {self.seconds:.1f} s ({work:.1f} s of compiling)")
        if self.on_device:
            text += f"; {self.on_device} loaded onto the device"
        if self.failed:
            text += f"; {len(self.failed)} failed: {', '.join(self.failed[:3])}"
        if self.compiled_on_load:
            text += f"; {len(self.compiled_on_load)} compiled again on loading: {', '.join(self.compiled_on_load[:3])}"
        return text


def precompile(engine, model: torch.nn.Module, ahead: Precompile | None = None) -> Precompile | None:
    """Start compiling every kernel variant `model` can need on `engine`, which Engine._build calls
    once its pool and attention backend exist (CUDA only; None elsewhere: the interpreter compiles
    nothing), leaving out those `ahead` covers (started while the model was prepared). The engine
    waits for both before its first kernel runs."""
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
    if ahead is not None:
        covered = ahead.identities()
        variants = [v for v in variants if v.identity() not in covered]
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


def _not_loaded(variants: list[Variant], device: torch.device) -> tuple[list[Variant], list[str]]:
    """The variants not yet in their kernel's in-process JIT cache on `device` (a later engine of the
    same model finds them all there), and their JIT keys. Asked through Triton's cache hook, which
    sees exactly the launches that would compile; it answers only for this thread, so that other
    threads' launches compile as usual meanwhile."""
    from triton import knobs

    me = threading.get_ident()
    missing: list[Variant] = []
    keys: list[str] = []
    asked: list[str] = []

    def hook(**kwargs):
        if threading.get_ident() != me:
            return saved(**kwargs) if saved is not None else None
        asked.append(str(kwargs.get("key")))
        return True  # not compiled here: the workers do it

    with _HOOK:  # (one precompile at a time swaps the process-wide hook: another would restore it midway)
        saved = knobs.runtime.jit_cache_hook
        knobs.runtime.jit_cache_hook = hook
        try:
            with _on(device):
                for variant in variants:
                    asked.clear()
                    with no_fork():
                        variant.warmup()
                    if asked:
                        missing.append(variant)
                        keys.append(asked[0])
        finally:
            knobs.runtime.jit_cache_hook = saved
    return missing, keys


_MARKERS = "hf_async_cb-precompiled"  # a folder of Triton's cache folder


def _marker(variants: list[Variant], keys: list[str], target) -> str | None:
    """A file in Triton's cache folder named for these variants (each kernel's source hash and JIT key),
    the target, Triton's version and the settings that change its binaries: written once workers have
    compiled them all into that folder, so that a later process needing the same list loads them from
    the disk cache without starting workers (forking them and setting up their compiler cost about
    0.3 s per precompile, for nothing when everything is on disk). Should an entry be gone all the
    same, loading compiles it here: slower, never wrong. None where there is nothing to name."""
    if not variants:
        return None
    try:
        import triton
        from triton import knobs

        try:
            from triton._C.libtriton import get_cache_invalidating_env_vars

            settings = sorted(get_cache_invalidating_env_vars().items())
        except Exception:  # noqa: BLE001 (an internal that moved)
            settings = sorted((k, v) for k, v in os.environ.items() if k.startswith(("TRITON_", "LLVM_", "MLIR_")))
        named = sorted((str(getattr(v.kernel, "cache_key", v.name)), key) for v, key in zip(variants, keys))
        digest = hashlib.sha256(repr((triton.__version__, str(target), settings, named)).encode()).hexdigest()
        return os.path.join(knobs.cache.dir, _MARKERS, digest)
    except Exception:  # noqa: BLE001 (no marker: workers compile, as without it)
        return None


def _write_marker(path: str) -> None:
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w"):
            pass
    except OSError:  # a read-only cache folder: the next process starts workers again
        pass


def _load_onto_device(kernel) -> bool:
    """Load a compiled variant's binary onto the current device and import its launcher, as its first
    launch would (Triton's CompiledKernel._init_handles): done here, in the precompile's thread, it is
    never done inside a later call's graph capture (where one H100 host spent 0.1 s of a 7-row call's
    captures; another host showed no difference: docs/benchmarks.md). False where this Triton has no
    such step or it failed (the first launch then loads it, as before, and raises there if it must)."""
    init = getattr(kernel, "_init_handles", None)
    if init is None:
        return False
    try:
        init()
    except Exception:  # noqa: BLE001 (e.g. out of shared memory: raised again, by name, at its launch)
        return False
    return True


def _on(device: torch.device):
    """`device` as the current CUDA device (where the JIT files what it loads); nothing elsewhere."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def note_first_use(what: str, seconds: float, precompiles: list[Precompile | None],
                   parts: dict[str, float] | None = None) -> None:
    """Say once, when a model's first engine took more than a second to prepare, build and check, how
    long and how much of it went to its kernels (every precompile it waited for, in one line), and
    which of `parts` (the build's other steps, seconds by name) took a fifth of it or more: a first
    call of a quantized model spent 75 s in its parity check, where the line named only the kernels."""
    ran = [p for p in precompiles if p is not None]
    compiled = sum(len(p.compiled) for p in ran)
    if compiled:
        work = sum(c.seconds for p in ran for c in p.compiled)
        kernels = (f"{compiled} kernel variants compiled on up to {max(p.workers for p in ran)} workers in "
                   f"{max(p.seconds for p in ran):.1f} s ({work:.1f} s of compiling)")
    elif any(p.on_disk for p in ran):
        kernels = f"{sum(p.loaded for p in ran)} kernel variants loaded from the disk cache"
    else:
        kernels = "no kernel compiled"
    failed = [f for p in ran for f in p.failed]
    if failed:
        kernels += f"; {len(failed)} failed: {', '.join(failed[:3])}"
    long = [f"{name} {s:.1f} s" for name, s in (parts or {}).items() if s >= max(0.2 * seconds, 0.5)]
    note_slow_preparation(what, seconds, f"preparing the model, its engine and their kernels: {kernels}"
                          + "".join(f"; {part}" for part in long))


_NOTED: set[str] = set()


def note_slow_preparation(what: str, seconds: float, details: str = "") -> None:
    """Say once per process, when it took more than a second, what a first call prepared and for how
    long (a user waiting seconds should know why, and that later calls will not)."""
    if seconds <= 1.0 or what in _NOTED:
        return
    _NOTED.add(what)
    logger.warning("hf_async_cb: first use of %s took %.1f s%s; later calls reuse it", what, seconds,
                   f" ({details})" if details else "")
