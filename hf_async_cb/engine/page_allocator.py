"""The KV pool's page allocator: a free list with reference counts. Pure Python, no torch."""

from __future__ import annotations


class PageAllocator:
    """Free list with reference counts (a page shared by several sequences is freed last)."""

    def __init__(self, num_pages: int) -> None:
        if num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {num_pages}.")
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low pages first
        self._refs = [0] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            raise MemoryError(f"asked for {n} KV pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def _check(self, page: int) -> None:
        if not 0 <= page < self.num_pages:
            raise ValueError(f"page {page} is not in the pool [0, {self.num_pages})")

    def share(self, pages: list[int]) -> None:
        for p in pages:
            self._check(p)
            if self._refs[p] <= 0:
                raise RuntimeError(f"page {p} is not allocated and cannot be shared")
            self._refs[p] += 1

    def free(self, pages: list[int]) -> None:
        for p in pages:
            self._check(p)
            if self._refs[p] <= 0:
                raise RuntimeError(f"page {p} freed twice")
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.append(p)

    def ref_count(self, page: int) -> int:
        return self._refs[page]
