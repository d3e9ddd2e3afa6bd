"""Triton cache keys that do not depend on the order in which a process computed them.

Up to Triton 3.6 a JIT function's cache key counts the global constants of the functions it calls
only where their keys were computed before its own (DependenciesFinder._update_hash merged the
callee's globals before asking for its key). On the H200 (transformers 5.17's image: Triton 3.6)
the sampler's resolve kernel was so filed under one key by the compile workers and under another by
the serving process, which compiled it again on every first call. These tests put Triton 3.6's order
back (`old_triton_key_order`) and check that kernels.variant.settle_cache_keys gives the complete
key whatever was keyed first, and that a forked worker's compile is what the parent then loads.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import subprocess
import sys
import textwrap

import pytest

triton = pytest.importorskip("triton")
jit = pytest.importorskip("triton.runtime.jit")

from hf_async_cb.kernels.variant import settle_cache_keys  # noqa: E402

_SOURCE = textwrap.dedent('''
    import triton
    import triton.language as tl

    WIDTH = tl.constexpr(16)


    @triton.jit
    def _leaf(x):
        return x * WIDTH


    @triton.jit(noinline=True)
    def _middle(x):
        return _leaf(x) + 1


    @triton.jit
    def kernel(out_ptr, n):
        tl.store(out_ptr, _middle(n))


    @triton.jit
    def other(out_ptr, n):
        tl.store(out_ptr, _leaf(n))
''')
_COUNT = itertools.count()


@pytest.fixture
def fresh_module(tmp_path, monkeypatch):
    """A new copy of the kernels above each call: JIT functions (not the interpreter's, which the
    CPU test run chooses) whose keys are not yet computed."""
    path = tmp_path / "keyed_kernels.py"
    path.write_text(_SOURCE)

    def load():
        spec = importlib.util.spec_from_file_location(f"keyed_kernels_{next(_COUNT)}", path)
        module = importlib.util.module_from_spec(spec)
        with monkeypatch.context() as m:
            m.setattr(triton.knobs.runtime, "interpret", False)
            spec.loader.exec_module(module)
        monkeypatch.setitem(sys.modules, spec.name, module)  # (a forked worker finds the kernel by name)
        return module

    return load


@pytest.fixture
def old_triton_key_order(monkeypatch):
    """DependenciesFinder._update_hash as Triton 3.6 has it: the callee's globals merged before its
    key is computed, so a callee keyed for the first time inside its caller's keying adds none."""
    finder = jit.DependenciesFinder

    def update_hash(self, func):
        self.used_global_vals.update(func.used_global_vals)
        func_key = func.cache_key + str(getattr(func, "noinline", False))
        self.hasher.update(func_key.encode("utf-8"))

    monkeypatch.setattr(finder, "_update_hash", update_hash)


def _complete_key(load) -> str:
    """The key with every callee's globals counted (the callees keyed before the caller)."""
    module = load()
    module._leaf.cache_key
    module._middle.cache_key
    return module.kernel.cache_key


def test_the_old_order_gives_a_key_that_depends_on_what_was_keyed_first(fresh_module, old_triton_key_order):
    assert fresh_module().kernel.cache_key != _complete_key(fresh_module)  # the failure these tests guard


@pytest.mark.parametrize("first", [None, "other", "_middle"])
def test_settled_keys_are_complete_whatever_was_keyed_first(fresh_module, old_triton_key_order, first):
    complete = _complete_key(fresh_module)
    module = fresh_module()
    if first == "other":
        settle_cache_keys([module.other])  # another kernel keyed first keys the leaf
    elif first == "_middle":
        settle_cache_keys([module._middle])
    settle_cache_keys([module.kernel])
    assert module.kernel.cache_key == complete


@pytest.mark.parametrize("first", [None, "other"])
def test_settled_keys_are_complete_with_this_tritons_own_order(fresh_module, first):
    """Without the old order put back: on Triton 3.6 (the GPU image's) settling completes the key, on
    later versions it is the key Triton computes anyway."""
    complete = _complete_key(fresh_module)
    module = fresh_module()
    if first == "other":
        settle_cache_keys([module.other])
    settle_cache_keys([module.kernel])
    assert module.kernel.cache_key == complete


def test_interpreted_and_plain_objects_are_left_alone():
    settle_cache_keys([None, 3, print])


# The precompile's path, in a process of its own without the interpreter (as on a GPU machine: an
# interpreted kernel running in another thread of the test process patches triton.language meanwhile):
# a worker forked before the parent keyed the kernel's callees through another kernel compiles the
# variant; the parent then loads it. Prints how many cache entries the parent added for it.
_FORKED = """
import importlib.util, os, sys
import torch
from triton.runtime import jit
from hf_async_cb.kernels import compile_workers, variant as v

if sys.argv[2] == "old-order":
    def update_hash(self, func):
        self.used_global_vals.update(func.used_global_vals)
        self.hasher.update((func.cache_key + str(getattr(func, "noinline", False))).encode("utf-8"))
    jit.DependenciesFinder._update_hash = update_hash
if sys.argv[3] == "unsettled":
    compile_workers.settle_cache_keys = lambda kernels: None
spec = importlib.util.spec_from_file_location("keyed_kernels", sys.argv[1])
module = importlib.util.module_from_spec(spec)
sys.modules["keyed_kernels"] = module
spec.loader.exec_module(module)
variant = v.Variant(module.kernel, (torch.int32, 7))
[report] = compile_workers.compile_in_workers([variant], v.sm90(), 1)
assert report.error is None, report.error
cache = os.environ["TRITON_CACHE_DIR"]
before = set(os.listdir(cache))
with v.compiling_for(v.sm90()):
    v.Variant(module.other, (torch.int32, 7)).warmup()  # keys the leaf in the parent
    variant.warmup()  # from the worker's entry
added = [e for e in set(os.listdir(cache)) - before if any(f.startswith("kernel.") for f in os.listdir(os.path.join(cache, e)))]
print("added", len(added))
"""


def _forked_compiles(tmp_path, cases: list[tuple[str, bool]]) -> list[int]:
    """Each case (order, settled) in a process of its own, the processes side by side."""
    pytest.importorskip("triton.backends.nvidia")
    path = tmp_path / "keyed_kernels.py"
    path.write_text(_SOURCE)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    runs = []
    for order, settled in cases:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env["TRITON_CACHE_DIR"] = str(tmp_path / f"cache-{order}-{settled}")
        env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
        runs.append(subprocess.Popen([sys.executable, "-c", _FORKED, str(path), order,
                                      "settled" if settled else "unsettled"],
                                     env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    added = []
    try:
        for run in runs:
            out, err = run.communicate(timeout=300)
            assert run.returncode == 0, err[-3000:]
            added.append(int(out.split("added")[-1]))
    finally:
        for run in runs:
            run.kill()  # (those a failure left running)
            run.wait()
    return added


def test_the_parent_loads_what_a_forked_worker_compiled(tmp_path):
    unsettled, settled, own_order = _forked_compiles(
        tmp_path, [("old-order", False), ("old-order", True), ("own-order", True)])
    assert unsettled == 1  # the failure: compiled again
    assert settled == 0 and own_order == 0
