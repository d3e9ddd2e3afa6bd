"""What kind of tensor a weight is: a plain one, or a quantized form the engine must not look into.

Quantization libraries hold weights in two ways. Some replace the module (bitsandbytes'
Linear8bitLt / Linear4bit, quanto's QLinear, HQQLinear, transformers' FP8 linears); others keep a
plain nn.Linear and give it a tensor subclass as its weight (torchao's Int8Tensor, Float8Tensor,
...: a wrapper whose real data are inner tensors, with no storage of its own, so `data_ptr()` on
it raises). Code that concatenates, views or reads the storage of weights (fusion, the skinny
GEMM kernels, the preparation's signature) may do so only for plain tensors of a floating dtype;
everything else runs through its own module's forward, as in stock.
"""

from __future__ import annotations

import functools
import weakref

import torch
from torch import nn

FLOATING = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def is_plain(t: torch.Tensor | None) -> bool:
    """Whether `t` is an ordinary tensor or parameter (no subclass: torchao, bitsandbytes' Int8Params /
    Params4bit, quanto's tensors and any other wrapper are not)."""
    return type(t) in (torch.Tensor, nn.Parameter)


def dispatches_itself(t: torch.Tensor) -> bool:
    """Whether `t`'s class handles its own ops (`__torch_dispatch__`: torchao's and quanto's wrappers,
    even where `isinstance(t, nn.Parameter)` holds), so that any op on it may run its own code."""
    return getattr(type(t), "__torch_dispatch__", None) not in _PLAIN_DISPATCH


_PLAIN_DISPATCH = (torch.Tensor.__torch_dispatch__, nn.Parameter.__torch_dispatch__)


def is_plain_floating(t: torch.Tensor | None) -> bool:
    """A plain tensor of a floating dtype a GEMM takes as it is (float8 and integer data are not)."""
    return is_plain(t) and t.dtype in FLOATING


def versions(tensors) -> list[int] | None:
    """The version counters of `tensors` (an in-place write bumps one: an optimizer step, a copy_ into
    a weight); None when one is an inference tensor, which keeps none."""
    try:
        return [t._version for t in tensors]
    except RuntimeError:  # "Inference tensors do not track version counter"
        return None


def storage_ref(t: torch.Tensor):
    """A weak reference to `t`'s storage (torch keeps one Python object per live storage), or None:
    equal to a later one while that storage lives, and never to one taken after it died. A data
    pointer alone is not an identity: a storage made after another was freed can take its address
    (a `p.data = ...` landing where the weight's first storage was), which read as no change."""
    try:
        return weakref.ref(t.untyped_storage())
    except (RuntimeError, TypeError, NotImplementedError):  # (no storage of its own)
        return None


def storage_key(t: torch.Tensor) -> tuple:
    """Where `t`'s data live, without touching a storage a wrapper subclass does not have: a plain
    tensor's data pointer, else its inner tensors' (`__tensor_flatten__`), else nothing beyond the
    object itself (which the caller identifies by id)."""
    if is_plain(t):
        return (t.data_ptr(), storage_ref(t))
    flatten = getattr(t, "__tensor_flatten__", None)
    if callable(flatten):
        try:
            names, _ = flatten()
            return tuple(storage_key(inner) for inner in (getattr(t, name, None) for name in names)
                         if isinstance(inner, torch.Tensor))
        except Exception:  # noqa: BLE001 - a subclass whose flatten needs more than itself: its identity is enough
            return ()
    try:
        return (t.data_ptr(),)  # a Parameter subclass over real storage (bitsandbytes)
    except RuntimeError:
        return ()


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@torch.no_grad()
def content_sums(tensors) -> tuple:
    """Per tensor, numbers that change when its values do, whatever wrote them: a write through
    `.data`, a collective (`broadcast`, `all_reduce`: RL trainers' weight sync) or a NumPy view
    bumps no version counter. Each row's bits read as 32-bit words are summed, wrapping (mod 2**32,
    so the same whatever the reduction order), and the rows' sums weighted by their place: any
    change of one word moves it, and so does a write that only moves rows (a flip, two heads
    swapped), which a plain sum would not see. A floating tensor also gives its columns' float32
    sums (a vector's values; an integer tensor its words' column sums), weighted by their place likewise, which move when values move within
    rows (input features swapped) and when signs flip (each word then moves by 2**31, and an even count of them cancels in
    the first). A tensor over no storage of its own (a wrapper subclass: its
    inner tensors hold the data, and are listed themselves: held_tensors) or of another kind
    (complex) gives None. About two reads of the data, four small kernels per tensor and no
    temporary larger than a tensor's row count, one transfer per device (benchmarks/fingerprint_cost.py
    times it)."""
    groups: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
    for i, t in enumerate(tensors):
        data = _plain_view(t)
        if data is not None and data.device.type != "meta" and not data.dtype.is_complex:
            groups.setdefault(data.device, []).append((i, data))
    out: list = [None] * len(tensors)
    for device, members in groups.items():
        words, values, columns = [], [], []
        zero = torch.zeros((), dtype=torch.int64, device=device)
        for _, t in members:
            word_rows, rows = _rows(t)
            # Integer arithmetic is exact whatever the order of the additions (int64, wrapping).
            place = _place_weights(word_rows.shape[0], device)[0]
            words.append((word_rows.sum(dim=1, dtype=torch.int32) * place).sum())
            if t.dtype in FLOATING:
                sums = rows.sum(dim=0 if rows.shape[1] > 1 else 1, dtype=torch.float32)  # (a vector: its values)
                values.append(torch.dot(sums, _place_weights(sums.shape[0], device)[1]))
                columns.append(zero)
            else:  # integer codes (int8 weights, packed 4-bit): their words' column sums, by place (exact)
                by_column = word_rows.sum(dim=0, dtype=torch.int64)
                columns.append((by_column * _place_weights(by_column.shape[0], device)[0]).sum())
                values.append(zero.float())
        for (i, _), word, value, column in zip(members, torch.stack(words).tolist(), torch.stack(values).tolist(),
                                               torch.stack(columns).tolist()):
            out[i] = (word, value, column)
    return tuple(out)


def _rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`t`'s data as [rows, words] (int32 words, or narrower where its size is not a multiple of 4
    bytes: a tensor of an odd number of 16-bit values) and as [rows, values]: a row is its last
    dimension (one value, for a vector), or all of it where a row is not a whole number of words."""
    flat = t.reshape(-1) if t.is_contiguous() else t.contiguous().reshape(-1)
    if not flat.numel():
        flat = flat.new_zeros(1)
    size = flat.element_size()
    words = flat.view(torch.int32) if size < 4 and (flat.numel() * size) % 4 == 0 else flat.view(_BITS[size])
    if words.dtype == torch.int64:  # (8-byte values: the low and high words)
        words = words.view(torch.int32)
    per_row = t.shape[-1] if t.dim() >= 2 and t.numel() else 1
    row_bytes = per_row * size
    word_size = words.element_size()
    columns = row_bytes // word_size if row_bytes % word_size == 0 else words.numel()
    return words.view(-1, columns), flat.view(-1, per_row)


@functools.lru_cache(maxsize=256)
def _place_weights(rows: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed weights for `rows` sums (of rows, or of columns) by their place: int64 (odd multiples of a
    large constant, below 2**32) and float32 in [0.5, 1.5)."""
    places = torch.arange(rows, dtype=torch.int64)
    integer = (places * 2654435761 + 1) % (1 << 32)
    real = 0.5 + torch.rand(rows, generator=torch.Generator().manual_seed(rows))
    return integer.to(device), real.to(device)


def held_tensors(value, depth: int = 0, seen: set[int] | None = None) -> list[torch.Tensor]:
    """The tensors `value` holds beyond itself, where an in-place write bumps no counter of a weight
    the model lists: a wrapper subclass's inner tensors (torchao's qdata and scale), the objects a
    Parameter subclass carries (bitsandbytes' quant_state: absmax, code), a container's tensors (HQQ's
    meta dict: scale, zero). Three levels deep at most, modules and configs left out (each is
    listed on its own), each tensor once."""
    seen = set() if seen is None else seen
    found: list[torch.Tensor] = []

    def walk(v, level: int) -> None:
        if isinstance(v, torch.Tensor):
            if level:  # (`value` itself may be listed by the caller already)
                if id(v) in seen:
                    return
                seen.add(id(v))
                found.append(v)
            if is_plain(v) or level >= _HELD_DEPTH:
                return
            flatten = getattr(v, "__tensor_flatten__", None)
            if callable(flatten):
                try:
                    for name in flatten()[0]:
                        walk(getattr(v, name, None), level + 1)
                except Exception:  # noqa: BLE001 - its attributes below still list them
                    pass
            for item in vars(v).values():
                walk(item, level + 1)
            return
        if level >= _HELD_DEPTH or v is None or isinstance(v, (str, bytes, int, float, bool, nn.Module, type)):
            return
        if isinstance(v, dict):
            for item in list(v.values())[:_HELD_ITEMS]:
                walk(item, level + 1)
        elif isinstance(v, (list, tuple)):
            for item in v[:_HELD_ITEMS]:
                walk(item, level + 1)
        elif not callable(v) and isinstance(getattr(v, "__dict__", None), dict) and not is_transformers_config(v):
            scratch = scratch_attributes(v)
            for name, item in list(vars(v).items())[:_HELD_ITEMS]:
                if name not in scratch:
                    walk(item, level + 1)

    walk(value, depth)
    return found


_HELD_DEPTH = 3
_HELD_ITEMS = 64
# (package, class) -> attributes each forward writes for itself, read by nothing after it: not weights.
# bitsandbytes' LLM.int8() state keeps the last call's outlier columns (`idx`, a new tensor every call;
# `subB`, `outlier_pool`): counted as held tensors they made every call read as a changed model (its
# runtime rebuilt, its prefix cache emptied, at each call).
_SCRATCH = {("bitsandbytes", "MatmulLtState"): ("idx", "subB", "outlier_pool")}


def scratch_attributes(value) -> tuple[str, ...]:
    """The attributes of `value` that each forward writes for itself (_SCRATCH): neither weights nor
    settings, so read by neither the fingerprints nor the numerics key."""
    return _SCRATCH.get((type(value).__module__.split(".")[0], type(value).__name__), ())


def is_transformers_config(value) -> bool:
    """Whether `value` is a transformers model or generation config (read on its own, elsewhere)."""
    return any(base.__name__ in ("PretrainedConfig", "PreTrainedConfig", "GenerationConfig")
               and base.__module__.startswith("transformers.") for base in type(value).__mro__)


def _plain_view(t: torch.Tensor) -> torch.Tensor | None:
    """`t`'s data as a plain tensor (a Parameter subclass over real storage, as bitsandbytes' are,
    seen through), or None for a wrapper subclass (torchao's, quanto's), whose inner tensors hold
    the data. A subclass that dispatches its own ops is never operated on here, not even detached:
    quanto's tensors answer any op they do not know by dequantizing, which on a fresh machine first
    builds quanto's CUDA extension (90 s of an 8B model's first call went so)."""
    if is_plain(t):
        return t.detach()
    if dispatches_itself(t) or not isinstance(t, nn.Parameter):  # (a wrapper subclass: torchao's, quanto's)
        return None
    try:
        plain = t.detach().as_subclass(torch.Tensor)
        if type(plain) is not torch.Tensor:
            return None
        plain.untyped_storage().data_ptr()
        return plain
    except Exception:  # noqa: BLE001 - no storage of its own: its inner tensors are not looked at
        return None
