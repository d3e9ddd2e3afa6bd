"""What the skinny GEMM's quantized forms read of each library's quantized linear, and when a module
qualifies: a picker per library returns the tensors (and the rounding) the kernel reproduces the
library's own forward with, or None where anything differs (its own forward then runs, as in stock).

- `scaled_int8`: torchao's weight-only int8 (the scaled int8 form);
- `hqq_grouped`: HQQ's HQQLinear at 8, 6, 5, 4, 3, 2 or 1 bits (the grouped form);
- `quanto_bytes`, `torchao_float8`: optimum-quanto's frozen int8/float8 QLinear, torchao's weight-only
  float8 (the pre-scaled form);
- `bnb_4bit`: bitsandbytes' nf4 / fp4 Linear4bit (the codebook 4-bit form);
- `bnb_int8`: bitsandbytes' LLM.int8() Linear8bitLt (kernels/llm_int8.py, not a skinny GEMM form).

model/decode_gemm.py routes the modules these pick through the kernels for decode steps.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from hf_async_cb.kernels.skinny_gemm import runs_on
from hf_async_cb.kernels.skinny_gemm_forms import PRESCALED_WEIGHTS, WeightForm, grouped_word, grouped_words
from hf_async_cb.model.weight_kinds import is_plain

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def scaled_int8(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(int8 weight [N, K], scale per row) of a bias-free nn.Linear whose weight is torchao's
    weight-only int8 tensor with one scale per output row (Int8WeightOnlyConfig's default: an
    Int8Tensor, or before torchao 0.18 an AffineQuantizedTensor in the plain layout, whose linear
    rounds alike), else None: whatever else it holds (activation quantization, pre-scales, groups,
    other layouts) runs its own path."""
    w = getattr(module, "weight", None)
    if type(module) is not nn.Linear or module.bias is not None:
        return None
    kind = type(w).__name__
    if kind == "Int8Tensor":
        if getattr(w, "act_quant_kwargs", None) is not None or getattr(w, "act_pre_scale", None) is not None:
            return None
        qdata, scale = getattr(w, "qdata", None), getattr(w, "scale", None)
    elif kind == "AffineQuantizedTensor":
        impl = getattr(w, "tensor_impl", None)
        if (type(impl).__name__ != "PlainAQTTensorImpl" or type(getattr(w, "_layout", None)).__name__ != "PlainLayout"
                or not str(getattr(w, "zero_point_domain", "")).endswith("INT")):
            return None
        qdata, scale = getattr(impl, "int_data", None), getattr(impl, "scale", None)
    else:
        return None
    if not (isinstance(qdata, torch.Tensor) and isinstance(scale, torch.Tensor) and qdata.dtype == torch.int8
            and qdata.dim() == 2 and qdata.is_contiguous() and scale.numel() == qdata.shape[0]
            and scale.is_floating_point() and list(getattr(w, "block_size", ())) == [1, qdata.shape[1]]
            and runs_on(qdata.device)):
        return None
    return qdata, scale


class GroupedWeight(NamedTuple):
    """What the grouped form reads of an HQQ linear, or of optimum-quanto's 4- and 2-bit weights
    (skinny_linear_grouped's arguments)."""

    packed: torch.Tensor  # uint8 [N * bits / 8, K]: 8 / bits parts of the rows, the first in the highest
    # bits (quanto's: in the lowest); at 3 bits HQQ's int32 words [ceil(N * K / group_size / 10), group_size]
    scale: torch.Tensor  # [N * K / group_size], the library's compute dtype
    zero: torch.Tensor  # the same
    group_size: int
    bits: int  # 8, 4, 3, 2 or 1 (GROUPED_BITS): the packing's field width
    bias: torch.Tensor | None
    shape: tuple[int, int]  # the weight's (N, K)
    dequant: str = "hqq"  # the rule that rebuilds a weight (skinny_gemm_forms.GROUPED_DEQUANTS)

    @property
    def form(self) -> WeightForm:
        return WeightForm(grouped_word(self.bits), self.group_size, bits=self.bits, dequant=self.dequant)


_HQQ_OWN_FORWARDS = ("forward_pytorch", "forward_pytorch_backprop")  # matmul(x, dequantize().t()) (+= bias)
# HQQ's packings the grouped form reads, by the field width they hold (nbits 5 and 6 pack as 8 bits, 1.58
# as 2; "3bit_32": ten 3-bit fields an int32).
_HQQ_PACKINGS = {"8bit_u8": 8, "4bit_u8": 4, "3bit_32": 3, "2bit_u8": 2, "1bit_u8": 1}


def hqq_grouped(module: nn.Module) -> GroupedWeight | None:
    """The packed weight, scales and zeros of an hqq HQQLinear (hqq 0.2.8) that the grouped form
    reproduces exactly, else None. Taken: weights packed as "8bit_u8", "4bit_u8", "3bit_32", "2bit_u8"
    or "1bit_u8" (nbits 8, 6, 5, 4, 3, 2, 1.58, 1; not viewed as float), the byte packings' parts whole
    rows (out_features a multiple of 8 / bits), groups along the input dimension (axis=1) of a
    power-of-two size from 16 to 256 dividing in_features, scale and zero plain tensors of the
    compute dtype (not quantized, not offloaded), a bias (if any) of the compute dtype, and HQQ's
    eager PyTorch backend (its default: dequantize, then matmul), whose rounding the kernel repeats.
    Anything else (axis=0, quantized or offloaded meta-data, the compiled or ATen backends) runs
    HQQ's own forward."""
    cls = type(module)
    if cls.__name__ != "HQQLinear" or not cls.__module__.startswith("hqq.") or not getattr(module, "ready", False):
        return None
    if not any(cls.forward is getattr(cls, name, None) for name in _HQQ_OWN_FORWARDS):
        return None
    meta, packed, bias = getattr(module, "meta", None), getattr(module, "W_q", None), getattr(module, "bias", None)
    if not isinstance(meta, dict) or not isinstance(packed, torch.Tensor):
        return None
    bits = _HQQ_PACKINGS.get(meta.get("packing"))
    if (bits is None or meta.get("axis") != 1 or meta.get("view_as_float") or meta.get("quant_zero")
            or meta.get("quant_scale") or "zero_scale" in meta):
        return None
    scale, zero, shape, group = meta.get("scale"), meta.get("zero"), meta.get("shape"), meta.get("group_size")
    dtype = meta.get("compute_dtype", torch.float16)  # what Quantizer.dequantize computes in
    if not (isinstance(scale, torch.Tensor) and isinstance(zero, torch.Tensor) and shape is not None
            and len(shape) == 2 and isinstance(group, int)):
        return None
    N, K = shape
    if bits == 3:  # ten parts of the flat groups, the last padded: ceil(N * K / group / 10) words a column
        whole = isinstance(group, int) and group > 0 and packed.numel() == grouped_words(3, N, K, group)
    else:
        whole = N % (8 // bits) == 0 and packed.numel() * (8 // bits) == N * K
    if not (whole and 16 <= group <= 256 and group & (group - 1) == 0 and K % group == 0
            and packed.dtype == grouped_word(bits) and packed.is_contiguous() and dtype in _DTYPES
            and runs_on(packed.device)):
        return None
    for t in (scale, zero):
        if (not is_plain(t) or t.dtype != dtype or t.numel() != N * K // group or t.device != packed.device
                or not t.is_contiguous()):
            return None
    if bias is not None and not (isinstance(bias, torch.Tensor) and is_plain(bias) and bias.dtype == dtype
                                 and tuple(bias.shape) == (N,) and bias.device == packed.device):
        return None
    packed = packed.detach() if bits == 3 else packed.detach().reshape(N * bits // 8, K)
    return GroupedWeight(packed, scale.reshape(-1), zero.reshape(-1), group, bits, None if bias is None else bias.detach(),
                      (N, K))


class PrescaledWeight(NamedTuple):
    """What the pre-scaled form reads of an 8-bit linear (skinny_linear's `row_scale` form)."""

    data: torch.Tensor  # int8 or float8_e4m3fn [N, K]
    scale: torch.Tensor  # [N], one per output row: the compute dtype (quanto) or float32 (torchao)
    bias: torch.Tensor | None
    dtype: torch.dtype  # the activations' dtype the library computes in

    @property
    def form(self) -> WeightForm:
        wide = self.scale.dtype == torch.float32 and self.dtype != torch.float32
        return WeightForm(self.data.dtype, prescaled=True, scale_dtype=torch.float32 if wide else None)


def quanto_bytes(module: nn.Module) -> PrescaledWeight | None:
    """The 8-bit weight and row scales of a frozen optimum-quanto QLinear (quanto 0.2.7) whose forward
    is qbytes_mm's `matmul(x, (scale * weight.to(dtype)).t())` (+ bias), else None. Taken: a
    WeightQBytesTensor (exactly: not the Marlin fp8 subclass) of qint8 or qfloat8_e4m3fn data [N, K],
    plain and contiguous, quantized along the output rows (axis 0) with a plain [N, 1] scale of a
    float dtype, no activation quantization (no input or output hooks), a bias (if any) of the
    scale's dtype. Anything else (unfrozen modules, 2/4-bit weights, other float8 kinds, quantized
    activations) runs quanto's own forward."""
    cls = type(module)
    if cls.__name__ != "QLinear" or not cls.__module__.startswith("optimum.quanto."):
        return None
    w, bias = getattr(module, "weight", None), getattr(module, "bias", None)
    if type(w).__name__ != "WeightQBytesTensor" or not type(w).__module__.startswith("optimum.quanto."):
        return None
    if (getattr(module, "activation_qtype", None) is not None or getattr(w, "activation_qtype", None) is not None
            or module._forward_pre_hooks or module._forward_hooks):
        return None
    data, scale = getattr(w, "_data", None), getattr(w, "_scale", None)
    if not (isinstance(data, torch.Tensor) and isinstance(scale, torch.Tensor) and is_plain(data) and is_plain(scale)):
        return None
    if not (getattr(w, "axis", None) == 0 and getattr(getattr(w, "qtype", None), "dtype", None) == data.dtype
            and data.dtype in PRESCALED_WEIGHTS and data.dim() == 2 and data.is_contiguous()
            and tuple(data.shape) == tuple(w.shape) and scale.dtype in _DTYPES and scale.dtype == w.dtype
            and tuple(scale.shape) == (data.shape[0], 1) and scale.device == data.device and runs_on(data.device)):
        return None
    if bias is not None and not (isinstance(bias, torch.Tensor) and is_plain(bias) and bias.dtype == scale.dtype
                                 and tuple(bias.shape) == (data.shape[0],) and bias.device == data.device):
        return None
    return PrescaledWeight(data.detach(), scale.detach().reshape(-1).contiguous(),
                           None if bias is None else bias.detach(), scale.dtype)


def torchao_float8(module: nn.Module) -> PrescaledWeight | None:
    """The float8 weight and row scales of an nn.Linear whose weight is torchao's weight-only float8
    tensor (Float8WeightOnlyConfig: a Float8Tensor of float8_e4m3fn data [N, K], one float32 scale
    per output row, no activation quantization), else None. Its linear is
    `matmul(x, (data.float() * scale).to(dtype).t())` (+ bias): the pre-scaled form with float32
    scales. Anything else (activation quantization, other granularities or float8 kinds) runs
    torchao's own path."""
    w = getattr(module, "weight", None)
    if type(module) is not nn.Linear or type(w).__name__ != "Float8Tensor":
        return None
    if getattr(w, "act_quant_kwargs", None) is not None:
        return None
    data, scale, dtype = getattr(w, "qdata", None), getattr(w, "scale", None), getattr(w, "dtype", None)
    if not (isinstance(data, torch.Tensor) and isinstance(scale, torch.Tensor) and is_plain(data) and is_plain(scale)):
        return None
    if not (data.dtype == torch.float8_e4m3fn and data.dim() == 2 and data.is_contiguous()
            and tuple(data.shape) == tuple(w.shape) and list(getattr(w, "block_size", ())) == [1, data.shape[1]]
            and scale.dtype == torch.float32 and scale.numel() == data.shape[0] and dtype in _DTYPES
            and scale.device == data.device and runs_on(data.device)):
        return None
    bias = module.bias
    if bias is not None and not (is_plain(bias) and bias.dtype == dtype and bias.device == data.device):
        return None
    return PrescaledWeight(data.detach(), scale.detach().reshape(-1).contiguous(),
                           None if bias is None else bias.detach(), dtype)


class Bnb4bit(NamedTuple):
    """What the codebook 4-bit form reads of a bitsandbytes Linear4bit (skinny_linear_codebook_4bit's
    arguments), and the quantization state it was read from (the module's own forward runs once the
    weight holds another)."""

    packed: torch.Tensor  # uint8 [N, K / 2]: weight (n, 2j) in the high nibble of byte (n, j)
    absmax: torch.Tensor  # float32 [N * K / blocksize] (a nested absmax dequantized once, as bitsandbytes does)
    code: torch.Tensor  # float32 [16]: nf4's or fp4's values
    blocksize: int
    round_dtype: torch.dtype | None  # what the rebuilt weights round to first (None: the compute dtype)
    state: object  # the QuantState read


def _bnb_rounds_to_compute_dtype() -> bool:
    """Whether this bitsandbytes' inference matmul dequantizes straight to the compute dtype (its
    `gemm_4bit` op, 0.49 on), rather than to the model's dtype and then converting (MatMul4Bit)."""
    ops = getattr(torch.ops, "bitsandbytes", None)
    try:
        return ops is not None and hasattr(ops, "gemm_4bit")
    except (AttributeError, RuntimeError):
        return False


def bnb_4bit(module: nn.Module) -> Bnb4bit | None:
    """The packed codes, absmax and code table of a bitsandbytes Linear4bit (nf4 or fp4; bitsandbytes
    0.48 to 0.50) that the codebook 4-bit form reproduces, else None. Taken: the class's own forward
    (Linear4bit, LinearNF4, LinearFP4: not PEFT's wrappers), no hooks, a Params4bit weight of uint8
    storage in the canonical layout (not repacked for the CPU), blocks of a power of two from 16 to
    256 dividing in_features, a float32 or nested (uint8 with a second state) absmax, the model's
    dtype a float one. The compute dtype and the bias are read per call (DecodeGemms' projection):
    bitsandbytes sets the former at the module's first forward."""
    cls = type(module)
    if cls.__name__ not in ("Linear4bit", "LinearNF4", "LinearFP4") or not cls.__module__.startswith("bitsandbytes."):
        return None
    if module._forward_pre_hooks or module._forward_hooks:
        return None
    w = getattr(module, "weight", None)
    state = getattr(w, "quant_state", None)
    if type(w).__name__ != "Params4bit" or state is None or getattr(state, "packing_format_for_cpu", False):
        return None
    shape, blocksize, code = getattr(state, "shape", None), getattr(state, "blocksize", None), getattr(state, "code", None)
    if state.quant_type not in ("nf4", "fp4") or shape is None or len(shape) != 2 or not isinstance(blocksize, int):
        return None
    N, K = shape
    data = w.data
    if not (data.dtype == torch.uint8 and data.is_contiguous() and data.numel() * 2 == N * K and K % 2 == 0
            and 16 <= blocksize <= 256 and blocksize & (blocksize - 1) == 0 and K % blocksize == 0
            and state.dtype in _DTYPES and isinstance(code, torch.Tensor) and code.numel() == 16
            and code.device == data.device and runs_on(data.device)):
        return None
    absmax = state.absmax
    if getattr(state, "nested", False):
        import bitsandbytes.functional as bnb_functional

        if state.state2 is None or absmax.dtype != torch.uint8 or getattr(state.state2, "blocksize", None) != 256:
            return None  # (bitsandbytes' own matmul takes nested blocks of 256 alone)
        absmax = bnb_functional.dequantize_blockwise(absmax, state.state2) + state.offset  # (as its matmul does)
    if absmax.dtype != torch.float32 or absmax.numel() != N * K // blocksize or absmax.device != data.device:
        return None
    return Bnb4bit(data.detach().view(N, K // 2), absmax.detach().float().reshape(-1).contiguous(),
                   code.detach().float().contiguous(), blocksize,
                   None if _bnb_rounds_to_compute_dtype() else state.dtype, state)


def bnb_compute_dtype(module: nn.Module, dtype: torch.dtype) -> torch.dtype:
    """The dtype a Linear4bit computes in for activations in `dtype`: its compute_dtype, which its
    first forward replaces by the activations' dtype when that is fp32 or bf16 (set_compute_type)."""
    if not getattr(module, "compute_type_is_set", True) and dtype in (torch.float32, torch.bfloat16):
        return dtype
    return getattr(module, "compute_dtype", None) or dtype


def bnb_4bit_form(found: Bnb4bit, compute_dtype: torch.dtype) -> WeightForm:
    """The codebook form's record for a picked Linear4bit computing in `compute_dtype`."""
    round_dtype = None if found.round_dtype in (None, compute_dtype) else found.round_dtype
    return WeightForm(torch.uint8, found.blocksize, codebook=True, round_dtype=round_dtype)


class BnbInt8(NamedTuple):
    """What the LLM.int8() kernels read of a bitsandbytes Linear8bitLt (llm_int8_linear's arguments)."""

    weight: torch.Tensor  # int8 [N, K]: the module's CB (its weight's storage)
    scb: torch.Tensor  # float32 [N]: a scale per output row (SCB)
    threshold: float  # the outlier threshold (0: none)


def bnb_int8(module: nn.Module) -> BnbInt8 | None:
    """The int8 weight, row scales and threshold of a bitsandbytes Linear8bitLt (0.45 to 0.50) in
    inference (its weight quantized, `has_fp16_weights` off) that kernels/llm_int8.py reproduces,
    else None. Taken: the class's own forward, no hooks, an Int8Params weight whose storage is its
    CB (int8 [N, K], contiguous) with float32 SCB [N], a threshold of 0 or a value fp16 holds exactly
    (the module compares in fp16). Anything else (fp16 weights being trained, hooks, other layouts)
    runs its own forward. Training mode off CUDA and a bias not yet in x's dtype are checked per
    call (DecodeGemms' projection)."""
    cls = type(module)
    if cls.__name__ != "Linear8bitLt" or not cls.__module__.startswith("bitsandbytes."):
        return None
    if module._forward_pre_hooks or module._forward_hooks:
        return None
    w, state = getattr(module, "weight", None), getattr(module, "state", None)
    if type(w).__name__ != "Int8Params" or state is None or getattr(state, "has_fp16_weights", True):
        return None
    cb = state.CB if getattr(state, "CB", None) is not None else getattr(w, "CB", None)
    scb = state.SCB if getattr(state, "SCB", None) is not None else getattr(w, "SCB", None)
    threshold = float(getattr(state, "threshold", 0.0) or 0.0)
    if not (isinstance(cb, torch.Tensor) and isinstance(scb, torch.Tensor) and is_plain(cb) and is_plain(scb)):
        return None
    if not (cb.dtype == torch.int8 and cb.dim() == 2 and cb.is_contiguous() and cb.data_ptr() == w.data_ptr()
            and scb.dtype == torch.float32 and scb.numel() == cb.shape[0] and scb.device == cb.device
            and runs_on(cb.device) and threshold >= 0.0
            and float(torch.tensor(threshold, dtype=torch.float16)) == threshold):
        return None
    bias = module.bias
    if bias is not None and not (is_plain(bias) and tuple(bias.shape) == (cb.shape[0],) and bias.device == cb.device):
        return None
    return BnbInt8(cb.detach(), scb.detach().reshape(-1), threshold)
