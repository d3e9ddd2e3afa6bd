"""Prefix caching: requests that share a prompt prefix compute its K/V once, within a call, across
calls and online. Pure Python, no torch (tested with the scheduler on the CPU alone).

A full page is named by its tokens and the page before it: its key is (the previous page's entry
id, its page_size tokens). The dict lookup compares the tokens themselves, so two prefixes share
an entry only when they are equal token for token (never by a hash collision), and a chain is
reachable only from its first page: ids are never reused, so the descendants of an evicted entry
can no longer be found and are evicted in their turn.

An entry's life:
  fresh      registered when the step that writes the page's K/V is scheduled. No request may
             take it in that same step: it is read from the next step on, which runs after the
             writing one on the compute stream (the async loop included: steps queue in order).
  ready      from the next schedule() on (`begin_step`).
  held       while a request's page list holds it (its reference count in the allocator).
  evictable  once no request holds it: the allocator keeps the page out of its free list, least
             recently used first, and hands it out only when no free page is left, dropping the
             entry then (`evict`).
A request about to compute a page that another running request is computing (claimed) or has just
scheduled (fresh) waits a step instead, and then takes the page from the cache: rows that repeat
a prompt (RL groups, num_return_sequences) prefill it once.

What else shapes a page's K/V (the weights, an adapter, the dtype) is not in the key: the engine
clears the cache when the model's fingerprint changes (model/kv_fingerprint.py), which costs one
check per call instead of a salt in every key.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

ROOT = 0  # the parent id of a prompt's first page


@dataclass(slots=True)
class CacheEntry:
    id: int
    page: int
    ready: bool = False


@dataclass
class PrefixCacheStats:
    """What the cache saved, for the profiler, the bench output and users."""

    hit_tokens: int = 0  # prompt tokens taken from the cache instead of computed
    prefilled_tokens: int = 0  # prompt (and recomputed) tokens fed to the model
    evictions: int = 0  # cached pages handed out again
    deferrals: int = 0  # admissions put off a step to take a page another request was computing
    copied_pages: int = 0  # cached last pages taken as copies (their request fed one token, not a page)
    clears: int = 0  # the cache emptied (the model changed, a step failed, or asked for)

    @property
    def hit_rate(self) -> float:
        total = self.hit_tokens + self.prefilled_tokens
        return self.hit_tokens / total if total else 0.0

    def as_dict(self) -> dict:
        return dict(hit_tokens=self.hit_tokens, prefilled_tokens=self.prefilled_tokens, evictions=self.evictions,
                    deferrals=self.deferrals, copied_pages=self.copied_pages, clears=self.clears,
                    hit_rate=round(self.hit_rate, 4))


@dataclass
class PrefixCache:
    page_size: int
    stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)

    def __post_init__(self) -> None:
        self._entries: dict[tuple, CacheEntry] = {}  # (parent id, tokens) -> entry
        self._by_page: dict[int, tuple] = {}  # page -> its key
        self._fresh: list[CacheEntry] = []  # registered since the last begin_step()
        self._claims: dict[tuple, object] = {}  # key -> the running request computing that page
        self._ids = itertools.count(ROOT + 1)

    def __len__(self) -> int:
        return len(self._entries)

    def page_key(self, parent: int, tokens: list[int], index: int, embeds=None) -> tuple:
        """Page `index` of `tokens` after the entry `parent`; with prompt embeddings
        (engine/prompt_embeds.py) a page holding embedded positions is keyed by their content too."""
        size = self.page_size
        start = index * size
        key = parent, tuple(tokens[start:start + size])
        if embeds is not None:
            salt = embeds.page_salt(start, start + size)
            if salt is not None:
                key = (*key, salt)
        return key

    # -- steps -----------------------------------------------------------------------------------
    def begin_step(self) -> None:
        """The previous step is queued: what it writes may be read by this step and later ones."""
        for entry in self._fresh:
            entry.ready = True
        self._fresh.clear()

    # -- lookups ---------------------------------------------------------------------------------
    def match(self, tokens: list[int], max_pages: int, embeds=None) -> list[CacheEntry]:
        """The ready entries of the longest cached prefix of `tokens`, at most `max_pages` pages."""
        found: list[CacheEntry] = []
        parent = ROOT
        entries = self._entries
        for index in range(max_pages):
            entry = entries.get(self.page_key(parent, tokens, index, embeds))
            if entry is None or not entry.ready:
                break
            found.append(entry)
            parent = entry.id
        return found

    def busy(self, key: tuple, request: object) -> bool:
        """Whether another request is computing the page `key` names (or has just scheduled it)."""
        entry = self._entries.get(key)
        if entry is not None and not entry.ready:
            return True
        claimant = self._claims.get(key)
        return claimant is not None and claimant is not request

    # -- updates ---------------------------------------------------------------------------------
    def register(self, key: tuple, page: int) -> int:
        """`page` holds (or its queued step will write) the K/V `key` names; returns the entry id to
        chain the next page on. A key already cached (the same prefix computed twice) keeps its
        entry, and `page` stays its request's own."""
        entry = self._entries.get(key)
        if entry is not None:
            return entry.id
        entry = CacheEntry(next(self._ids), page)
        self._entries[key] = entry
        self._by_page[page] = key
        self._fresh.append(entry)
        return entry.id

    def claim(self, key: tuple, request: object) -> None:
        self._claims.setdefault(key, request)

    def unclaim(self, key: tuple, request: object) -> None:
        if self._claims.get(key) is request:
            del self._claims[key]

    def drop_fresh(self, pages: list[int]) -> None:
        """A request preempted in the step that registered these pages: that step no longer writes
        them, so the entries go (pages registered in earlier steps were written and stay)."""
        for page in pages:
            key = self._by_page.get(page)
            if key is not None and not self._entries[key].ready:
                del self._entries[key]
                del self._by_page[page]

    def is_cached(self, page: int) -> bool:
        return page in self._by_page

    def evict(self, page: int) -> None:
        """The allocator hands `page` out again: forget what it held."""
        key = self._by_page.pop(page, None)
        if key is not None:
            del self._entries[key]
            self.stats.evictions += 1

    def clear(self) -> list[int]:
        """Forget every entry (and claim); returns the pages that were cached."""
        pages = list(self._by_page)
        self._entries.clear()
        self._by_page.clear()
        self._fresh.clear()
        self._claims.clear()
        self.stats.clears += 1
        return pages
