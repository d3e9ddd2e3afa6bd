"""A vision tower's patch embedding as the GEMM it is, for the towers' run in a call.

Qwen2-VL, Qwen2.5-VL and Qwen3-VL embed each patch with an nn.Conv3d whose kernel equals its stride
and the patch itself: one output position per patch, so the convolution is a matrix product of the
flattened patches with the flattened kernel. cuDNN has no fast algorithm for that shape in bf16 on
several GPU and cuDNN versions (tens to thousands of times slower than the GEMM; transformers issue
45750, where newer transformers made the same swap opt-in as a "fusion"). `convolutions_as_gemms`
runs such convolutions as F.linear for a block: same weights, the same sum in another order.

A module is swapped only where nothing else has taken its forward (an accelerate offload hook sets
one on the instance), and a call whose input is not exactly one kernel-sized patch per sample runs
the convolution itself.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from hf_async_cb.model.weight_kinds import is_plain


def _is_patchwise(conv: nn.Module) -> bool:
    """A plain Conv2d/Conv3d whose windows do not overlap or pad, with nothing else on its forward."""
    if type(conv) not in (nn.Conv2d, nn.Conv3d) or "forward" in vars(conv):
        return False
    if isinstance(conv.padding, str) or any(conv.padding) or any(d != 1 for d in conv.dilation):
        return False
    return (tuple(conv.stride) == tuple(conv.kernel_size) and conv.groups == 1
            and is_plain(conv.weight) and conv.weight.dtype.is_floating_point)


def _gemm_forward(conv: nn.Module):
    kernel = tuple(conv.kernel_size)
    convolve = type(conv).forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 + len(kernel) or tuple(x.shape[2:]) != kernel or x.dtype != conv.weight.dtype:
            return convolve(conv, x)
        out = F.linear(x.reshape(x.shape[0], -1), conv.weight.reshape(conv.out_channels, -1), conv.bias)
        return out.view(x.shape[0], conv.out_channels, *([1] * len(kernel)))

    return forward


@contextlib.contextmanager
def convolutions_as_gemms(model: nn.Module) -> Iterator[int]:
    """Inside the block, each patch-wise convolution of `model` runs as a GEMM; yields how many."""
    swapped = [m for m in model.modules() if _is_patchwise(m)]
    for conv in swapped:
        conv.forward = _gemm_forward(conv)
    try:
        yield len(swapped)
    finally:
        for conv in swapped:
            vars(conv).pop("forward", None)
