"""The vision tower's packed attention in a few calls instead of one per window.

Qwen2-VL, Qwen2.5-VL and GLM-4V pack every image's patches into one sequence and attend within
windows (or whole images) given by `cu_seqlens`. With a flash-attention implementation they make
one variable-length call per layer; with SDPA (what runs without flash-attn) they split the
sequence and make one call per window: 64 images of 2304 patches are ~2,300 calls per windowed
layer, and the tower took 4.7 s of a 7B call on an H200 (docs/benchmarks.md).

`varlen_attention` is registered under a name that says "flash", so these towers take their
variable-length branch and hand it `cu_seq_lens_q`; it runs one SDPA call per distinct window
length, the windows of that length stacked as a batch. It is set on the vision config only, and
only for the merge of a call's images (model/vision.py); without `cu_seq_lens_q` it is SDPA.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import weakref
from typing import Iterator, NamedTuple

import torch
import torch.nn.functional as F

from hf_async_cb.model import attention

NAME = "hf_async_cb_flash_varlen"


def varlen_attention(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0, is_causal=False,
                     cu_seq_lens_q=None, cu_seq_lens_k=None, **kwargs):
    """query/key/value [1, H, T, D] packed -> ([1, T, H, D], None), attending within each segment of
    `cu_seq_lens_q` (non-causal, as the vision towers ask)."""
    if cu_seq_lens_q is None or attention_mask is not None or is_causal or query.shape[0] != 1:
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling,
                                             is_causal=is_causal)
        return out.transpose(1, 2).contiguous(), None
    layout = _layout(cu_seq_lens_q)
    total, heads = query.shape[2], query.shape[1]
    if layout.tiling is not None and layout.total == total:  # equal windows tiling the sequence
        n, count = layout.tiling
        return _run(query, key, value, 0, count, n, scaling).reshape(1, total, heads, -1), None
    out = torch.empty(total, heads, value.shape[-1], dtype=query.dtype, device=query.device)
    for n, (start, count) in layout.runs.items():  # the windows of this length lie end to end: views, no gather
        out[start:start + count * n] = _run(query, key, value, start, count, n,
                                            scaling).reshape(-1, heads, value.shape[-1])
    for n, rows in layout.gathers.items():
        count = rows.numel() // n
        q, k, v = (t[0][:, rows].unflatten(1, (count, n)).transpose(0, 1) for t in (query, key, value))
        o = F.scaled_dot_product_attention(q, k, v, scale=scaling)  # [S, H, n, D]
        out[rows] = o.transpose(1, 2).reshape(-1, o.shape[1], o.shape[-1])
    return out[None], None


class _Layout(NamedTuple):
    """How a `cu_seqlens` tensor splits the packed sequence: its windows grouped by length."""

    total: int  # the sequence length it covers
    tiling: tuple[int, int] | None  # (n, count): `count` windows of n rows tiling it from 0, else None
    runs: dict[int, tuple[int, int]]  # n -> (start, count): the windows of length n lie end to end
    gathers: dict[int, torch.Tensor]  # n -> the rows of the windows of length n that do not ([count * n])


_LAYOUTS: dict[int, tuple] = {}  # id(cu_seqlens) -> (a weak reference to it, its version, its _Layout)
_LAYOUTS_KEPT = 8


def _layout(cu_seqlens: torch.Tensor) -> _Layout:
    """The layout of `cu_seqlens`, read once per tensor (and again if it is written in place): a tower passes
    the same tensor to every layer of a kind (32 in Qwen2.5-VL-7B), and reading it is a device sync and a
    pass over every window (2,304 for 64 images), during which the GPU has nothing queued."""
    version = _version(cu_seqlens)
    found = _LAYOUTS.get(id(cu_seqlens))
    if found is not None and found[0]() is cu_seqlens and found[1] == version:
        return found[2]
    layout = _read_layout(cu_seqlens)
    if len(_LAYOUTS) >= _LAYOUTS_KEPT:
        _LAYOUTS.clear()
    _LAYOUTS[id(cu_seqlens)] = (weakref.ref(cu_seqlens), version, layout)
    return layout


def _version(t: torch.Tensor) -> int | None:
    """`t`'s version counter; None for a tensor made under torch.inference_mode, which keeps none (the
    layouts are dropped at the start and end of each tower call: packed_vision_attention)."""
    return None if t.is_inference() else t._version


def _read_layout(cu_seqlens: torch.Tensor) -> _Layout:
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    first = [0, *itertools.accumulate(lengths)]
    by_length: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        if n:
            by_length.setdefault(n, []).append(i)
    runs, gathers = {}, {}
    for n, segments in by_length.items():
        if first[segments[-1]] - first[segments[0]] == (len(segments) - 1) * n:
            runs[n] = (first[segments[0]], len(segments))
        else:
            starts = torch.tensor([first[i] for i in segments], device=cu_seqlens.device)
            gathers[n] = (starts[:, None] + torch.arange(n, device=cu_seqlens.device)[None]).reshape(-1)
    tiling = None
    if len(runs) == 1 and not gathers:
        (n, (start, count)), = runs.items()
        tiling = (n, count) if start == 0 else None
    return _Layout(first[-1], tiling, runs, gathers)


def _run(query, key, value, start: int, count: int, n: int, scaling) -> torch.Tensor:
    """Attention within each of `count` windows of `n` rows lying end to end from `start`, read as views
    of the packed [1, H, T, D] tensors; returns [count, n, H, D]."""
    q, k, v = (t[0][:, start:start + count * n].unflatten(1, (count, n)).transpose(0, 1) for t in (query, key, value))
    return F.scaled_dot_product_attention(q, k, v, scale=scaling).transpose(1, 2)


def splits_per_window(model: torch.nn.Module) -> list:
    """The vision configs whose attention modules make one call per window without flash attention
    (they take `cu_seq_lens_q` in their flash branch)."""
    configs = []
    for m in model.modules():
        name = type(m).__name__
        if name.endswith("VisionAttention") and "cu_seq_lens_q" in _source(type(m).forward):
            config = getattr(m, "config", None)
            if config is not None and all(c is not config for c in configs):
                configs.append(config)
    return configs


@contextlib.contextmanager
def packed_vision_attention(model: torch.nn.Module) -> Iterator[None]:
    """varlen_attention as the attention of the model's window-splitting vision towers, for a block;
    a tower whose config asks for flash attention already keeps it."""
    configs = [c for c in splits_per_window(model) if "flash" not in str(c._attn_implementation)]
    if not configs:
        yield
        return
    register()
    _LAYOUTS.clear()
    try:
        with contextlib.ExitStack() as stack:
            for config in configs:
                stack.enter_context(attention.implementation(config, NAME))
            yield
    finally:
        _LAYOUTS.clear()


def register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, varlen_attention)


@functools.lru_cache(maxsize=None)
def _source(fn) -> str:
    """A forward's source, read once per function: a tower's merge asks for each of its attention
    modules' (32 in Qwen2.5-VL-7B's), and reading one costs a tokenize of its block (ms each)."""
    try:
        return inspect.getsource(fn)
    except (OSError, TypeError):
        return ""
