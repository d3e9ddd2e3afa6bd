"""HQQ's 3-bit weights read through a 4-bit copy, kept in step with them.

HQQ's "3bit_32" packing holds ten 3-bit fields in each int32 word, taken from ten parts of the weight a
tenth of it apart. A decode GEMM program computes a few neighbouring output rows, so of each word it
reads it uses one field: four bytes moved per weight where the packing holds 3/8 of one (on the H100,
8B at 3 bits ran at 0.026 of the bandwidth floor, 1.5x stock, where 4-bit ran at 12x). A copy of the
same values in HQQ's own 4-bit layout ("4bit_u8": row n < N / 2 in the high nibbles of row n, the
others in the low ones) is read by the grouped form's 4-bit path: half a byte per weight, and the same
weights rebuilt (HQQ's dequantize is (q - zero) * scale at any width), so the same products.

What it costs: N * K / 2 bytes on the device per projection, beside HQQ's own words (which its own
forward, and stock, keep reading). `copies_fit` takes the copies only where all of them together use at
most a quarter of the device's free memory; else the words are read as they are (slow, no memory).

A copy is never stale: `FourBitCopy.refresh` rebuilds it, in place (CUDA graphs read its storage), when
its source's contents changed since it was made (`weight_kinds.content_sums`, which also sees writes
through `.data` or a collective that bump no version counter). DecodeGemms.refresh_copies runs it once
per engine call (Engine.check_caches) and, from a serving loop, at each admission after a write that
bumped a version counter and at each `clear_prefix_cache()`.
"""

from __future__ import annotations

import torch
from torch import nn

from hf_async_cb.model.quantized_linears import HqqGrouped
from hf_async_cb.model.weight_kinds import content_sums

FREE_MEMORY_SHARE = 0.25  # the most of the device's free memory the copies may take together


def copy_bytes(found: HqqGrouped) -> int:
    """The device bytes a 4-bit copy of `found` takes."""
    n, k = found.shape
    return n * k // 2


def takes_a_copy(found: HqqGrouped) -> bool:
    """Whether `found` (a 3-bit HQQ projection) can be read through a 4-bit copy: HQQ's 4-bit layout
    holds whole rows in each nibble, so N must be even."""
    return found.bits == 3 and found.shape[0] % 2 == 0


def copies_fit(found: list[HqqGrouped]) -> bool:
    """Whether 4-bit copies of every projection in `found` fit in FREE_MEMORY_SHARE of their device's
    free memory (always off CUDA: the interpreter's tests)."""
    if not found:
        return False
    device = found[0].packed.device
    if device.type != "cuda":
        return True
    free = torch.cuda.mem_get_info(device)[0]
    return sum(copy_bytes(f) for f in found) <= FREE_MEMORY_SHARE * free


@torch.no_grad()
def unpack_three_bit(found: HqqGrouped) -> torch.Tensor:
    """The weight's 3-bit values [N, K] (uint8) from HQQ's "3bit_32" words [step, group]: part p of
    the flat groups [N * K / group, group] sits in bits 27 - 3p of the words, group r of the weight at
    word row r - p * step (the last part padded past the weight's groups)."""
    n, k = found.shape
    words = found.packed
    shifts = torch.arange(27, -1, -3, device=words.device, dtype=torch.int32).view(10, 1, 1)
    fields = ((words.unsqueeze(0) >> shifts) & 7).to(torch.uint8)  # [10, step, group]
    return fields.reshape(-1, found.group_size)[: n * k // found.group_size].reshape(n, k)


@torch.no_grad()
def pack_four_bit(values: torch.Tensor) -> torch.Tensor:
    """[N, K] values below 16 in HQQ's "4bit_u8" layout [N / 2, K]: rows n < N / 2 in the high nibbles."""
    half = values.shape[0] // 2
    return (values[:half] << 4) | values[half:]


class FourBitCopy:
    """The 4-bit copy of one 3-bit HQQ projection, and what it was made from."""

    def __init__(self, module: nn.Module, found: HqqGrouped) -> None:
        self.module, self.source = module, found
        self.copy = pack_four_bit(unpack_three_bit(found))
        self._made_from = self.contents([found.packed])[0]

    @property
    def grouped(self) -> HqqGrouped:
        """What the grouped form reads instead of `source`: the copy, at 4 bits."""
        return self.source._replace(packed=self.copy, bits=4)

    @staticmethod
    def contents(words: list[torch.Tensor]) -> list:
        """content_sums of each source's words, in one transfer."""
        return list(content_sums(words))

    def version(self) -> int | None:
        """The source's version counter; None for an inference tensor (HQQ makes its words under
        `torch.inference_mode()`), which keeps none: only a content reading sees its writes."""
        words = self.source.packed
        return None if words.is_inference() else words._version

    def refresh(self, contents) -> bool:
        """Rebuild the copy in place if `contents` (this source's content_sums now) differ from what it
        was made from; True if it was rebuilt. On CUDA the device is synchronized around the write: a
        step of a serving loop may be reading the copy, and the next one must read the new values."""
        if contents == self._made_from:
            return False
        device = self.copy.device
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        self.copy.copy_(pack_four_bit(unpack_three_bit(self.source)))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        self._made_from = contents
        return True
