"""Decode-step projections through the skinny GEMM kernel, where the GPU measured it faster.

A decode step multiplies a few rows (one per running request) by every weight matrix, and its
time is the time those weights take to stream. cuBLAS streams some decode shapes well below the
copy bandwidth (kernels/skinny_gemm.py says which and why); the skinny kernel is a measured
alternative, never a guess: each (rows bucket, N, K, dtype, GPU, Triton version) takes the kernel
only if `GemmChoice` recorded that it beat cuBLAS there. A shape never measured runs cuBLAS.

`DecodeGemms` covers every nn.Linear of the model (lm_head included) and the fused q/k/v and
gate/up groups (model/fusion.py). Linears whose weight is torchao's weight-only int8 (one scale
per output row) take the kernel's scaled int8 form for every decode bucket without a measurement:
it reads a fifth of the bytes the module's own path moves (which converts the whole weight to the
activations' dtype at every call), with the same rounding steps. HQQ's HQQLinear at 8, 4, 3, 2 or 1 bits
(`hqq_grouped` says which) takes the grouped form alike: it reads the packed bytes, where HQQ's forward
dequantizes the whole weight at every call, and rebuilds each weight as HQQ rounds it; frozen
optimum-quanto QLinears of 4- or 2-bit weights (model/quanto_grouped.py) take it with quanto's rules. Frozen
optimum-quanto QLinears of int8 (or float8_e4m3fn) weights (`quanto_bytes` says which) and torchao's
weight-only float8 linears (`torchao_float8`) take the pre-scaled form: the library scales the whole
weight before its matmul at every call, the kernel scales each tile as it is read, rounding each
weight alike. bitsandbytes' nf4 / fp4 Linear4bit (`bnb_4bit`) takes the codebook 4-bit form: half a
byte per weight read, where bitsandbytes' inference path on the H200 dequantizes the whole weight
at every call; on CUDA at the rows buckets where it measured faster (BNB_4BIT_CUDA_BUCKETS).
bitsandbytes' LLM.int8() Linear8bitLt (`bnb_int8`) takes kernels/llm_int8.py's two kernels at every
decode bucket: its forward finds the outlier columns on the host (no CUDA graph can hold it, and
every call waits for the GPU), the kernels flag them on the device and read the int8 weight once.
The pickers are model/quantized_linears.py's. attach()
routes the products through per-weight callables that pick per call by row count: more than 256
rows (prefill), or a bucket without a recorded win, goes to F.linear (a quantized module: its own
forward) as before. The pick is a dict lookup; it runs when a CUDA graph is captured, so replays
pay nothing for it. detach() puts everything back. `tune()` measures the shapes not yet known, at
warm-up (BatchingConfig.skinny_gemm=True); the choices persist on disk.
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from hf_async_cb.kernels import llm_int8
from hf_async_cb.kernels.grouped_dequant import BLOCK_N, dequantize_grouped
from hf_async_cb.kernels.gemm_choice import GemmChoice
from hf_async_cb.kernels.skinny_gemm import (MAX_M, m_bucket, runs_on, skinny_linear, skinny_linear_codebook_4bit,
                                              skinny_linear_grouped)
from hf_async_cb.kernels.skinny_gemm_forms import PLAIN, SCALED_INT8, WeightForm
from hf_async_cb.model.attention import current_metadata
from hf_async_cb.model.graph_safety import launches_off_stream
from hf_async_cb.model.hqq_four_bit_copy import FourBitCopy, copies_fit, copy_bytes, takes_a_copy, word_hashes
from hf_async_cb.model.quanto_grouped import QuantoCopy, copied_weight, quanto_copy_bytes, quanto_grouped
from hf_async_cb.model.quantized_linears import (  # noqa: F401 (the pickers, importable from here too)
    Bnb4bit, BnbInt8, GroupedWeight, PrescaledWeight, bnb_4bit, bnb_4bit_form, bnb_compute_dtype, bnb_int8,
    hqq_grouped, quanto_bytes, scaled_int8, torchao_float8)
from hf_async_cb.model.weight_kinds import is_plain

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# The rows buckets at which bitsandbytes' Linear4bit modules on CUDA take the codebook 4-bit form: where
# a decoder layer's seven projections took less time in it than in bitsandbytes' own path (H200,
# 2026-12-04, the 8B shape's projections in CUDA graphs: 0.5-0.9x its time from 4 to 64 rows; at one
# and two rows its GEMV, from 128 rows its dequantize + cuBLAS were faster: benchmarks/codebook_gemm_probe.py,
# docs/benchmarks.md). Off CUDA every bucket takes it.
BNB_4BIT_CUDA_BUCKETS: frozenset[int] = frozenset({4, 8, 16, 32, 64})
# Grouped projections' steps of more than MAX_M rows: the weight rebuilt whole in one pass, then cuBLAS
# (kernels/grouped_dequant.py); False: the library's own forward (an A/B for benchmarks).
GROUPED_DENSE_ABOVE_MAX_M = True
REBUILT_ELEMENTS = 1 << 26  # the most weights rebuilt at once (128 MiB in 16 bits: the 8B shape's projections whole)
try:  # what a recorded config that this machine cannot build raises
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources
    _BUILD_ERRORS: tuple = (CompilationError, OutOfResources)
except ImportError:  # a Triton that moved them: such a config then fails loudly
    _BUILD_ERRORS = ()


class _Projection:
    """One weight's pick between the kernel and F.linear, by rows bucket."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, configs: dict[int, dict]) -> None:
        self.weight, self.bias, self.configs = weight, bias, configs

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // max(1, x.shape[-1])
        bucket = m_bucket(rows)
        config = self.configs.get(bucket) if 0 < rows <= MAX_M else None
        if (config is None or x.dtype != self.weight.dtype or x.device != self.weight.device
                or torch.is_autocast_enabled(x.device.type)):  # (F.linear then multiplies in the autocast dtype)
            return F.linear(x, self.weight, self.bias)
        try:
            return skinny_linear(x, self.weight, self.bias, config=config)
        except _BUILD_ERRORS as e:  # a recorded config this machine cannot build
            del self.configs[bucket]
            warnings.warn(f"hf_async_cb: the skinny GEMM config {config} for {tuple(self.weight.shape)} does not "
                          f"build here ({type(e).__name__}); cuBLAS runs that shape", stacklevel=2)
            return F.linear(x, self.weight, self.bias)


class _QuantizedProjection:
    """A quantized linear through one of the kernel's quantized forms for decode rows (1 to 256 of
    them, in a dtype it takes, on the weight's device); other calls run the module's own forward."""

    def __init__(self, module: nn.Module, qdata: torch.Tensor) -> None:
        self.module, self.qdata = module, qdata

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // max(1, x.shape[-1])
        if not 0 < rows <= MAX_M or not self.takes(x.dtype) or x.device != self.qdata.device:
            return self.own(x)
        return self.kernel(x)

    def takes(self, dtype: torch.dtype) -> bool:
        return dtype in _DTYPES

    def own(self, x: torch.Tensor) -> torch.Tensor:
        """The module's own forward (its class's: attach() shadows the instance's)."""
        return type(self.module).forward(self.module, x)

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class _ScaledInt8Projection(_QuantizedProjection):
    """A weight-only int8 linear (torchao's per-row Int8Tensor) through the kernel's scaled form: it
    reads the int8 weight once (a byte per weight), where the module's own path writes and reads a
    converted copy of it (five bytes per weight) every call."""

    def __init__(self, module: nn.Module, qdata: torch.Tensor, scale: torch.Tensor) -> None:
        super().__init__(module, qdata)
        self.scale = scale
        self._scales: dict[torch.dtype, torch.Tensor] = {}

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        scale = self._scales.get(x.dtype)
        if scale is None:  # as the module's own path rounds it: scale.to(x's dtype)
            scale = self._scales[x.dtype] = self.scale.to(x.dtype).reshape(-1).contiguous()
        return skinny_linear(x, self.qdata, None, scale=scale)


class _GroupedProjection(_QuantizedProjection):
    """An HQQ linear (hqq_grouped) or an optimum-quanto 4/2-bit QLinear (quanto_grouped) through the
    kernel's grouped form: it reads the packed weight as it is stored (plus a scale and a zero per
    group), where the library's own forward writes and reads a dequantized copy of the whole weight
    every call (or, quanto's bf16 int4, runs the tinygemm kernel, made for a row or two). Steps of more
    rows rebuild the whole weight in one pass by the same rule and multiply it with cuBLAS, as HQQ's and
    quanto's own dequantize-then-matmul forwards do (kernels/grouped_dequant.py). The bias is added to the
    rounded product, as both libraries add it."""

    def __init__(self, module: nn.Module, found: GroupedWeight) -> None:
        super().__init__(module, found.packed)
        self.found = found

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // max(1, x.shape[-1])
        if (rows > MAX_M and GROUPED_DENSE_ABOVE_MAX_M and self.takes(x.dtype) and x.device == self.qdata.device
                and (x.device.type == "cuda" or x.dtype != torch.bfloat16)  # (the interpreter has no bf16)
                and not torch.is_autocast_enabled(x.device.type)):
            return self.dense(x)
        return super().__call__(x)

    def dense(self, x: torch.Tensor) -> torch.Tensor:
        """x @ w.T with w rebuilt whole; a weight of more than REBUILT_ELEMENTS (a quantized lm_head) in
        slices of rows, so that no more of it is held at once."""
        f = self.found
        n, k = f.shape
        step = max(BLOCK_N, REBUILT_ELEMENTS // k // BLOCK_N * BLOCK_N)
        parts = [F.linear(x, dequantize_grouped(f.packed, f.scale, f.zero, f.group_size, bits=f.bits, shape=f.shape,
                                                dequant=f.dequant, rows=(start, min(n, start + step))))
                 for start in range(0, n, step)]
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
        if f.bias is not None:
            out += f.bias
        return out

    def takes(self, dtype: torch.dtype) -> bool:
        return dtype == self.found.scale.dtype  # the compute dtype (their own forwards take no other)

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        f = self.found
        out = skinny_linear_grouped(x, f.packed, f.scale, f.zero, f.group_size, bits=f.bits, shape=f.shape,
                                    dequant=f.dequant)
        if f.bias is not None:
            out += f.bias
        return out


class _PrescaledProjection(_QuantizedProjection):
    """An 8-bit linear scaled before its product (a frozen quanto int8/float8 QLinear: quanto_bytes;
    torchao's float8 weight-only: torchao_float8) through the kernel's pre-scaled form: it reads the
    8-bit weight once (a byte per weight), where the library writes and reads a scaled copy of the
    whole weight every call. Each weight is rounded as the library rounds `scale * weight`, and the
    bias is added to the rounded product, as the library adds it."""

    def __init__(self, module: nn.Module, found: PrescaledWeight) -> None:
        super().__init__(module, found.data)
        self.found = found

    def takes(self, dtype: torch.dtype) -> bool:
        return dtype == self.found.dtype  # (the library's own forward computes in this dtype alone)

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        f = self.found
        out = skinny_linear(x, f.data, None, row_scale=f.scale)
        if f.bias is not None:
            out += f.bias
        return out


class _Codebook4bitProjection(_QuantizedProjection):
    """A bitsandbytes nf4 / fp4 Linear4bit (bnb_4bit) through the kernel's codebook 4-bit form: it
    reads the packed codes once (half a byte per weight, plus an absmax per block), where
    bitsandbytes' own inference path on the H200 writes and reads a dequantized copy of the whole
    weight every call. As Linear4bit.forward does, x is cast to the compute dtype, each weight
    rebuilt as its dequantize rounds it, the bias (in the compute dtype) added before the product is
    rounded, and the result cast back to x's dtype. Until the module's first forward has set its
    compute dtype, or once its weight holds another quantization state (repacked, replaced), its own
    forward runs."""

    def __init__(self, module: nn.Module, found: Bnb4bit) -> None:
        super().__init__(module, found.packed)
        self.found = found
        self.buckets = _codebook_buckets(found.packed.device)

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        m, f = self.module, self.found
        if m_bucket(x.numel() // x.shape[-1]) not in self.buckets:
            return self.own(x)
        if (not getattr(m, "compute_type_is_set", False) or getattr(m.weight, "quant_state", None) is not f.state
                or getattr(f.state, "packing_format_for_cpu", False)):
            return self.own(x)
        compute = bnb_compute_dtype(m, x.dtype)
        bias = m.bias
        if compute not in _DTYPES or (bias is not None and bias.dtype != compute):
            return self.own(x)  # (its forward converts such a bias in place, once)
        out = skinny_linear_codebook_4bit(x.to(compute), f.packed, f.absmax, f.code, f.blocksize,
                                          None if bias is None else bias.detach(), round_dtype=f.round_dtype)
        return out.to(x.dtype)


class _LlmInt8Projection(_QuantizedProjection):
    """A bitsandbytes LLM.int8() Linear8bitLt (bnb_int8) through kernels/llm_int8.py: its forward's
    result, with the outlier columns flagged on the device (a CUDA graph holds it) and the int8
    weight read once. The outlier columns depend on every row: in an engine step only the step's own
    tokens count (StepMetadata.real_tokens), not a CUDA-graph bucket's padding. Its own forward runs
    in training mode off CUDA (bitsandbytes then computes another product), while a bias is not in
    x's dtype yet (the forward converts it in place, once), and once the weight holds another
    storage."""

    def __init__(self, module: nn.Module, found: BnbInt8) -> None:
        super().__init__(module, found.weight)
        self.found = found

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        m, f = self.module, self.found
        bias = m.bias
        if ((m.training and x.device.type != "cuda") or m.weight.data_ptr() != f.weight.data_ptr()
                or (bias is not None and bias.dtype != x.dtype)):
            return self.own(x)
        real = None
        meta = current_metadata()
        if meta is not None and meta.slot_mapping.numel() == x.numel() // x.shape[-1]:
            real = meta.real_tokens()
        threshold = float(getattr(m.state, "threshold", 0.0) or 0.0)
        if (threshold > 0.0) != (f.threshold > 0.0):
            return self.own(x)  # (a threshold switched on or off since: not the variants compiled)
        return llm_int8.llm_int8_linear(x, f.weight, f.scb, threshold, None if bias is None else bias.detach(),
                                        real=real)


def _codebook_buckets(device: torch.device) -> frozenset[int]:
    """The rows buckets at which a Linear4bit on `device` takes the codebook form."""
    return BNB_4BIT_CUDA_BUCKETS if device.type == "cuda" else frozenset(1 << i for i in range(MAX_M.bit_length()))


def _eligible(weight: torch.Tensor) -> bool:
    """A plain 2-D weight the kernels read as it is (never a quantized tensor subclass)."""
    return (is_plain(weight) and weight.dim() == 2 and weight.dtype in _DTYPES and weight.is_contiguous()
            and runs_on(weight.device))


class KernelPick(NamedTuple):
    """A projection routed through the kernel: weight [n, k], whether the kernel adds a bias, the
    weight's form, its configs by rows bucket, and the activations' dtype it runs in (None: any; in
    another, HQQ's or quanto's own forward runs, unless `casts`: the projection casts x to it, as
    bitsandbytes casts to its compute dtype)."""

    n: int
    k: int
    bias: bool
    form: WeightForm
    configs: dict[int, dict]
    dtype: torch.dtype | None
    casts: bool = False


class DecodeGemms:
    """The model's projections and their recorded kernel choices; see the module docstring."""

    def __init__(self, model: nn.Module, fusion=None, choice: GemmChoice | None = None) -> None:
        self.choice = choice or GemmChoice()
        fused = set() if fusion is None else {id(m) for m in fusion.members()}  # their groups' GEMMs stand in
        self._linears = [m for m in model.modules()
                         if type(m) is nn.Linear and id(m) not in fused and _eligible(m.weight)]
        self._groups = [] if fusion is None else [g for g in fusion.groups() if _eligible(g.weight)]
        self._int8 = [(m, found) for m in model.modules() if (found := scaled_int8(m)) is not None]
        self._hqq = [(m, found) for m in model.modules() if (found := hqq_grouped(m)) is not None]
        # HQQ's 3-bit words read through 4-bit copies, and quanto's tinygemm codes through copies in
        # quanto's own layout, where they all fit (model/hqq_four_bit_copy.py, model/quanto_grouped.py).
        three_bit = [(m, found) for m, found in self._hqq if takes_a_copy(found)]
        copied = [(m, w) for m in model.modules() if (w := copied_weight(m)) is not None]
        sizes = [(f.packed.device, copy_bytes(f)) for _, f in three_bit]
        sizes += [(w.device, quanto_copy_bytes(w)) for _, w in copied]
        self.copies = ([FourBitCopy(m, found) for m, found in three_bit] + [QuantoCopy(m, w) for m, w in copied]
                       if copies_fit(sizes) else [])
        self.refresh_copies()  # (made: their words' hashes in one transfer)
        by_module = {id(c.module): c.grouped for c in self.copies}
        self._hqq = [(m, by_module.get(id(m), found)) for m, found in self._hqq]
        self._quanto_grouped = [(m, found) for m in model.modules() if (found := quanto_grouped(m)) is not None]
        self._quanto_grouped += [(c.module, c.grouped) for c in self.copies if isinstance(c, QuantoCopy)]
        self._quanto = [(m, found) for m in model.modules() if (found := quanto_bytes(m)) is not None]
        self._float8 = [(m, found) for m in model.modules() if (found := torchao_float8(m)) is not None]
        self._bnb = [(m, found) for m in model.modules() if (found := bnb_4bit(m)) is not None
                     and _codebook_buckets(found.packed.device)]
        self._llm_int8 = [(m, found) for m in model.modules() if (found := bnb_int8(m)) is not None]
        self._attached: list = []
        self._by_shape: dict[tuple, dict[int, dict]] = {}  # (N, K, dtype, device) -> bucket -> config

    def shapes(self) -> set[tuple[int, int, torch.dtype, torch.device]]:
        """(N, K, dtype, device) of every covered weight."""
        weights = [m.weight for m in self._linears] + [g.weight for g in self._groups]
        return {(w.shape[0], w.shape[1], w.dtype, w.device) for w in weights}

    def _configs(self, weight: torch.Tensor) -> dict[int, dict]:
        """The recorded kernel configs of weight's shape by rows bucket, looked up once per shape (the
        projections of a shape share the dict: a config that does not build is dropped for all)."""
        key = (weight.shape[0], weight.shape[1], weight.dtype, weight.device)
        if key not in self._by_shape:
            buckets = (1 << i for i in range(MAX_M.bit_length()))
            picks = {b: self.choice.choose(b, key[0], key[1], key[2], key[3]) for b in buckets}
            self._by_shape[key] = {b: config for b, config in picks.items() if config is not None}
        return self._by_shape[key]

    def tune(self, max_rows: int) -> int:
        """Measure every covered shape at each rows bucket up to `max_rows` (at most 256) that has
        no recorded choice yet (compiles and times a few configs each: seconds per shape); returns
        how many were measured. Nothing off CUDA."""
        measured = 0
        top = m_bucket(min(max_rows, MAX_M))
        for N, K, dtype, device in sorted(self.shapes(), key=str):
            if device.type != "cuda":
                continue
            bucket = 1
            while bucket <= top:
                if not self.choice.known(bucket, N, K, dtype, _name(device)):
                    self.choice.tune(bucket, N, K, dtype, device)
                    measured += 1
                bucket *= 2
        self._by_shape.clear()  # the next attach() reads the new choices
        return measured

    def kernel_picks(self) -> list[KernelPick]:
        """Every projection attach() routes through the kernel, in its weight form (the variants
        kernels/precompile.py compiles ahead). The quantized forms run the default config at every
        bucket, with any bias added outside the kernel."""
        every_bucket = {1 << i: {} for i in range(MAX_M.bit_length())}
        picks = [KernelPick(w.shape[0], w.shape[1], b is not None, PLAIN, self._configs(w), None)
                 for w, b in [(m.weight, m.bias) for m in self._linears] + [(g.weight, g.bias) for g in self._groups]]
        picks += [KernelPick(qdata.shape[0], qdata.shape[1], False, SCALED_INT8, every_bucket, None)
                  for _, (qdata, _) in self._int8]
        picks += [KernelPick(*f.shape, False, f.form, every_bucket, f.scale.dtype)
                  for _, f in self._hqq + self._quanto_grouped]
        picks += [KernelPick(f.data.shape[0], f.data.shape[1], False, f.form, every_bucket, f.dtype)
                  for _, f in self._quanto + self._float8]
        for m, f in self._bnb:  # (the model's dtype stands for the activations')
            compute = bnb_compute_dtype(m, f.state.dtype)
            picks.append(KernelPick(f.packed.shape[0], 2 * f.packed.shape[1], m.bias is not None,
                                    bnb_4bit_form(f, compute), {b: {} for b in _codebook_buckets(f.packed.device)},
                                    compute, casts=True))
        return picks

    def llm_int8_picks(self) -> list[tuple[int, int, bool, bool]]:
        """(N, K, has a bias, has an outlier threshold) of every LLM.int8() projection attach()
        routes (kernels/llm_int8.py's variants, listed to compile ahead at every rows bucket)."""
        return [(f.weight.shape[0], f.weight.shape[1], m.bias is not None, f.threshold > 0.0)
                for m, f in self._llm_int8]

    def graph_routed_modules(self) -> list[nn.Module]:
        """The modules whose own forward no CUDA graph holds (LLM.int8()'s outliers found on the host,
        quanto's plain 4/2-bit kernels on the legacy stream) that attach() routes: their steps of up
        to MAX_M rows run the kernels, which a graph can hold (model/graph_safety.py)."""
        return [m for m, _ in self._llm_int8] + [m for m, _ in self._quanto_grouped if launches_off_stream(m.weight)]

    def wins(self) -> int:
        """How many (weight, rows bucket) pairs run the kernel (scaled int8 weights not counted)."""
        return sum(len(self._configs(m.weight)) for m in self._linears) + \
            sum(len(self._configs(g.weight)) for g in self._groups)

    def attach(self) -> None:
        """Route the covered projections through their picks (after the fused groups are attached)."""
        self.detach()
        for module in self._linears:
            configs = self._configs(module.weight)
            if configs:
                module.forward = _Projection(module.weight, module.bias, configs)
                self._attached.append(module)
        for group in self._groups:
            configs = self._configs(group.weight)
            if configs:
                group.linear = _Projection(group.weight, group.bias, configs)
                self._attached.append(group)
        for module, (qdata, scale) in self._int8:
            module.forward = _ScaledInt8Projection(module, qdata, scale)
            self._attached.append(module)
        for module, found in self._hqq + self._quanto_grouped:
            module.forward = _GroupedProjection(module, found)
            self._attached.append(module)
        for module, found in self._quanto + self._float8:
            module.forward = _PrescaledProjection(module, found)
            self._attached.append(module)
        for module, found in self._bnb:
            module.forward = _Codebook4bitProjection(module, found)
            self._attached.append(module)
        for module, found in self._llm_int8:
            module.forward = _LlmInt8Projection(module, found)
            self._attached.append(module)

    def refresh_copies(self, versions_only: bool = False) -> int:
        """Rebuild the 4-bit copies whose source changed since they were made (how many were).
        `versions_only`: only those whose words' version counter moved, or that keep none (a serving
        loop's check at each admission; its clear_prefix_cache() reads every copy's words)."""
        copies = [c for c in self.copies if c.moved()] if versions_only else self.copies
        if not copies:
            return 0
        versions = [c.version() for c in copies]  # (before the words are read: a write in between is seen next time)
        words = [c.words() for c in copies]
        flat = iter(word_hashes([w for each in words for w in each]))
        hashes = [tuple(next(flat) for _ in each) for each in words]
        orders: dict = {}  # (quanto's int4 packing read back once per shape: model/quanto_grouped.py)
        return sum(c.refresh(v, h, orders) for c, v, h in zip(copies, versions, hashes))

    def detach(self) -> None:
        for item in self._attached:
            if isinstance(item, nn.Module):
                item.__dict__.pop("forward", None)
            else:
                item.linear = None
        self._attached.clear()

    def summary(self) -> str:
        scaled = f"; {len(self._int8)} weight-only int8 projections read as int8" if self._int8 else ""
        widths = sorted({f.bits for _, f in self._hqq}, reverse=True)
        copied = {id(c.module) for c in self.copies}
        grouped = "".join(f"; {sum(f.bits == b and id(m) not in copied for m, f in self._hqq)} HQQ {b}-bit "
                          f"projections read as {b}-bit" for b in widths
                          if any(f.bits == b and id(m) not in copied for m, f in self._hqq))
        hqq_copies = [c for c in self.copies if isinstance(c, FourBitCopy)]
        if hqq_copies:
            grouped += (f"; {len(hqq_copies)} HQQ 3-bit projections read as 4-bit (copies of "
                        f"{sum(copy_bytes(c.source) for c in hqq_copies) / 2**20:.1f} MiB)")
        for bits in (4, 2):
            plain = sum(f.bits == bits and f.dequant == "scale_shift" for _, f in self._quanto_grouped)
            if plain:
                grouped += f"; {plain} quanto int{bits} projections read as {bits}-bit"
        for layout in ("tinygemm", "awq"):
            copies = [c for c in self.copies if isinstance(c, QuantoCopy) and c.layout == layout]
            if copies:
                grouped += (f"; {len(copies)} quanto int4 ({layout}) projections read as 4-bit (copies of "
                            f"{sum(quanto_copy_bytes(c.weight) for c in copies) / 2**20:.1f} MiB)")
        int8 = sum(f.data.dtype == torch.int8 for _, f in self._quanto)
        quanto = f"; {int8} quanto int8 projections read as int8" if int8 else ""
        if len(self._quanto) > int8:
            quanto += f"; {len(self._quanto) - int8} quanto float8 projections read as float8"
        if self._float8:
            quanto += f"; {len(self._float8)} torchao float8 projections read as float8"
        if self._bnb:
            buckets = sorted(set().union(*(_codebook_buckets(f.packed.device) for _, f in self._bnb)))
            rows = "" if len(buckets) == MAX_M.bit_length() else \
                f" (decode steps of {buckets[0] // 2 + 1}-{buckets[-1]} rows)"
            quanto += f"; {len(self._bnb)} bitsandbytes 4-bit projections read as 4-bit{rows}"
        if self._llm_int8:
            quanto += f"; {len(self._llm_int8)} bitsandbytes LLM.int8() projections read as int8"
        return f"skinny GEMM kernel chosen for {self.wins()} (projection, rows bucket) pairs{scaled}{grouped}{quanto}"


def _name(device: torch.device) -> str:
    from hf_async_cb.kernels.gemm_choice import device_name

    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device_name(device)
