"""Which rows of a decode step share a prefix: the groups the shared-prefix attention reads once.

Rows share a prefix when their block tables start with the same physical pages: prefix caching
gives every request of a repeated prompt (a GRPO group, a few-shot header, a system prompt) the
cached pages of its longest cached prefix, and `num_return_sequences` copies share their prompt's.
Only adjacent rows are grouped (a batch keeps a call's rows in order, so a repeated prompt's rows
sit together), only full pages before each row's newest token (those no row writes), at most
MAX_GROUP_ROWS rows per group and at least MIN_SHARED_TOKENS keys each. A step where grouping
saves less than an eighth of the keys it reads is left ungrouped: the extra kernel and merge would
cost about what they save.
"""

from __future__ import annotations

import numpy as np

from hf_async_cb.kernels.shared_prefix_attention import MAX_GROUP_ROWS, MIN_SHARED_TOKENS

MIN_SAVED_FRACTION = 1 / 8


def shared_prefix_groups(table: np.ndarray, context_lens: np.ndarray, real_rows: int,
                         page_size: int) -> tuple[np.ndarray, np.ndarray] | None:
    """(group_start [R + 1], shared_len [R]) int64 for a decode step's block table [R, W] and
    context lengths [R] (rows past `real_rows`: padding, each alone), or None when no group pays.
    Group i holds rows group_start[i] .. group_start[i + 1] - 1 (entries past the last group: R);
    shared_len: each row's keys read by its group's program (0 for a row alone)."""
    if real_rows < 2:
        return None
    first = table[:real_rows, 0]
    if not (first[1:] == first[:-1]).any():  # the common case without sharing: one compare per row
        return None
    rows = table.shape[0]
    full = (context_lens[:real_rows] - 1) // page_size  # pages wholly before each row's newest token
    width = min(table.shape[1], int(full.max()))
    if width == 0:
        return None
    same = table[1:real_rows, :width] == table[:real_rows - 1, :width]
    common = np.minimum(np.cumprod(same, axis=1).sum(axis=1), np.minimum(full[1:], full[:-1]))
    min_pages = -(-MIN_SHARED_TOKENS // page_size)
    if not (common >= min_pages).any():
        return None
    starts = [0]
    shared = np.zeros(rows, dtype=np.int64)
    begin, pages = 0, 0
    for row in range(1, real_rows + 1):
        joined = row < real_rows and row - begin < MAX_GROUP_ROWS and common[row - 1] >= min_pages
        if joined:
            joined_pages = common[row - 1] if row - begin == 1 else min(pages, common[row - 1])
            # A row whose prefix with the group is much shorter starts a group of its own.
            joined = joined_pages >= min_pages and (row - begin == 1 or 2 * joined_pages >= pages)
        if joined:
            pages = joined_pages
            continue
        if row - begin > 1:
            shared[begin:row] = pages * page_size
        starts.append(row)
        begin, pages = row, 0
    saved = int(shared.sum()) - sum(int(shared[s]) for s in starts[:-1])  # keys not read again
    if saved < MIN_SAVED_FRACTION * int(context_lens[:real_rows].sum()):
        return None
    starts.extend(range(real_rows + 1, rows + 1))  # padding rows, each alone
    group_start = np.full(rows + 1, rows, dtype=np.int64)
    group_start[:len(starts)] = starts
    return group_start, shared
