"""Module paths of the flat layout (0.2) keep importing, with a DeprecationWarning naming the new one.

`import hf_async_cb.integration` or `from hf_async_cb.kv_cache import PagedKVCache` gets a stand-in
module that forwards every attribute to the module(s) that now hold it. New code imports the new
paths (docs/architecture.md draws the tree).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings

PACKAGE = "hf_async_cb"

# old module (relative to the package) -> the new modules that hold its names, searched in order
MOVED: dict[str, tuple[str, ...]] = {
    "integration": ("generate.hook", "generate.call", "generate.arguments", "generate.stock_options",
                    "generate.outputs"),
    "streaming": ("generate.streaming",),
    "requests": ("engine.requests",),
    "scheduler": ("engine.scheduler",),
    "page_table": ("engine.page_table",),
    "batch": ("engine.batch",),
    "pipeline": ("engine.pipeline",),
    "slots": ("engine.io_slots",),
    "cuda_graphs": ("engine.cuda_graphs", "engine.graph_keys", "engine.captured_graph"),
    "runner": ("engine.runner",),
    "online": ("engine.online",),
    "profiling": ("engine.profiling",),
    "kv_cache": ("model.kv_cache", "engine.page_allocator"),
    "models": ("model.checks",),
    "fusion": ("model.fusion",),
    "elementwise": ("model.elementwise_fusion", "kernels.elementwise"),
    "attention": ("model.attention",),
    "attention.metadata": ("model.step_metadata",),
    "attention.reference": ("kernels.paged_attention_reference",),
    "attention.store_kv": ("kernels.store_kv",),
    "attention.triton_paged": ("kernels.paged_attention",),
    "greedy": ("kernels.draw_greedy",),
    "sampled": ("kernels.draw_sampled",),
    "penalties": ("sampling.device_processors",),
    "history": ("sampling.token_history",),
    "bench": ("tools.bench",),
    "demo_model": ("tools.demo_model",),
}
_OLD_PACKAGES = {"attention"}


class MovedModule(types.ModuleType):
    """Stands in for an old module: attributes come from the modules that hold them now."""

    def __init__(self, name: str, targets: tuple[str, ...]) -> None:
        super().__init__(name)
        self.__targets = tuple(f"{PACKAGE}.{t}" for t in targets)

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        for target in self.__targets:
            module = importlib.import_module(target)
            if hasattr(module, attr):
                return getattr(module, attr)
        raise AttributeError(f"module {self.__name__!r} has moved to {' / '.join(self.__targets)}, "
                             f"which have no attribute {attr!r}")


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        old = fullname[len(PACKAGE) + 1:] if fullname.startswith(PACKAGE + ".") else None
        if old not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=old in _OLD_PACKAGES)

    def create_module(self, spec):
        return MovedModule(spec.name, MOVED[spec.name[len(PACKAGE) + 1:]])

    def exec_module(self, module) -> None:
        targets = MOVED[module.__name__[len(PACKAGE) + 1:]]
        warnings.warn(f"{module.__name__} has moved: import from {PACKAGE}.{targets[0]} instead",
                      DeprecationWarning, stacklevel=2)


def install_finder() -> None:
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(_MovedFinder())
