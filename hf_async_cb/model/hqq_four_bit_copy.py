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

A copy is never stale: `FourBitCopy.refresh` rebuilds it in place (CUDA graphs read its storage) when
its source's version counter moved (a write in place: `copy_`, an optimizer step, `load_state_dict`) or
its words' hash changed (`word_hashes`: writes through `.data`, a collective, or into an inference
tensor, which keeps no counter). The hash weighs every word by a random odd 64-bit number for its column
and another for its row, so that a write which only moves words within a row, or changes two fields by
+1 and -1, changes it too (weight_kinds.content_sums, the prefix cache's, sums each row's words as they
are and would not see those). DecodeGemms.refresh_copies runs it once per engine call
(Engine.check_caches); a serving loop checks the counters at each admission (and hashes the words of
sources without one) and everything at each `clear_prefix_cache()`.
"""

from __future__ import annotations

import torch
from torch import nn

from hf_async_cb.model.quantized_linears import GroupedWeight

FREE_MEMORY_SHARE = 0.25  # the most of the device's free memory the copies may take together


def copy_bytes(found: GroupedWeight) -> int:
    """The device bytes a 4-bit copy of `found` takes."""
    n, k = found.shape
    return n * k // 2


def takes_a_copy(found: GroupedWeight) -> bool:
    """Whether `found` (a 3-bit HQQ projection) can be read through a 4-bit copy: HQQ's 4-bit layout
    holds whole rows in each nibble, so N must be even."""
    return found.bits == 3 and found.shape[0] % 2 == 0


def copies_fit(sizes: list[tuple[torch.device, int]]) -> bool:
    """Whether copies of these (device, bytes) sizes (this module's, quanto_grouped's) fit in
    FREE_MEMORY_SHARE of their device's free memory (always off CUDA: the interpreter's tests)."""
    if not sizes:
        return False
    needed: dict[torch.device, int] = {}
    for device, size in sizes:  # (a model spread over several devices: each one's copies against its own memory)
        needed[device] = needed.get(device, 0) + size
    return all(device.type != "cuda" or size <= FREE_MEMORY_SHARE * torch.cuda.mem_get_info(device)[0]
               for device, size in needed.items())


ROWS_AT_ONCE = 1 << 24  # weights unpacked at once while a copy is made (bounds its temporaries)


@torch.no_grad()
def three_bit_rows(found: GroupedWeight, first: int, last: int) -> torch.Tensor:
    """The 3-bit values [last - first, K] (uint8) of the weight's rows first..last - 1 from HQQ's
    "3bit_32" words [step, group]: part p of the flat groups [N * K / group, group] sits in bits
    27 - 3p of the words, group g at word row g - p * step (the last part padded past the weight)."""
    n, k = found.shape
    words, group = found.packed, found.group_size
    step = words.shape[0]
    groups = torch.arange(first * (k // group), last * (k // group), device=words.device)
    part = groups // step
    shift = (27 - 3 * part).to(torch.int32).unsqueeze(1)
    return ((words[groups - part * step] >> shift) & 7).to(torch.uint8).reshape(last - first, k)


@torch.no_grad()
def write_four_bit(found: GroupedWeight, out: torch.Tensor) -> None:
    """`found`'s values in HQQ's 4-bit layout, written into `out` [N / 2, K] a slice of rows at a time."""
    n, k = found.shape
    half = n // 2
    rows = max(1, ROWS_AT_ONCE // k)
    for first in range(0, half, rows):
        last = min(half, first + rows)
        out[first:last] = (three_bit_rows(found, first, last) << 4) | three_bit_rows(found, half + first, half + last)


_WEIGHTS: dict[tuple[torch.device, int], torch.Tensor] = {}


def _odd_weights(device: torch.device, count: int, salt: int) -> torch.Tensor:
    """`count` random odd int64 numbers (fixed: a generator seeded with `salt`), on `device`, kept."""
    key = (device, salt)
    kept = _WEIGHTS.get(key)
    if kept is None or kept.numel() < count:
        g = torch.Generator().manual_seed(salt)
        drawn = torch.randint(-(1 << 62), 1 << 62, (max(count, 1024),), generator=g, dtype=torch.int64) * 2 + 1
        kept = _WEIGHTS[key] = drawn.to(device)
    return kept[:count]


@torch.no_grad()
def word_hashes(words: list[torch.Tensor]) -> list[int]:
    """A 64-bit hash of each int32 word tensor [rows, columns]: sum over words of word x column weight
    x row weight (random odd numbers, wrapping int64 arithmetic, so the same in any reduction order).
    Any change moves it except with a chance of about 2**-32 per pair of changed words; one transfer
    for all."""
    if not words:
        return []
    sums = []
    for w in words:
        rows, columns = w.shape
        by_row = (w.to(torch.int64) * _odd_weights(w.device, columns, 1)).sum(dim=1)
        sums.append((by_row * _odd_weights(w.device, rows, 2)).sum())
    return torch.stack(sums).tolist()


class FourBitCopy:
    """The 4-bit copy of one 3-bit HQQ projection, and the state of the words it was made from."""

    def __init__(self, module: nn.Module, found: GroupedWeight) -> None:
        self.module, self.source = module, found
        n, k = found.shape
        self.copy = torch.empty(n // 2, k, dtype=torch.uint8, device=found.packed.device)
        self._made_from: tuple | None = None  # (version, hash) of the words it holds; None: not written yet

    @property
    def grouped(self) -> GroupedWeight:
        """What the grouped form reads instead of `source`: the copy, at 4 bits."""
        return self.source._replace(packed=self.copy, bits=4)

    def words(self) -> list[torch.Tensor]:
        """The tensors the copy is made from (for word_hashes)."""
        return [self.source.packed]

    def version(self) -> int | None:
        """The words' version counter; None for an inference tensor, which keeps none."""
        words = self.source.packed
        return None if words.is_inference() else words._version

    def moved(self) -> bool:
        """Whether a version counter says the words were written since the copy was made (always, for
        an inference tensor: only their hash can tell)."""
        version = self.version()
        return version is None or self._made_from is None or version != self._made_from[0]

    def refresh(self, version: int | None, words_hash, orders: dict | None = None) -> bool:
        """Rebuild the copy in place unless `version` (the words' counter, read before `words_hash`,
        their hash now) and the hash are those it was made from; True if it was rebuilt. On CUDA the
        device is synchronized around the write: a serving loop's step may be reading the copy, and
        the next one must read the new values. (`orders`: quanto_grouped.QuantoCopy's, unused here.)"""
        made = self._made_from  # (FourBitCopy(...) writes nothing: DecodeGemms refreshes all of them at once)
        if made is not None and words_hash == made[1] and (version is None or version == made[0]):
            return False
        device = self.copy.device
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        write_four_bit(self.source, self.copy)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        self._made_from = (version, words_hash)
        return True
