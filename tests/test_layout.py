"""The package tree shows the parts, and the 0.2 flat module paths still import (with a warning)."""

import importlib
import pathlib
import warnings

import pytest

import hf_async_cb
from hf_async_cb._moved import MOVED

ROOT = pathlib.Path(hf_async_cb.__file__).parent


def test_top_level_is_small_and_the_parts_are_folders():
    modules = [p.name for p in ROOT.glob("*.py")]
    packages = sorted(p.name for p in ROOT.iterdir() if (p / "__init__.py").exists())
    assert len(modules) <= 12, modules
    assert {"generate", "engine", "model", "kernels", "sampling", "tools"} <= set(packages)


def test_no_two_modules_differ_only_by_a_suffix():
    stems = sorted({p.stem for p in ROOT.rglob("*.py")} - {"__init__", "__main__"})
    for a in stems:
        for b in stems:
            assert a == b or not (b.startswith(a) and len(b) - len(a) <= 2), (a, b)


@pytest.mark.parametrize("old", sorted(MOVED))
def test_old_module_paths_resolve_to_the_new_objects(old):
    new = importlib.import_module(f"hf_async_cb.{MOVED[old][0]}")
    public = [n for n in vars(new) if not n.startswith("_") and getattr(getattr(new, n), "__module__", None)
              == new.__name__]
    assert public, new
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(f"hf_async_cb.{old}")
        for name in public:
            assert getattr(module, name) is getattr(new, name)
    assert any(issubclass(w.category, DeprecationWarning) and MOVED[old][0] in str(w.message) for w in caught) \
        or old.startswith("attention.")  # the package's warning was given when `attention` was first imported


def test_old_names_that_moved_elsewhere_still_resolve():
    from hf_async_cb.engine.page_allocator import PageAllocator
    from hf_async_cb.kernels.elementwise import rms_norm
    from hf_async_cb.sampling.sampler import pack

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from hf_async_cb.elementwise import rms_norm as old_rms_norm
        from hf_async_cb.engine import copy_params  # noqa: F401  (was hf_async_cb.engine, the module)
        from hf_async_cb.kv_cache import PageAllocator as OldAllocator
        from hf_async_cb.sampling import pack as old_pack
    assert (OldAllocator, old_rms_norm, old_pack) == (PageAllocator, rms_norm, pack)
    with pytest.raises(AttributeError, match="moved to"):
        importlib.import_module("hf_async_cb.kv_cache").no_such_name
