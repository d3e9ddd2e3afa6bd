"""optimum-quanto's 4- and 2-bit weights through the skinny GEMM's grouped form.

A frozen quanto QLinear of qint4 / qint2 weights holds one of three tensors, chosen by quanto for the
device and dtype (optimum-quanto 0.2.7, `WeightQBitsTensor.create`):

- `WeightQBitsTensor` (fp32 and fp16, and bf16 groups other than 128): the codes packed along the rows
  of the grouped weight, part p of them in bits BITS * p, a float scale and shift per group; its linear
  dequantizes the whole weight, `scale * q` rounded, minus the shift, rounded, then multiplies. On CUDA
  its unpacking runs on the legacy stream, which a CUDA graph does not record (model/graph_safety.py).
  The grouped form reads its bytes and groups as they are (`quanto_grouped`, the "scale_shift" rule).
- `TinyGemmWeightQBitsTensor` (bf16, groups of 128: what an 8B bf16 model quantized to int4 holds): the
  codes in the layout of torch's int4 matmul (`_weight_int4pack_mm`, made for a row or two), which no
  other kernel reads, with its scale and zero per group. The grouped form reads a copy of the codes in
  quanto's own layout and of the groups (`QuantoCopy`, the "fma_centered" rule: (q - 8) * scale + zero).
- `AWQWeightQBitsTensor` (fp16 on CUDA, groups of 128): the codes in the interleaved layout of quanto's AWQ
  kernels, which run on the legacy stream; read through a copy alike (the "fma" rule: q * scale + its
  negated shift, rounded once, as the kernel's half-precision fma rounds).

A copy costs N * K / 2 bytes and two values a group on the device, beside the weight (which quanto's own
forward, for prefill steps and stock, keeps reading); `copies_fit` (model/hqq_four_bit_copy.py) takes the
copies only where they fit a quarter of the free memory. It is never stale: refreshed as HQQ's 3-bit
copies are, by version counters and a hash of the codes and groups (DecodeGemms.refresh_copies).

The layout of torch's int4 packing is not documented and depends on the device. `packing_order` reads
it (and AWQ's) back through the packing itself, for a block of rows: it packs the digits of every
position's index, so that each packed nibble names the weight it came from, and checks that this is a
permutation. `read_codes` applies it to every block of a weight and checks that the codes pack into the
weight's bytes again, byte for byte; `tinygemm_codes` also checks a few columns against the int4
matmul's own reading of the codes.
"""

from __future__ import annotations

import torch
from torch import nn

from hf_async_cb.kernels.skinny_gemm import runs_on
from hf_async_cb.model.quantized_linears import GroupedWeight
from hf_async_cb.model.weight_kinds import is_plain

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_QUANTO = "optimum.quanto."
ROUTED = True  # False: quanto's 4/2-bit linears run their own forward in every step (an A/B for benchmarks)


def _frozen_qbits(module: nn.Module, kind: str):
    """The weight of a frozen quanto QLinear whose weight's class is exactly `kind` (4- or 2-bit, along
    the output rows, groups along K of a power-of-two size from 16 to 256), with no activation
    quantization and no hooks, and a bias (if any) of its dtype; else None."""
    cls = type(module)
    if not ROUTED or cls.__name__ != "QLinear" or not cls.__module__.startswith(_QUANTO):
        return None
    w, bias = getattr(module, "weight", None), getattr(module, "bias", None)
    if type(w).__name__ != kind or not type(w).__module__.startswith(_QUANTO):
        return None
    if (getattr(module, "activation_qtype", None) is not None or module._forward_pre_hooks or module._forward_hooks
            or w.dim() != 2):
        return None
    bits = getattr(getattr(w, "qtype", None), "bits", None)
    n, k = w.shape
    group = _group(w)
    if not (bits in (4, 2) and getattr(w, "axis", None) == 0 and isinstance(group, int) and 16 <= group <= 256
            and group & (group - 1) == 0 and k % group == 0 and n % (8 // bits) == 0 and w.dtype in _DTYPES
            and runs_on(w.device)):
        return None
    if bias is not None and not (is_plain(bias) and bias.dtype == w.dtype and tuple(bias.shape) == (n,)
                                 and bias.device == w.device):
        return None
    return w


def _group(w) -> int:
    """A quanto weight's group along K: its group size, or K itself where it has one scale a row
    (quanto's choice for in_features of 128 or less, or without a divisor of 32 to 128)."""
    return getattr(w, "_group_size", None) or w.shape[1]


def quanto_grouped(module: nn.Module) -> GroupedWeight | None:
    """What the grouped form reads of a frozen quanto QLinear holding a plain `WeightQBitsTensor`
    (the "scale_shift" rule, its own bytes and groups, no copy), else None."""
    w = _frozen_qbits(module, "WeightQBitsTensor")
    if w is None:
        return None
    bits, group, (n, k) = w.qtype.bits, _group(w), w.shape
    packed, scale, shift = getattr(w._data, "_data", None), getattr(w, "_scale", None), getattr(w, "_shift", None)
    if not (type(w._data).__name__ == "PackedTensor" and getattr(w._data, "_bits", bits) == bits
            and isinstance(packed, torch.Tensor) and is_plain(packed) and packed.dtype == torch.uint8
            and packed.is_contiguous() and packed.numel() * (8 // bits) == n * k):
        return None
    for t in (scale, shift):  # (an integer shift is a zero-point: another rounding)
        if not (isinstance(t, torch.Tensor) and is_plain(t) and t.dtype == w.dtype and t.numel() == n * k // group
                and t.device == packed.device and t.is_contiguous()):
            return None
    bias = module.bias
    return GroupedWeight(packed.detach().reshape(n * bits // 8, k), scale.detach().reshape(-1),
                         shift.detach().reshape(-1), group, bits, None if bias is None else bias.detach(), (n, k),
                         "scale_shift")


def copied_weight(module: nn.Module):
    """The weight of a frozen quanto QLinear that a `QuantoCopy` can stand for, else None: a
    `TinyGemmWeightQBitsTensor` (bf16) with its scale and zero one pair a group, or an
    `AWQWeightQBitsTensor` (fp16 on CUDA) in its second packing with a scale and shift a group."""
    for kind, check in (("TinyGemmWeightQBitsTensor", _tinygemm_tensors), ("AWQWeightQBitsTensor", _awq_tensors)):
        w = _frozen_qbits(module, kind)
        if w is not None:
            tensors = check(w) if w.qtype.bits == 4 else None
            ok = tensors is not None and all(isinstance(t, torch.Tensor) and is_plain(t) for t in tensors)
            if ok and all(t.device == tensors[0].device for t in tensors) and _nbytes(tensors[0]) * 2 == w.numel():
                return w
    return None


def _tinygemm_tensors(w):
    """(codes, [K / group, N, 2] scale and zero pairs) of a TinyGemm weight, or None."""
    n, k = w.shape
    pairs = getattr(w, "_scale_shift", None)
    if not (isinstance(pairs, torch.Tensor) and tuple(pairs.shape) == (k // _group(w), n, 2) and pairs.dtype == w.dtype):
        return None
    return getattr(w._data, "_data", None), pairs


def _awq_tensors(w):
    """(codes, [K / group, N] scale, [K / group, N] negated shift) of an AWQ weight in its second
    packing, or None."""
    n, k = w.shape
    data, scale, shift = getattr(w._data, "_data", None), getattr(w, "_scale", None), getattr(w, "_shift", None)
    if (str(getattr(w._data, "_packing", None)) != "AWQPacking.V2" or not isinstance(data, torch.Tensor)
            or data.dtype != torch.int16):
        return None
    for t in (scale, shift):
        if not (isinstance(t, torch.Tensor) and tuple(t.shape) == (k // _group(w), n) and t.dtype == w.dtype):
            return None
    return data, scale, shift


def _nbytes(t: torch.Tensor) -> int:
    return t.element_size() * t.numel()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).reshape(-1)


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """The 4-bit fields of a packed tensor in storage order (each byte's low nibble first)."""
    b = _bytes(packed)
    return torch.stack((b & 15, b >> 4), dim=1).reshape(-1)


def _pack_like_tinygemm(codes: torch.Tensor) -> torch.Tensor:
    """torch's int4 packing of uint8 codes [N, K] on their device, as quanto packs them."""
    from optimum.quanto.tensor.weights.tinygemm.packed import TinyGemmPackedTensor

    return TinyGemmPackedTensor.pack(codes)._data


def _pack_like_awq(codes: torch.Tensor) -> torch.Tensor:
    """quanto's second AWQ packing of uint8 codes [N, K] (CUDA only)."""
    from optimum.quanto.tensor.weights.awq.packed import pack_v2

    return pack_v2(codes)


PACKINGS = {"tinygemm": _pack_like_tinygemm, "awq": _pack_like_awq}


@torch.no_grad()
def packing_order(layout: str, n: int, k: int, device: torch.device) -> torch.Tensor:
    """For each 4-bit field of `layout`'s packing (PACKINGS) of an [n, k] weight on `device`, in
    storage order, the flat index (row * k + column) of the code it holds: the packing of each hex
    digit of every index, read back. Raises RuntimeError where the packing is not a permutation."""
    count = n * k
    kind = torch.int32 if count < 1 << 31 else torch.int64
    index = torch.arange(count, device=device, dtype=kind)
    order = torch.zeros(count, device=device, dtype=kind)
    for digit in range(0, max(1, (count - 1).bit_length()), 4):
        codes = ((index >> digit) & 15).to(torch.uint8).reshape(n, k)
        order |= _nibbles(PACKINGS[layout](codes)).to(kind) << digit
    del index
    seen = torch.zeros(count, dtype=torch.bool, device=device)
    if order.numel() == count and bool((order >= 0).all()) and bool((order < count).all()):
        seen[order] = True  # (count indices in range covering every position: a permutation)
    if not bool(seen.all()):
        raise RuntimeError(f"quanto's {layout} packing of a ({n}, {k}) weight on {device} is not a permutation "
                           f"of its codes")
    return order


REPACK_BYTES = 1 << 26  # codes re-packed at once by read_codes' check (bounds its temporaries)


def _probe_rows(n: int) -> int:
    """The rows whose packing is read back for an [n, k] weight: a block of at most 256 rows that
    divides n (the packings place blocks of 8 (tinygemm) or 4 (AWQ) rows after one another)."""
    return next((r for r in (256, 128, 64, 32, 16, 8) if n % r == 0), n)


@torch.no_grad()
def read_codes(layout: str, data: torch.Tensor, n: int, k: int, orders: dict | None = None) -> torch.Tensor:
    """The 4-bit codes [n, k] (uint8) that `layout`'s packing turned into `data`. The order is read
    back for a block of rows (`packing_order`, kept in `orders` by (layout, rows, k, device)) and
    applied to every block; the codes must then pack into `data` again, byte for byte (packed a slice
    of rows at a time). Where they do not (a packing whose blocks are larger), the whole weight's order
    is read back instead; RuntimeError if its codes do not pack into `data` either."""
    orders = {} if orders is None else orders
    nibbles = _nibbles(data)
    rows = _probe_rows(n)
    for attempt in range(2):
        key = (layout, rows, k, data.device)
        if attempt or key not in orders:  # (the second time the whole weight's, read afresh)
            orders[key] = packing_order(layout, rows, k, data.device)
        codes = torch.empty(n // rows, rows * k, dtype=torch.uint8, device=data.device)
        codes[:, orders[key]] = nibbles.reshape(n // rows, rows * k)
        codes = codes.reshape(n, k)
        step = max(rows, REPACK_BYTES // k // rows * rows)
        packed = _bytes(data)
        if all(torch.equal(_bytes(PACKINGS[layout](codes[first:first + step])),
                           packed[first * k // 2:(first + step) * k // 2]) for first in range(0, n, step)):
            return codes
        rows = n
    raise RuntimeError(f"quanto's {layout} packing of a ({n}, {k}) weight on {data.device} could not be read back")


@torch.no_grad()
def tinygemm_codes(w, orders: dict | None = None) -> torch.Tensor:
    """The 4-bit codes [N, K] (uint8) of a TinyGemmWeightQBitsTensor (read_codes), checked as well
    against the int4 matmul's own reading of 16 of its columns (an identity's rows times the codes:
    RuntimeError if they differ)."""
    n, k = w.shape
    data = w._data._data
    codes = read_codes("tinygemm", data, n, k, orders)
    columns = torch.linspace(0, k - 1, 16, device=data.device).long()
    eye = torch.zeros(16, k, dtype=torch.bfloat16, device=data.device)
    eye[torch.arange(16, device=data.device), columns] = 1
    unit = torch.ones(k // 32, n, 2, dtype=torch.bfloat16, device=data.device)
    unit[:, :, 1] = 8  # ((q - 8) * 1 + 8: each code as it is)
    if data.device.type == "cpu":
        read = torch._weight_int4pack_mm_for_cpu(eye, data, 32, unit)
    else:
        read = torch._weight_int4pack_mm(eye, data, 32, unit)
    if not torch.equal(read.t().to(torch.uint8), codes[:, columns]):
        raise RuntimeError("the codes read back from torch's int4 packing differ from its matmul's")
    return codes


def quanto_copy_bytes(weight) -> int:
    """The device bytes a QuantoCopy of `weight` takes: half a byte a weight, two values a group."""
    n, k = weight.shape
    return n * k // 2 + 2 * (n * k // _group(weight)) * weight.element_size()


class QuantoCopy:
    """The grouped form's copy of one quanto TinyGemm or AWQ weight (codes in quanto's own 4-bit layout,
    scales and zeros per group in its dtype), and the state of the tensors it was made from. The
    interface of hqq_four_bit_copy.FourBitCopy: DecodeGemms refreshes both alike."""

    def __init__(self, module: nn.Module, weight) -> None:
        self.module, self.weight = module, weight
        self.layout = "tinygemm" if type(weight).__name__.startswith("TinyGemm") else "awq"
        n, k = weight.shape
        device = weight._data._data.device
        groups = n * k // _group(weight)
        self.packed = torch.empty(n // 2, k, dtype=torch.uint8, device=device)
        self.scale = torch.empty(groups, dtype=weight.dtype, device=device)
        self.zero = torch.empty(groups, dtype=weight.dtype, device=device)
        self._made_from: tuple | None = None

    @property
    def grouped(self) -> GroupedWeight:
        """What the grouped form reads: the copy, by tinygemm's rule ((q - 8) * scale + zero) or AWQ's
        kernel's (q * scale + its negated shift), each rounded once."""
        bias = self.module.bias
        return GroupedWeight(self.packed, self.scale, self.zero, _group(self.weight), 4,
                             None if bias is None else bias.detach(), tuple(self.weight.shape),
                             "fma_centered" if self.layout == "tinygemm" else "fma")

    def _sources(self) -> tuple:
        """(codes, groups...) of the weight, as copied_weight checked them."""
        found = (_tinygemm_tensors if self.layout == "tinygemm" else _awq_tensors)(self.weight)
        if found is None:
            raise RuntimeError(f"the quanto {self.layout} weight of {type(self.module).__name__} no longer holds "
                               f"the tensors its copy was made from")
        return found

    def words(self) -> list[torch.Tensor]:
        """The tensors the copy is made from, as 2-D integer views (for word_hashes)."""
        data, *groups = self._sources()
        return [data.reshape(data.shape[0], -1)] + [g.view(torch.int16).reshape(g.shape[0], -1) for g in groups]

    def version(self) -> tuple | None:
        tensors = self._sources()
        return None if any(t.is_inference() for t in tensors) else tuple(t._version for t in tensors)

    def moved(self) -> bool:
        version = self.version()
        return version is None or self._made_from is None or version != self._made_from[0]

    @torch.no_grad()
    def refresh(self, version: tuple | None, words_hash: tuple, orders: dict | None = None) -> bool:
        """Rebuild the copy in place unless `version` and `words_hash` are those it was made from;
        True if it was rebuilt (the device synchronized around the write, as FourBitCopy's). `orders`:
        the packings' orders read back (read_codes), shared by the copies one refresh rebuilds."""
        made = self._made_from
        if made is not None and words_hash == made[1] and (version is None or version == made[0]):
            return False
        w, device = self.weight, self.packed.device
        n, k = w.shape
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        data, *groups = self._sources()
        if self.layout == "tinygemm":
            codes = tinygemm_codes(w, orders)
            scale, zero = groups[0][:, :, 0], groups[0][:, :, 1]  # ([K / group, N, 2])
        else:
            codes = read_codes("awq", data, n, k, orders)
            scale, zero = groups  # ([K / group, N] each; the shift negated: q * scale + shift)
        self.packed.copy_(codes[: n // 2] | (codes[n // 2:] << 4))
        self.scale.copy_(scale.t().reshape(-1))
        self.zero.copy_(zero.t().reshape(-1))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        self._made_from = (version, words_hash)
        return True
