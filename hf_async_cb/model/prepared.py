"""The model as the engine runs it: checked once, fused once, switched in and out per call.

Preparing a model (the support check, concatenating q/k/v and gate/up weights, choosing the
element-wise kernels) is done once, under the model's guard (model/model_guard.py), as is every
call. Between calls the model is stock: the original modules are in
place, their weights views of the fused tensors (nothing copied, gradients and in-place optimiser
steps reach both). `using()` attaches the fused modules and the paged attention for one call, under
the model's guard, and detaches them on the way out, errors included.

`signature()` is what the preparation depends on: every parameter's identity, storage, dtype and
device, the modules and their forward hooks, and the config. A `.to()`, a reassigned `.data`, a new
parameter, a module replaced (a wrapper, an adapter), a hook added or removed or a config change
gives a new signature; the runtime then prepares the model again.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from typing import Iterator

import torch

from hf_async_cb.interrupts import deferred_interrupts
from hf_async_cb.model import attention
from hf_async_cb.model.adapters import AttentionAdapters
from hf_async_cb.model.callback_forwards import stock_for_callbacks
from hf_async_cb.model.checks import check_model_supported, tensor_parallel_size
from hf_async_cb.model.code_identity import code_identity
from hf_async_cb.model.compiled import uncompiled
from hf_async_cb.model.config_snapshot import config_snapshot
from hf_async_cb.model.embeddings_path import embeddings_refusal
from hf_async_cb.model.eval_mode import as_in_eval
from hf_async_cb.model.fusion import FusedProjections, fuse_projections, global_hooks, moved_from, user_hooks
from hf_async_cb.model.kv_fingerprint import attribute_tensors, parameters_of
from hf_async_cb.model.mask_semantics import apply_masks
from hf_async_cb.model.model_guard import ModelGuard, model_guard
from hf_async_cb.model.weight_kinds import storage_key

logger = logging.getLogger(__name__)


_UNCHECKED = object()


def signature(model: torch.nn.Module) -> tuple:
    """What a preparation of `model` depends on (cheap: one walk of the modules). Fusions bypass
    some modules' calls and CUDA graphs replay none of Python's, so a module put in place of another, a class swapped, a forward set on an instance or a forward hook
    added or removed (global ones too; transformers' own output-capturing hooks, no-ops outside
    their feature, are not counted) counts as a change, as do parameters, the tensors custom modules
    hold as attributes (graphs read them where they were) and the config. A storage the package's own
    fusion gave a weight (another engine's or generate()'s preparation of the same model, or its
    undoing) reads as the one it replaced (fusion.moved_from): the user changed nothing there, and
    an engine's CUDA graphs follow the move (weight_storages). So does the code the modules' classes
    run (model/code_identity.py: a class's forward or a modeling file's function patched), a module's
    config replaced by another object, a config a module holds outside the model's edited, and an
    attention module's `sliding_window` set since."""
    modules = list(model.modules())
    params = tuple((id(p), moved_from(p), p.dtype, p.device)
                   for p in (*parameters_of(modules), *attribute_tensors(model, modules)))
    # Each module's config by identity (a sub-model given another config object), and an attention
    # module's own window (the preparation reads its masks against it: model/mask_semantics.py).
    kinds = tuple((id(m), type(m), m.__dict__.get("forward"), user_hooks(m), id(m.__dict__.get("config")),
                   m.__dict__.get("sliding_window")) for m in modules)
    own = tuple(config_snapshot(c) for c in attention.own_configs(model, model.config, modules))  # (edited in place too)
    return params, kinds, global_hooks(), config_snapshot(model.config), own, code_identity(modules)


def weight_storages(model: torch.nn.Module) -> tuple:
    """Where the model's parameters are now (what CUDA graphs captured on them read)."""
    return tuple(storage_key(p) for p in model.parameters())


def _compile_check_kernels(model: torch.nn.Module, device: torch.device):
    """Start compiling the element-wise kernels fuse_elementwise's checks launch (compile workers,
    kernels/precompile.py); None if nothing is compiled ahead. Compiled one by one in the checks,
    they took 2.2 s of a fresh H200 process's first call."""
    try:
        from hf_async_cb.kernels.precompile import precompile_variants
        from hf_async_cb.model.elementwise_fusion import check_variants
    except ImportError:  # no Triton: nothing is fused either
        return None
    try:
        variants = check_variants(model)
    except Exception:  # noqa: BLE001 (a module of an unexpected shape: the checks compile as they run)
        logger.debug("hf_async_cb: the element-wise checks' kernels are not compiled ahead", exc_info=True)
        return None
    return precompile_variants(variants, device, f"{type(model).__name__}'s element-wise checks")


def _compile_engine_kernels(model: torch.nn.Module, device: torch.device, page_size: int, attention_choice: str):
    """Start compiling the kernels an engine will launch that are known before the model is prepared
    (its attention and draws: most of the compiling; kernels/model_variants.py), beside the checks'
    kernels; None if nothing is compiled ahead. The engine's build compiles the rest."""
    try:
        from hf_async_cb.kernels.model_variants import facts_before_preparation, model_variants
        from hf_async_cb.kernels.precompile import precompile_variants
    except ImportError:  # no Triton
        return None
    try:
        backend = attention.resolve_backend(attention_choice, device)
        variants = model_variants(facts_before_preparation(model, page_size, backend))
    except Exception:  # noqa: BLE001 (the build lists and compiles them, or says why the model cannot run)
        logger.debug("hf_async_cb: the engine's kernels are not compiled before the build", exc_info=True)
        return None
    return precompile_variants(variants, device, f"{type(model).__name__} on {device}")


class PreparedModel:
    """A model checked and fused for the engine; see the module docstring."""

    def __init__(self, model: torch.nn.Module, trust_untested_model: bool = False,
                 fuse_projections_: bool | None = None, fuse_elementwise: bool | None = None,
                 skinny_gemm: bool | None = None, engine_config=None) -> None:
        """`engine_config`: the BatchingConfig of the engine to come, whose attention and draw
        kernels then compile while the model is prepared (`kernels_ahead`). Prepared under the model's
        guard, from the first check to the signature: another thread's call has its own modules swapped
        in while it holds the model, and a preparation reading them meanwhile would fuse that call's
        modules (or none) and take them for the model's in its signature."""
        with model_guard(model).held("preparing the model", kind="build"):
            self._prepare(model, trust_untested_model, fuse_projections_, fuse_elementwise, skinny_gemm, engine_config)

    def _prepare(self, model: torch.nn.Module, trust_untested_model: bool, fuse_projections_: bool | None,
                 fuse_elementwise: bool | None, skinny_gemm: bool | None, engine_config) -> None:
        check_model_supported(model, trust_untested_model)
        self.device = next(model.parameters()).device
        on_cuda = self.device.type == "cuda"
        checks = None
        self.kernels_ahead = None  # a kernels/precompile.Precompile the engine's build waits for
        self.checks_ahead = None  # the element-wise checks' (waited for below)
        if on_cuda and tensor_parallel_size(model) <= 1:
            if fuse_elementwise is not False:
                checks = self.checks_ahead = _compile_check_kernels(model, self.device)  # in workers meanwhile
            if engine_config is not None:  # beside the checks' kernels (different variants: at once)
                self.kernels_ahead = _compile_engine_kernels(model, self.device, engine_config.page_size,
                                                             engine_config.attention)
        with uncompiled(model):  # a forward, config switched
            apply_masks(model)
        self._model = weakref.ref(model)
        self._aside = False  # set_aside() open
        self._embeddings_refusal: str | None | object = _UNCHECKED
        self.fusion: FusedProjections | None = None
        self.elementwise = None
        self.decode_gemms = None
        self.adapters = AttentionAdapters(model)
        if tensor_parallel_size(model) > 1:
            # Tensor-parallel layers carry transformers' sharding hooks, which fused modules would lose.
            fuse_projections_ = fuse_elementwise = skinny_gemm = False
        try:
            if on_cuda if fuse_projections_ is None else fuse_projections_:
                self.fusion = fuse_projections(model)
            if on_cuda if fuse_elementwise is None else fuse_elementwise:
                from hf_async_cb.model.elementwise_fusion import fuse_elementwise as fuse  # imports Triton

                if checks is not None:
                    checks.wait(note=False)  # (said with the engine's first use: precompile.note_first_use)
                self.elementwise = fuse(model)
            if on_cuda if skinny_gemm is None else skinny_gemm:
                from hf_async_cb.model.decode_gemm import DecodeGemms  # imports Triton

                self.decode_gemms = DecodeGemms(model, self.fusion)
            for prepared in (self.fusion, self.elementwise, self.decode_gemms):
                if prepared is not None:
                    logger.info("hf_async_cb: %s", prepared.summary())
            self._detach()
        except BaseException:
            self.restore()
            raise
        self.signature = signature(model)

    def embeddings_refusal(self) -> str | None:
        """Why prompt embeddings cannot run on the model, or None when they run exactly. Checked on
        first use (two short forwards of the stock model, under its guard), not when the model is
        prepared: most calls feed tokens alone, and a first call should not pay for it."""
        if self._embeddings_refusal is _UNCHECKED:
            model = self._model()
            with model_guard(model).held("checking prompt embeddings"), uncompiled(model):
                if self._embeddings_refusal is _UNCHECKED:  # (another thread may have checked meanwhile)
                    self._embeddings_refusal = embeddings_refusal(model)
        return self._embeddings_refusal

    def matches(self, model: torch.nn.Module) -> bool:
        """Whether `model` is still what was prepared (same parameters, storages, dtype, config)."""
        return signature(model) == self.signature and (self.fusion is None or self.fusion.intact())

    @contextlib.contextmanager
    def using(self, model: torch.nn.Module, guard: ModelGuard | None = None, what: str = "generate",
              serving: bool = False, check=None) -> Iterator[None]:
        """The fused modules and the paged attention, for one call, under the model's guard.
        `check()`, if given, runs once the guard is held and before anything is swapped in: the
        model as this call finds it (another thread's call may have it swapped until then)."""
        guard = guard or model_guard(model)
        with guard.held(what, serving=serving), as_in_eval(model):  # (no dropout: model/eval_mode.py)
            if check is not None:
                check()
            with uncompiled(model):  # compiled wrappers set aside: the engine runs the eager forward
                try:
                    self._attach()
                    attention.register()
                    with attention.implementation(model.config, attention.ATTENTION_NAME, model) as stock, \
                            attention.engine_call():
                        self._stock_attention = stock
                        with stock_for_callbacks(model, self.set_aside):  # a callback's forward: stock
                            yield
                finally:
                    with deferred_interrupts():  # half given back, the model would fail every later forward
                        self._detach()

    @contextlib.contextmanager
    def set_aside(self) -> Iterator[None]:
        """Inside using(): the model stock for a forward of its own (a served request's images merged
        on the loop thread: model/vision.py's media_embeds; a callback's forward:
        model/callback_forwards.py), then prepared again. Nested, the inner one changes nothing."""
        if self._aside:
            yield
            return
        self._aside = True
        self._detach()
        try:
            with attention.given_back(self._stock_attention):
                yield
        finally:
            with deferred_interrupts():
                self._attach()
                self._aside = False

    def reclaim_attention(self) -> None:
        """Inside using(): the paged attention routed again where the user switched the model's
        attention meanwhile (`set_attn_implementation` while a loop serves: its steps would run the
        user's implementation on the engine's pool); the user's choice applies once the call ends."""
        taken = attention.reclaim(self._stock_attention, attention.ATTENTION_NAME)
        if taken:
            logger.warning("hf_async_cb: the model's attention implementation was changed while an engine holds it; "
                           "the change applies once the engine lets the model go (shutdown() for a serving loop)")

    def _attach(self) -> None:
        if self.fusion is not None:
            self.fusion.attach()
        if self.elementwise is not None:  # after the projections: its MLP forward uses their GEMM
            self.elementwise.attach()
        if self.decode_gemms is not None:  # after the projections: it routes their groups' GEMMs
            self.decode_gemms.attach()
        self.adapters.attach()

    def _detach(self) -> None:
        self.adapters.detach()
        if self.decode_gemms is not None:
            self.decode_gemms.detach()
        if self.elementwise is not None:
            self.elementwise.detach()
        if self.fusion is not None:
            self.fusion.detach()

    def forget(self) -> None:
        """Drop the preparation and leave the model as it is between calls (stock modules, weights
        views of the fused tensors, which live on only through those views): nothing is copied."""
        self._detach()
        self.fusion = self.elementwise = self.decode_gemms = None

    def restore(self) -> None:
        """Give the model back with every weight in its own storage (idempotent)."""
        if self.decode_gemms is not None:
            self.decode_gemms.detach()
            self.decode_gemms = None
        if self.elementwise is not None:
            self.elementwise.restore()
            self.elementwise = None
        if self.fusion is not None:
            self.fusion.restore()
            self.fusion = None
