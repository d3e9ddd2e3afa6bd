"""Every running request's pages as one row of a numpy array, kept in step by the scheduler.

A step's block table is then one fancy-index gather (rows of the step's requests, the step's
width), instead of flattening every request's page list anew: at 256 requests of 512 tokens that
was ~9,000 Python ints per step, about half of the host's batch-building time. A row changes
only when its request's pages do (a new page every page_size tokens, preemption, the end).
Entries past a request's last page repeat it, so any width reads valid page ids.
"""

from __future__ import annotations

import numpy as np


class PageTable:
    def __init__(self, rows: int = 64, width: int = 64) -> None:
        self.table = np.zeros((rows, width), dtype=np.int64)
        self.rows: dict[object, int] = {}  # request -> its row
        self._lengths: dict[object, int] = {}  # request -> pages mirrored in its row
        self._free = list(range(rows - 1, -1, -1))
        self._filled: dict[int, int] = {}  # page -> a row holding only that page (padding requests)

    def sync(self, request, pages: list[int]) -> None:
        """Mirror `pages` (the request's whole page list) into its row; an empty list releases it."""
        if not pages:
            self.release(request)
            return
        row = self.rows.get(request)
        if row is None:
            row = self.rows[request] = self._take()
            self._lengths[request] = 0
        n = len(pages)
        if n > self.table.shape[1]:
            self.table = np.pad(self.table, ((0, 0), (0, max(n, 2 * self.table.shape[1]) - self.table.shape[1])),
                                mode="edge")
        start = self._lengths[request]
        if start > n:
            start = 0
        self.table[row, start:n] = pages[start:]
        self.table[row, n:] = pages[-1]
        self._lengths[request] = n

    def release(self, request) -> None:
        row = self.rows.pop(request, None)
        if row is not None:
            self._lengths.pop(request)
            self._free.append(row)

    def gather(self, requests: list, width: int, pad_rows: int = 0, pad_page: int = 0) -> np.ndarray:
        """[len(requests) + pad_rows, width] page ids of these requests (each must hold pages), then
        `pad_rows` rows of `pad_page` only: one fancy index (padding reads a row kept filled)."""
        if width > self.table.shape[1]:
            self.table = np.pad(self.table, ((0, 0), (0, width - self.table.shape[1])), mode="edge")
        rows = self.rows
        index = [rows[r] for r in requests]
        if pad_rows:
            row = self._filled.get(pad_page)
            if row is None:
                row = self._filled[pad_page] = self._take()
                self.table[row] = pad_page
            index += [row] * pad_rows
        return self.table[np.array(index, dtype=np.int64), :width]

    def _take(self) -> int:
        if not self._free:
            old = self.table.shape[0]
            self.table = np.pad(self.table, ((0, old), (0, 0)))
            self._free = list(range(2 * old - 1, old - 1, -1))
        return self._free.pop()
