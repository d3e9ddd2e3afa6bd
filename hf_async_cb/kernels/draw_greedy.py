"""Greedy picks in one pass over the logits: the argmax of each row and its log-probability.

The torch path of an all-greedy step (logits.float(), argmax, log_softmax, gather, pack) reads the
[S, V] logits four times in five kernels; at 64 rows of a 128K vocabulary that is ~0.1 ms of a
~1.6 ms 1B decode step. Here each row's vocabulary is cut into parts: the first kernel keeps, per
part, the largest logit, its first index and the sum of exp(logit - max) (computed in fp32 from
the model's dtype); the second merges the parts and writes the packed [2, S] output of
sampling.pack directly (token ids, then the float64 log-probabilities' bits). Ties go to the
lowest index, as torch.argmax does; the log-probability is -log(sum exp(x - max)), which is
log_softmax at the argmax.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_async_cb.devices import num_sms
from hf_async_cb.kernels.sampling_threshold import _MAX_PARTS, MAX_PARTS
from hf_async_cb.kernels.variant import Variant

BLOCK = 2048
CPU_PROGRAMS = 4  # the interpreter's stand-in for the SM count: rows still split into parts, as on a GPU
# Per-part results are views into one buffer at offsets that change with the row count, read back as
# masked vectors of MAX_PARTS lanes: specialising on their alignment would compile variants mid-run.
_PART_POINTERS = ["max_ptr", "idx_ptr", "nan_ptr", "sum_ptr"]


@triton.jit
def online_exp_sum(m, total, x):
    """One step of a lane-wise running max and sum of exp(x - max): (max, sum) after adding x."""
    new_m = tl.maximum(m, x)
    # A lane still at -inf rescales by a finite stand-in: exp(-inf - 0) = 0, never -inf - -inf.
    shift = tl.where(new_m == float("-inf"), 0.0, new_m)
    return new_m, total * tl.exp(m - shift) + tl.exp(x - shift)


@triton.jit
def merged_exp_sum(m, total):
    """Lanes' (or parts') running (max, sum of exp(x - max)) -> the overall max, the sum relative
    to it, and the finite stand-in for a max of -inf (what log-probabilities subtract)."""
    best = tl.max(m, 0)
    shift = tl.where(best == float("-inf"), 0.0, best)
    return best, tl.sum(total * tl.exp(m - shift), 0), shift


@triton.jit(do_not_specialize=["num_parts"], do_not_specialize_on_alignment=_PART_POINTERS)
def _greedy_parts_kernel(logits_ptr, max_ptr, idx_ptr, nan_ptr, sum_ptr, vocab, stride_row, chunk, num_parts,
                         BLOCK: tl.constexpr):
    row = tl.program_id(0)
    part = tl.program_id(1)
    start = part * chunk
    stop = tl.minimum(start + chunk, vocab)
    lanes = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    s = tl.zeros([BLOCK], dtype=tl.float32)
    idx = tl.zeros([BLOCK], dtype=tl.int32)
    nan_at = tl.zeros([BLOCK], dtype=tl.int32) + vocab  # each lane's first NaN: torch.argmax picks NaN
    base = logits_ptr + row.to(tl.int64) * stride_row
    for off in range(start, stop, BLOCK):
        cols = off + lanes
        x = tl.load(base + cols, mask=cols < stop, other=float("-inf")).to(tl.float32)
        nan_at = tl.minimum(nan_at, tl.where(x != x, cols, vocab))
        idx = tl.where(x > m, cols, idx)  # strictly greater: each lane keeps its first maximum
        m, s = online_exp_sum(m, s, x)
    best, total, _ = merged_exp_sum(m, s)
    first = tl.min(tl.where(m == best, idx, vocab), 0)
    out = row * num_parts + part
    tl.store(max_ptr + out, best)
    tl.store(idx_ptr + out, first)
    tl.store(nan_ptr + out, tl.min(nan_at, 0))
    tl.store(sum_ptr + out, total)


# The packed output's second row (log-probabilities) starts `rows` int64s in: 16-byte aligned or not
# with the row count's parity; specialising on it would compile a variant mid-run (scalar stores).
@triton.jit(do_not_specialize=["num_parts"], do_not_specialize_on_alignment=_PART_POINTERS + ["tokens_ptr", "logprobs_ptr"])
def _greedy_merge_kernel(max_ptr, idx_ptr, nan_ptr, sum_ptr, tokens_ptr, logprobs_ptr, vocab, num_parts):
    row = tl.program_id(0)
    lanes = tl.arange(0, _MAX_PARTS)  # the row's parts, a runtime count: one variant for any batch
    ours = lanes < num_parts
    parts = row * num_parts + lanes
    m = tl.load(max_ptr + parts, mask=ours, other=float("-inf"))
    best, total, _ = merged_exp_sum(m, tl.load(sum_ptr + parts, mask=ours, other=0.0))
    first = tl.min(tl.where(m == best, tl.load(idx_ptr + parts, mask=ours, other=vocab), vocab), 0)
    first = tl.where(first == vocab, 0, first)  # a row of -inf only: index 0, as torch.argmax
    first_nan = tl.min(tl.load(nan_ptr + parts, mask=ours, other=vocab), 0)
    first = tl.where(first_nan < vocab, first_nan, first)  # a NaN wins, as in torch.argmax
    logprob = tl.where((first_nan < vocab) | (best == float("inf")) | (best == float("-inf")), float("nan"),
                       -tl.log(total))  # log_softmax's NaN
    tl.store(tokens_ptr + row, first.to(tl.int64))
    tl.store(logprobs_ptr + row, logprob.to(tl.float64))


def split_rows(rows: int, vocab: int, device: torch.device) -> tuple[int, int]:
    """(parts per row, elements per part) for kernels that cut each row of the logits into parts:
    enough programs to fill the GPU twice over, each part a whole number of BLOCKs."""
    parts = max(1, min(MAX_PARTS, triton.next_power_of_2(-(-2 * (num_sms(device) or CPU_PROGRAMS) // rows))))
    chunk = -(-vocab // (parts * BLOCK)) * BLOCK
    return min(parts, triton.next_power_of_2(-(-vocab // chunk))), chunk


def greedy_packed(logits: torch.Tensor) -> torch.Tensor:
    """logits [S, V] (any float dtype) -> [2, S] int64 as sampling.pack(argmax, its log-probability)."""
    rows, vocab = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    out = torch.empty(2, rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    parts, chunk = split_rows(rows, vocab, logits.device)
    partial = torch.empty(2, rows * parts, dtype=torch.float32, device=logits.device)
    idx = torch.empty(2, rows * parts, dtype=torch.int32, device=logits.device)  # argmax, first NaN
    _greedy_parts_kernel[(rows, parts)](logits, partial[0], idx[0], idx[1], partial[1], vocab, logits.stride(0),
                                        chunk, parts, BLOCK=BLOCK)
    _greedy_merge_kernel[(rows,)](partial[0], idx[0], idx[1], partial[1], out[0], out[1].view(torch.float64), vocab,
                                  parts)
    return out


def variants(logits_dtype: torch.dtype, vocab: int, stride_row: int) -> list[Variant]:
    """The kernels' compiled variants for logits of this dtype, width and row stride: one each,
    whatever the rows. Arguments as greedy_packed passes them (chunk is a multiple of BLOCK)."""
    f32, i32 = torch.float32, torch.int32
    return [Variant(_greedy_parts_kernel, (logits_dtype, f32, i32, i32, f32, vocab, stride_row, BLOCK, 2),
                    dict(BLOCK=BLOCK)),
            Variant(_greedy_merge_kernel, (f32, i32, i32, f32, torch.int64, torch.float64, vocab, 2))]
