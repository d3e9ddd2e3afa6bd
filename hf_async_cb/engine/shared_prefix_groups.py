"""Which rows of a decode step share a prefix: the groups the shared-prefix attention reads once.

Rows share a prefix when their block tables start with the same physical pages: prefix caching
gives every request of a repeated prompt (a GRPO group, a few-shot header, a system prompt) the
cached pages of its longest cached prefix, and `num_return_sequences` copies share their prompt's.
Rows are put in order by their first page (stable: a batch keeps a call's rows in order, so a
repeated prompt's rows stay together), and neighbours in that order are grouped: only full pages
before each row's newest token (those no row writes), at most
MAX_GROUP_ROWS rows per group and at least MIN_SHARED_TOKENS keys each; a group's prefix is the
shortest any of its rows shares with the row before it. A step where grouping
saves less than an eighth of the keys it reads is left ungrouped: the extra kernel and merge would
cost about what they save.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from hf_async_cb.kernels.shared_prefix_attention import MAX_GROUP_ROWS, MIN_SHARED_TOKENS

MIN_SAVED_FRACTION = 1 / 8


class SharedPrefixGroups(NamedTuple):
    """A decode step's groups (int64 arrays, as StepMetadata takes them) and what they save."""

    group_start: np.ndarray  # [R + 1]
    group_rows: np.ndarray  # [R]
    shared_len: np.ndarray  # [R]
    keys_saved: int  # keys per layer the step's rows do not read again


def shared_prefix_groups(table: np.ndarray, context_lens: np.ndarray, real_rows: int,
                         page_size: int) -> SharedPrefixGroups | None:
    """(group_start [R + 1], group_rows [R], shared_len [R], keys saved) for a decode step's block table
    [R, W] and context lengths [R] (rows past `real_rows`: padding, each alone), or None when no
    group pays. group_rows: the rows in the groups' order (by first page, then as they came);
    group i holds the rows group_rows[group_start[i]] .. group_rows[group_start[i + 1] - 1] (entries
    past the last group: R); shared_len: each row's keys read by its group's program (0 alone)."""
    if real_rows < 2:
        return None
    order = np.argsort(table[:real_rows, 0], kind="stable")  # rows that share pages share their first
    first = table[order, 0]
    if not (first[1:] == first[:-1]).any():  # the common case without sharing
        return None
    rows = table.shape[0]
    full = (context_lens[order] - 1) // page_size  # pages wholly before each row's newest token
    width = min(table.shape[1], int(full.max()))
    if width == 0:
        return None
    ordered = table[order, :width]
    same = ordered[1:] == ordered[:-1]
    leading = np.where(same.all(axis=1), width, np.argmin(same, axis=1))  # equal pages before the first other
    common = np.minimum(leading, np.minimum(full[1:], full[:-1]))
    min_pages = -(-MIN_SHARED_TOKENS // page_size)
    if not (common >= min_pages).any():
        return None
    # Runs of rows each joined to the one before, cut every MAX_GROUP_ROWS rows: the groups (numpy
    # throughout: ~0.12 ms per 256-row step on this project's 2-core CPU machine, half a loop's time).
    joined = np.zeros(real_rows, dtype=bool)
    joined[1:] = common >= min_pages
    run_start = np.flatnonzero(~joined)
    position = np.arange(real_rows) - run_start[np.cumsum(~joined) - 1]
    starts = np.flatnonzero(~joined | (position % MAX_GROUP_ROWS == 0))
    sizes = np.diff(np.append(starts, real_rows))
    # A group's prefix: the fewest pages any of its rows shares with the row before it.
    links = np.empty(real_rows, dtype=np.int64)
    links[0] = 0
    links[1:] = common
    links[starts] = np.iinfo(np.int64).max
    pages = np.where(sizes > 1, np.minimum.reduceat(links, starts), 0)
    saved = int(((sizes - 1) * pages).sum()) * page_size  # keys not read again
    if saved < MIN_SAVED_FRACTION * int(context_lens[:real_rows].sum()):
        return None
    group_rows = np.arange(rows, dtype=np.int64)
    group_rows[:real_rows] = order
    shared = np.zeros(rows, dtype=np.int64)
    shared[order] = np.repeat(pages * page_size, sizes)
    group_start = np.full(rows + 1, rows, dtype=np.int64)
    group_start[:len(starts)] = starts
    padding = np.arange(real_rows, rows + 1)  # the end of the last group, then each padding row alone
    group_start[len(starts):len(starts) + len(padding)] = padding
    return SharedPrefixGroups(group_start, group_rows, shared, saved)
