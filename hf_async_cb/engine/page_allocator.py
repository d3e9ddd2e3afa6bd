"""The KV pool's page allocator: a free list with reference counts. Pure Python, no torch.

With a prefix cache, a page whose last holder lets go keeps its K/V for a later request with the
same prefix: it waits in an LRU list (counted as free) and is handed out only when the free list is
empty, the cache dropping its entry then. A cached page taken back by a request (`share`) leaves
that list."""

from __future__ import annotations

from collections import OrderedDict
from typing import Protocol


class PageCache(Protocol):
    def is_cached(self, page: int) -> bool: ...

    def evict(self, page: int) -> None: ...


class PageAllocator:
    """Free list with reference counts (a page shared by several sequences is freed last)."""

    def __init__(self, num_pages: int, cache: PageCache | None = None) -> None:
        if num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {num_pages}.")
        self.num_pages = num_pages
        self.cache = cache
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low pages first
        self._refs = [0] * num_pages
        self._evictable: OrderedDict[int, None] = OrderedDict()  # unheld cached pages, oldest first

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_free(self) -> int:
        """Free pages that still hold a cached prefix."""
        return len(self._evictable)

    def allocate(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > self.num_free:
            raise MemoryError(f"asked for {n} KV pages, {self.num_free} free")
        free = self._free
        pages = [free.pop() for _ in range(min(n, len(free)))]
        while len(pages) < n:  # the least recently used cached pages go last
            page, _ = self._evictable.popitem(last=False)
            self.cache.evict(page)
            pages.append(page)
        for p in pages:
            self._refs[p] = 1
        return pages

    def _check(self, page: int) -> None:
        if not 0 <= page < self.num_pages:
            raise ValueError(f"page {page} is not in the pool [0, {self.num_pages})")

    def share(self, pages: list[int]) -> None:
        """One more holder for each page: allocated ones, or cached ones no request holds."""
        for p in pages:
            self._check(p)
            if self._refs[p] <= 0:
                if p not in self._evictable:
                    raise RuntimeError(f"page {p} is not allocated and cannot be shared")
                del self._evictable[p]
            self._refs[p] += 1

    def free(self, pages: list[int]) -> None:
        """Let go of each page; the last holder's release makes it free, or evictable when it is
        cached. Pages are given in their request's order: the later ones are evicted first."""
        cache = self.cache
        released = []
        for p in reversed(pages):
            self._check(p)
            if self._refs[p] <= 0:
                raise RuntimeError(f"page {p} freed twice")
            self._refs[p] -= 1
            if self._refs[p] == 0:
                if cache is not None and cache.is_cached(p):
                    self._evictable[p] = None
                else:
                    released.append(p)
        self._free.extend(reversed(released))

    def uncache(self, pages: list[int]) -> None:
        """These pages no longer hold cached K/V (the cache was cleared): the unheld ones are free."""
        for p in pages:
            if p in self._evictable:
                del self._evictable[p]
                self._free.append(p)

    def ref_count(self, page: int) -> int:
        return self._refs[page]
