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
import sys
import textwrap

import pytest

triton = pytest.importorskip("triton")
jit = pytest.importorskip("triton.runtime.jit")

from hf_async_cb.kernels.variant import Variant, compiling_for, settle_cache_keys, sm90  # noqa: E402

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


def test_settled_keys_equal_this_tritons_own(fresh_module):
    """Where Triton keys callees first itself (3.7 and later), settling changes nothing."""
    module = fresh_module()
    own = fresh_module().kernel.cache_key
    settle_cache_keys([module.kernel])
    assert module.kernel.cache_key == own


def test_interpreted_and_plain_objects_are_left_alone():
    settle_cache_keys([None, 3, print])


@pytest.mark.slow
def test_the_parent_loads_what_a_forked_worker_compiled(fresh_module, old_triton_key_order, tmp_path, monkeypatch):
    """The precompile's path: a worker forked before the parent keyed the kernel's callees through
    another kernel compiles the variant; the parent then loads it without compiling again."""
    import torch

    from hf_async_cb.kernels.compile_workers import compile_in_workers

    cache = tmp_path / "cache"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    module = fresh_module()
    variant = Variant(module.kernel, (torch.int32, 7))
    [report] = compile_in_workers([variant], sm90(), 1)
    assert report.error is None
    entries = set(os.listdir(cache))
    with compiling_for(sm90()):
        Variant(module.other, (torch.int32, 7)).warmup()  # keys the leaf in the parent
        variant.warmup()  # from the worker's entry
    new = {e for e in set(os.listdir(cache)) - entries
           if any(f.startswith("kernel.") for f in os.listdir(cache / e))}
    assert not new, "the parent compiled the worker's variant again under another key"
