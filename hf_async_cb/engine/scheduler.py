"""Which requests run in the next step. Pure Python: no torch, no device.

Every step gets a token budget (max_batch_tokens). Running requests that decode (one token each)
come first, oldest first; then running requests still prefilling continue their prompt in chunks;
then waiting requests are admitted while budget, pages and running slots last. A step that
decodes gives prompts at most `mixed_prefill_tokens` of its budget (when set), so that a long
prompt arriving does not stretch the step every decoding request waits on. When a running
request needs a page and none is free, the newest running request is preempted: its pages are
freed and it goes back to the front of the queue, to be recomputed from its tokens later.

With a prefix cache (engine/prefix_cache.py), an admitted request first takes the cached pages of
its longest cached prefix and prefills only the rest (all of them cached, the last page included: it
takes that one as a copy, made on the device before its step, and feeds its last token alone); a
request whose next page another running request is computing waits a step for it instead of
computing it too. Every full page a step computes is registered as it is scheduled (prompt pages),
or when its request finishes (pages of generated tokens). A preempted request's pages stay cached:
they are the cheapest to get back.
"""

from __future__ import annotations

from collections import deque

from hf_async_cb.engine.page_allocator import PageAllocator
from hf_async_cb.engine.page_table import PageTable
from hf_async_cb.engine.prefix_cache import ROOT, PrefixCache
from hf_async_cb.engine.requests import Request, RequestStatus
from hf_async_cb.engine.step_plan import ScheduledChunk, StepPlan

# A request whose whole known sequence is cached takes its last page as a copy and feeds one token
# (False: it computes that page again, as before; for A/B runs: tools/shared_prefix.py's cache-on-recompute).
COPY_CACHED_LAST_PAGE = True


class Scheduler:
    def __init__(self, allocator: PageAllocator, page_size: int, max_batch_tokens: int,
                 max_running_requests: int, mixed_prefill_tokens: int | None = None,
                 prefix_cache: PrefixCache | None = None) -> None:
        self.allocator = allocator
        self.prefix_cache = prefix_cache
        if prefix_cache is not None:
            allocator.cache = prefix_cache
        # Per request (prefix cache only): the entry ids of its first pages, cached or registered
        # (None: the cache was cleared under it, it registers nothing more), and the key it claims.
        self._chains: dict[Request, list[int] | None] = {}
        self._claims: dict[Request, tuple] = {}
        # A request whose last page is copied from a cached one: that page, held (a reference in the
        # allocator) from its admission until its copy is queued, so no allocation hands it out first.
        self._tail_sources: dict[Request, int] = {}
        self._copy_holds: dict[Request, int] = {}  # held for copies of the step queued last
        self.page_size = page_size
        self.max_batch_tokens = max_batch_tokens
        self.mixed_prefill_tokens = mixed_prefill_tokens
        self.max_running_requests = max_running_requests
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_shared_tokens = 0  # prompt tokens copies took from their leader instead of recomputing
        self.num_with_embeds = 0  # requests queued or running that feed prompt embeddings
        self.page_table = PageTable()  # the running requests' pages, mirrored at every change below

    # -- queue -----------------------------------------------------------------------------
    def check_fits_tokens(self, tokens: int, num_pages_given: bool = False, num_pages: int | None = None) -> None:
        """Raise ValueError if a row holding up to `tokens` tokens of KV (Request.max_total_tokens:
        prompt + max_new_tokens - 1, the last sampled token is never fed) could never fit in the
        pool, even alone. `num_pages_given`: the pool's size is BatchingConfig.num_pages, not a
        memory budget (the advice then names it). `num_pages`: the most pages a rebuilt pool could
        get, when that is more than this pool has."""
        pages = self.allocator.num_pages if num_pages is None else num_pages
        capacity = pages * self.page_size
        if tokens > capacity:
            bound = ("as BatchingConfig.num_pages sets it; raise num_pages" if num_pages_given else
                     "all its memory budget allows; raise BatchingConfig.kv_memory_fraction (cpu_kv_cache_bytes on "
                     "the CPU)")
            holds = "holds" if num_pages is None else "could hold at most"
            raise ValueError(
                f"a row needs up to {tokens} tokens of KV cache (prompt + max_new_tokens - 1) but the pool {holds} "
                f"{capacity} ({pages} pages of {self.page_size}), {bound} or lower max_new_tokens.")

    def check_fits(self, request: Request) -> None:
        """Raise ValueError if `request` could never fit in the pool, even alone."""
        capacity = self.allocator.num_pages * self.page_size
        if request.max_total_tokens > capacity:
            raise ValueError(
                f"prompt ({len(request.prompt_token_ids)} tokens) + max_new_tokens "
                f"({request.params.max_new_tokens}) needs up to {request.max_total_tokens} tokens of KV cache "
                f"but the pool holds {capacity} ({self.allocator.num_pages} pages of {self.page_size}); "
                "raise BatchingConfig.num_pages (or its memory budget) or lower max_new_tokens."
            )

    def add(self, request: Request) -> None:
        self.check_fits(request)
        request.status = RequestStatus.WAITING
        self.waiting.append(request)
        if request.embeds is not None:
            self.num_with_embeds += 1

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step ----------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        budget = self.max_batch_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[Request] = []
        cache = self.prefix_cache
        copies: list[tuple[int, int]] = []
        if cache is not None:
            cache.begin_step()
            if self._copy_holds:  # the step that copies them is queued: later writes run after it
                self.allocator.free(list(self._copy_holds.values()))
                self._copy_holds.clear()
        # One pass over the running requests schedules the decodes as it meets them (oldest first,
        # one token each) and sets the prefills aside for after them. A request whose last sampled
        # tokens are all still in flight has nothing left to run. (Request.wants_more_tokens and
        # num_tokens inlined: this loop runs over every running request, every step.)
        prefilling: list[tuple[Request, int]] = []
        page_size = self.page_size
        # Requests whose last token is in flight (the async loop builds this step before it sees
        # the step before's tokens) give their place to a waiting request now: they run no more,
        # and it would otherwise wait a step longer than in the sync loop for every place that frees.
        leaving = 0
        for req in self.running[:]:  # a copy: preemption removes requests from the list
            if preempted and req.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            sampled = len(req.output_token_ids) + req.num_pending
            if sampled >= req.params.max_new_tokens:
                leaving += 1
                continue
            start = req.num_computed
            left = len(req.prompt_token_ids) + sampled - start
            if left != 1:
                prefilling.append((req, left))
                continue
            if budget == 0:
                break  # no room for any chunk, decode or prefill
            # Most decode steps need no new page: skip the allocator then.
            if start >= len(req.pages) * page_size:
                victims = self._reserve(req, 1)
                if victims:
                    budget, chunks = self._drop(victims, preempted, budget, chunks)
                    if req in victims:
                        continue
            chunks.append(ScheduledChunk(req, start, 1, True))
            budget -= 1
        if chunks and self.mixed_prefill_tokens is not None:  # decodes wait on this step: keep it short
            budget = min(budget, self.mixed_prefill_tokens)
        for req, left in prefilling:
            if budget <= 0:  # (below 0 after a chunk that could not end inside a bidirectional block)
                break
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = min(left, budget)
            if req.embeds is not None:
                n = req.embeds.chunk_end(req.num_computed, req.num_computed + n) - req.num_computed
            fits = req.num_computed + n <= len(req.pages) * page_size
            victims = () if fits else self._reserve(req, n)
            if victims:
                budget, chunks = self._drop(victims, preempted, budget, chunks)
                if req in victims:
                    continue
            chunks.append(ScheduledChunk(req, req.num_computed, n, n == left))
            budget -= n
            if cache is not None:
                self._prefilled(req, req.num_computed + n)
        # Admit new requests only when nothing was preempted: freed pages go to the preempted first.
        deferred: list[Request] = []
        while (budget > 0 and self.waiting and not preempted
               and len(self.running) - leaving < self.max_running_requests):
            req = self.waiting[0]
            if not req.wants_more_tokens:
                break  # preempted with its last token in flight: it finishes when that token lands
            if cache is not None:
                if not self._attach_cached_prefix(req):
                    deferred.append(self.waiting.popleft())  # another request is computing its next page
                    continue
            elif self._waits_for_leader(req):
                deferred.append(self.waiting.popleft())  # admitted once its leader's prompt is cached
                continue
            else:
                self._attach_shared_prefix(req)
            n = min(req.num_tokens - req.num_computed, budget)
            if req.embeds is not None:
                n = req.embeds.chunk_end(req.num_computed, req.num_computed + n) - req.num_computed
            needed = self._pages_needed(req, n)
            if needed > self.allocator.num_free:
                self._detach_shared_prefix(req)
                break
            self.waiting.popleft()
            req.pages.extend(self.allocator.allocate(needed))
            self.page_table.sync(req, req.pages)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            chunks.append(self._chunk(req, n))
            budget -= n
            if cache is not None:
                source = self._tail_sources.pop(req, None)
                if source is not None:
                    copies.append((source, req.pages[req.num_computed // self.page_size]))
                    self._copy_holds[req] = source
                    cache.stats.copied_pages += 1
                self._prefilled(req, req.num_computed + n)
        self.waiting.extendleft(reversed(deferred))
        return StepPlan(chunks, preempted, self.num_with_embeds > 0, tuple(copies))

    @staticmethod
    def _drop(victims: list[Request], preempted: list[Request], budget: int,
              chunks: list[ScheduledChunk]) -> tuple[int, list[ScheduledChunk]]:
        """Record preempted requests; a victim may already have a chunk in this step (decodes go
        before older prefills): its tokens go back to the budget."""
        preempted.extend(victims)
        budget += sum(c.num_tokens for c in chunks if c.request in victims)
        return budget, [c for c in chunks if c.request not in victims]

    # -- prompt sharing (num_return_sequences) --------------------------------------------------
    def _shared_length(self, req: Request) -> int:
        """Tokens of the prompt a copy can take from its leader: its full pages, the last token excluded
        (each copy feeds that one itself, to sample its own first token), and never ending inside a
        bidirectional block (its tokens see the block's later ones: the copy computes the block)."""
        return self._whole_blocks(req, (len(req.prompt_token_ids) - 1) // self.page_size) * self.page_size

    def _whole_blocks(self, req: Request, pages: int) -> int:
        """The most of the prompt's first `pages` pages another request's K/V can stand for: up to a
        page end that holds whole bidirectional blocks (a block's K/V depend on its later tokens)."""
        while pages and req.embeds is not None and not req.embeds.ends_cleanly(pages * self.page_size):
            pages -= 1
        return pages

    def _waits_for_leader(self, req: Request) -> bool:
        leader = req.share_from
        return (leader is not None and req.num_computed == 0 and leader.status is RequestStatus.RUNNING
                and leader.num_computed < self._shared_length(req))

    def _attach_shared_prefix(self, req: Request) -> None:
        """Start a copy from its leader's cached prompt pages, if they are still there."""
        leader, length = req.share_from, self._shared_length(req)
        if (leader is None or req.num_computed or length == 0 or leader.status is not RequestStatus.RUNNING
                or leader.num_computed < length):
            return
        req.pages = leader.pages[: length // self.page_size]
        self.allocator.share(req.pages)
        self.page_table.sync(req, req.pages)
        req.num_computed = length
        self.num_shared_tokens += length

    def _detach_shared_prefix(self, req: Request) -> None:
        if self.prefix_cache is not None:
            self._release_cache_state(req)
            self.prefix_cache.stats.hit_tokens -= req.num_computed
        if req.num_computed:
            self.num_shared_tokens -= req.num_computed
            req.num_computed = 0
        if req.pages:
            self.allocator.free(req.pages)
            req.pages = []
            self.page_table.release(req)

    # -- prefix cache ----------------------------------------------------------------------------------
    def _attach_cached_prefix(self, req: Request) -> bool:
        """Start `req` from the cached pages of its longest cached prefix (at least one known token
        is left to feed: it samples after it). When every page of its known tokens is cached, the
        last one included (a repeated prompt filling whole pages), it shares all but that one and
        takes that one as a copy (its own: it writes its last token's K/V there), so it feeds one token
        instead of a page. False when the page after the cached ones is being computed by another
        request: `req` then waits a step and takes it from the cache."""
        cache, size = self.prefix_cache, self.page_size
        known = req.num_known_tokens
        tokens = req.token_ids(0, known)
        shareable = (known - 1) // size  # pages wholly before the last known token
        copyable = (COPY_CACHED_LAST_PAGE and size > 1  # (a page of one token holds nothing to copy)
                    # and the last token can be fed alone: not in a bidirectional block with those before it
                    and (req.embeds is None or req.embeds.ends_cleanly(known - 1)))
        full = known // size if copyable else shareable  # the pages it may take, a copied last one included
        found = cache.match(tokens, full, req.embeds)
        found = found[:self._whole_blocks(req, len(found))]
        chain = [e.id for e in found]
        index = len(found)
        if index < full:
            key = cache.page_key(chain[-1] if chain else ROOT, tokens, index, req.embeds)
            if cache.busy(key, req):
                cache.stats.deferrals += 1
                return False
        self._chains[req] = chain
        tail = found.pop() if index > shareable else None  # the last page too: copied at admission
        if found:
            req.pages = [e.page for e in found]
            self.allocator.share(req.pages)
            self.page_table.sync(req, req.pages)
        taken = len(found) * size
        if tail is not None:
            self.allocator.share([tail.page])
            if self.allocator.num_free:
                self._tail_sources[req] = tail.page
                taken += size - 1
            else:  # no page left to copy it into: compute it instead (a page of its own either way)
                self.allocator.free([tail.page])
                chain.pop()
        if taken:
            req.num_computed = taken
            self.num_shared_tokens += taken
            cache.stats.hit_tokens += taken
        return True

    def _prefilled(self, req: Request, end: int) -> None:
        """A chunk of `req` up to token `end` is scheduled: register its full prompt pages, and claim
        the next one (another request needing it waits for it rather than computing it too)."""
        cache = self.prefix_cache
        cache.stats.prefilled_tokens += end - req.num_computed
        self._register(req, min(end, len(req.prompt_token_ids)))
        chain = self._chains.get(req)
        if chain is None:
            return
        self._unclaim(req)
        index = len(chain)
        if (index + 1) * self.page_size <= len(req.prompt_token_ids):
            key = cache.page_key(chain[-1] if chain else ROOT, req.prompt_token_ids, index, req.embeds)
            cache.claim(key, req)
            self._claims[req] = key

    def _register(self, req: Request, end: int) -> None:
        """Register the pages of `req` that hold tokens [0, end) in full and are not registered yet."""
        chain = self._chains.get(req)
        if chain is None:
            return
        size, cache = self.page_size, self.prefix_cache
        index = len(chain)
        if (index + 1) * size > end:
            return
        tokens = req.token_ids(0, end)
        while (index + 1) * size <= end:
            chain.append(cache.register(cache.page_key(chain[-1] if chain else ROOT, tokens, index, req.embeds),
                                        req.pages[index]))
            index += 1

    def _unclaim(self, req: Request) -> None:
        key = self._claims.pop(req, None)
        if key is not None:
            self.prefix_cache.unclaim(key, req)

    def held_for_copies(self) -> list[int]:
        """Pages held for copies not yet queued, or queued in the last step (one entry per hold)."""
        return [*self._tail_sources.values(), *self._copy_holds.values()]

    def _release_cache_state(self, req: Request) -> None:
        self._unclaim(req)
        self._chains.pop(req, None)
        for held in (self._tail_sources, self._copy_holds):
            page = held.pop(req, None)
            if page is not None:
                self.allocator.free([page])

    def clear_prefix_cache(self) -> None:
        """Forget every cached page (the model changed, or a step failed): requests still running
        keep their pages but register no more, free cached pages become plain free ones."""
        cache = self.prefix_cache
        if cache is None:
            return
        self.allocator.uncache(cache.clear())
        self._claims.clear()
        for req in self._chains:
            self._chains[req] = None

    def _chunk(self, req: Request, n: int) -> ScheduledChunk:
        start = req.num_computed
        return ScheduledChunk(req, start, n, samples=start + n == req.num_tokens)

    def _pages_needed(self, req: Request, n: int) -> int:
        total = req.num_computed + n
        return max(0, -(-total // self.page_size) - len(req.pages))

    def _reserve(self, req: Request, n: int) -> list[Request]:
        """Give `req` pages for n more tokens, preempting the newest running requests if needed.

        Returns the preempted requests; `req` is among them when it was the newest left.
        """
        victims: list[Request] = []
        needed = self._pages_needed(req, n)
        while needed > self.allocator.num_free:
            victim = self.running[-1]
            self.preempt(victim)
            victims.append(victim)
            if victim is req:
                return victims
        if needed:
            req.pages.extend(self.allocator.allocate(needed))
            self.page_table.sync(req, req.pages)
        return victims

    def preempt(self, req: Request) -> None:
        self.running.remove(req)
        if self.prefix_cache is not None:
            self.prefix_cache.drop_fresh(req.pages)  # its chunk of this step, if any, is dropped
            self._release_cache_state(req)
        self.allocator.free(req.pages)
        req.pages = []
        self.page_table.release(req)
        req.num_computed = 0
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)

    # -- after a step --------------------------------------------------------------------------
    def finish(self, req: Request, status: RequestStatus = RequestStatus.FINISHED) -> None:
        """Remove a request and free its pages (the caller knows no queued step reads them)."""
        queued = True
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        else:
            queued = False
        if queued and req.embeds is not None:
            self.num_with_embeds -= 1
        if self.prefix_cache is not None:
            if status is RequestStatus.FINISHED and req.pages:  # its generated tokens' full pages too
                self._register(req, min(req.num_computed, req.num_known_tokens - 1))
            self._release_cache_state(req)
        if req.pages:
            self.allocator.free(req.pages)
            req.pages = []
        self.page_table.release(req)
        req.status = status
