"""Property tests of prefix caching in the Scheduler and the PageAllocator (no torch, no device).

The simulation of test_scheduler_properties.Sim runs with a PrefixCache, and models the KV pool
itself: every page slot holds a stand-in for the K/V of one position, the tuple of all the tokens
up to it (what a position's K/V depends on). A step first reads, for each chunk, every position
before the chunk's start from the request's pages, and only then writes its chunks' positions
(stricter than the device, where a layer stores before it attends: no request may read what
another writes in the same step). Every read must find exactly the K/V of the request's own
tokens: a cached page taken before it was written, after it was handed to another request, or
under another prefix fails here. Prompts share prefixes by construction and fork at random
points, so hits, deferrals, evictions and preemptions all happen.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_scheduler_properties import Config, Sim, Spec, ceil_div, specs

from hf_async_cb.engine.page_allocator import PageAllocator
from hf_async_cb.engine.prefix_cache import PrefixCache
from hf_async_cb.engine.requests import Request, RequestStatus, SamplingParams
from hf_async_cb.engine.scheduler import Scheduler

EOS = 0


class CachedSim(Sim):
    def __init__(self, cfg: Config, specs_: list[Spec], forks: list[tuple[int, int]], overlap: bool = False):
        super().__init__(cfg, specs_, overlap)
        self.cache = PrefixCache(cfg.page_size)
        self.allocator = PageAllocator(cfg.num_pages)
        self.scheduler = Scheduler(self.allocator, cfg.page_size, cfg.max_batch_tokens, cfg.max_running_requests,
                                   prefix_cache=self.cache)
        self.forks = dict(zip(map(id, specs_), forks))
        self.slots: dict[tuple[int, int], tuple] = {}  # (page, offset) -> the tokens its K/V stands for
        self.reads = 0
        self.plans = []

    def _add(self, spec: Spec) -> None:
        fork, variant = self.forks[id(spec)]
        before = len(self.accepted)
        super()._add(spec)
        if len(self.accepted) > before:
            req = self.accepted[-1][0]
            req.prompt_token_ids = [i + 1 if i < fork else 100 * variant + i for i in range(spec.prompt_len)]

    def _tokens(self, req: Request, stop: int) -> list[int]:
        """The request's tokens [0, stop), a token still in flight included (its script's next)."""
        known = req.token_ids(0, min(stop, req.num_known_tokens))
        if stop > req.num_known_tokens:
            known.append(self.spec_of[id(req)].script[len(req.output_token_ids)])
        return known

    def on_plan(self, plan) -> None:
        """Model the pool: reads first (positions before each chunk hold its own tokens' K/V), then
        this step's writes."""
        super().on_plan(plan)
        self.plans.append(plan)
        size = self.cfg.page_size
        for source, destination in plan.page_copies:  # before the forward, as Pipeline._enqueue does
            for offset in range(size):
                self.slots[(destination, offset)] = self.slots.get((source, offset))
        for c in plan.chunks:
            tokens = self._tokens(c.request, c.start)
            for pos in range(c.start):
                page = c.request.pages[pos // size]
                assert self.slots.get((page, pos % size)) == tuple(tokens[:pos + 1]), (
                    f"{c.request.request_id} reads position {pos} of page {page}: not its K/V")
                self.reads += 1
        for c in plan.chunks:
            tokens = self._tokens(c.request, c.start + c.num_tokens)
            for pos in range(c.start, c.start + c.num_tokens):
                self.slots[(c.request.pages[pos // size], pos % size)] = tuple(tokens[:pos + 1])

    def check_plan(self, plan, running_before) -> None:
        sched, cfg = self.scheduler, self.cfg
        assert 0 < plan.num_tokens <= cfg.max_batch_tokens
        for c in plan.chunks:
            assert c.request.status is RequestStatus.RUNNING
            assert c.start == c.request.num_computed
            assert 1 <= c.num_tokens and c.start + c.num_tokens <= c.request.num_tokens
            assert len(c.request.pages) >= ceil_div(c.start + c.num_tokens, cfg.page_size)
            own = c.request.pages[c.start // cfg.page_size:]
            for page in own:  # a request writes only into pages no other request holds
                assert self.allocator.ref_count(page) == 1, "a chunk writes into a shared page"
        for r in plan.preempted:
            assert r.pages == [] and r.num_computed == 0 and r in sched.waiting

    def check_state(self) -> None:
        sched, alloc, cfg = self.scheduler, self.allocator, self.cfg
        # (a request whose last token is in flight has given its place to a waiting one already)
        leaving = sum(r.num_sampled >= r.params.max_new_tokens for r in sched.running)
        assert len(sched.running) - leaving <= cfg.max_running_requests
        holders: dict[int, int] = {}
        for req in sched.running:
            assert req.status is RequestStatus.RUNNING
            assert len(set(req.pages)) == len(req.pages)
            for p in req.pages:
                holders[p] = holders.get(p, 0) + 1
        for p in sched.held_for_copies():  # a cached page kept for a copy until its step is queued
            holders[p] = holders.get(p, 0) + 1
        for p, n in holders.items():
            assert alloc.ref_count(p) == n, "a page's reference count is not its holders"
        assert len(holders) + alloc.num_free == cfg.num_pages, "pages leaked or freed twice"
        for req in sched.waiting:
            assert req.pages == [] and req.num_computed == 0

    def check_final(self) -> None:
        super().check_final()
        assert not self.scheduler._chains and not self.scheduler._claims and not self.scheduler.held_for_copies()


def forks_for(data, reqs):
    return [data.draw(st.tuples(st.integers(0, 24), st.integers(0, 2)), label="fork") for _ in reqs]


modes = pytest.mark.parametrize("overlap", [False, True], ids=["sync", "async"])


@modes
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=st.builds(Config, num_pages=st.integers(1, 24), page_size=st.integers(1, 8),
                     max_batch_tokens=st.integers(1, 48), max_running_requests=st.integers(1, 8)),
       reqs=st.lists(specs(), min_size=1, max_size=10), data=st.data())
def test_cached_prefixes_read_only_their_own_kv(overlap, cfg, reqs, data):
    """Any workload of prompts sharing prefixes: every position a step reads holds the K/V of the
    reading request's own tokens, pages are never leaked or double freed, every request finishes
    with its script's tokens."""
    sim = CachedSim(cfg, reqs, forks_for(data, reqs), overlap)
    sim.run()


@modes
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(page_size=st.integers(1, 4), extra_pages=st.integers(0, 3), max_batch_tokens=st.integers(1, 32),
       max_running_requests=st.integers(1, 8),
       reqs=st.lists(specs(max_prompt=12, max_new=12, max_arrival=8), min_size=2, max_size=8), data=st.data())
def test_cached_prefixes_under_preemption(overlap, page_size, extra_pages, max_batch_tokens, max_running_requests,
                                          reqs, data):
    """A pool just big enough for the largest request: preemption and eviction all the time."""
    largest = max(s.prompt_len + s.max_new_tokens - 1 for s in reqs)
    cfg = Config(ceil_div(largest, page_size) + extra_pages, page_size, max_batch_tokens, max_running_requests)
    sim = CachedSim(cfg, reqs, forks_for(data, reqs), overlap)
    sim.run()
    assert not sim.rejected


@modes
@pytest.mark.parametrize("prompt_len, own", [(40, 1), (38, 2)], ids=["whole-pages", "partial-page"])
def test_repeated_prompt_is_prefilled_once(overlap, prompt_len, own):
    """Eight rows of one prompt arriving together: the first prefills it, the others wait a step for
    its pages; then each feeds only its last token when the prompt fills whole pages (its last page
    a copy of the first row's), or else its last partial page."""
    cfg = Config(num_pages=64, page_size=4, max_batch_tokens=400, max_running_requests=8)
    reqs = [Spec(prompt_len, 3, [5, 6, 7], use_eos=False, arrival=0) for _ in range(8)]
    sim = CachedSim(cfg, reqs, [(prompt_len, 0)] * 8, overlap)
    sim.run()
    stats = sim.cache.stats
    assert stats.hit_tokens == 7 * (prompt_len - own)
    assert stats.prefilled_tokens == prompt_len + 7 * own
    assert stats.deferrals == 7
    copies = [plan.page_copies for plan in sim.plans if plan.page_copies]
    assert sum(map(len, copies)) == (7 if own == 1 else 0)


def test_a_copy_needs_a_page_to_spare():
    """A pool that holds one row and no more: the repeated row cannot keep the cached last page and
    take another to copy it into, so it computes that page again (and still finishes)."""
    cfg = Config(num_pages=3, page_size=4, max_batch_tokens=64, max_running_requests=1)
    reqs = [Spec(12, 1, [5], use_eos=False, arrival=0) for _ in range(2)]
    sim = CachedSim(cfg, reqs, [(12, 0)] * 2, False)
    sim.run()
    assert sim.cache.stats.hit_tokens == 8 and not any(plan.page_copies for plan in sim.plans)


def test_freed_cached_pages_are_evicted_least_recent_first_and_only_when_needed():
    cache = PrefixCache(2)
    alloc = PageAllocator(4, cache)
    a = alloc.allocate(2)
    cache.register(cache.page_key(0, [1, 2, 3, 4], 0), a[0])
    alloc.free(a)  # a[0] cached, a[1] plain free
    assert alloc.num_free == 4 and alloc.num_cached_free == 1
    b = alloc.allocate(3)
    assert a[0] not in b and cache.is_cached(a[0])  # free pages go first
    c = alloc.allocate(1)
    assert c == [a[0]] and not cache.is_cached(a[0]) and cache.stats.evictions == 1
    with pytest.raises(MemoryError):
        alloc.allocate(1)
    alloc.free(b + c)
    assert alloc.num_free == 4 and all(alloc.ref_count(p) == 0 for p in range(4))


def test_a_cached_page_taken_back_leaves_the_eviction_list():
    cache = PrefixCache(2)
    alloc = PageAllocator(2, cache)
    (page,) = alloc.allocate(1)
    cache.register(cache.page_key(0, [7, 8], 0), page)
    alloc.free([page])
    alloc.share([page])
    assert alloc.ref_count(page) == 1 and alloc.num_free == 1
    with pytest.raises(RuntimeError):
        alloc.share([1 - page])  # never allocated, never cached
    alloc.free([page])
    alloc.uncache(cache.clear())
    assert alloc.num_cached_free == 0 and alloc.num_free == 2


def test_clear_while_running_registers_nothing_more():
    cache = PrefixCache(2)
    alloc = PageAllocator(16, cache)
    sched = Scheduler(alloc, 2, 4, 4, prefix_cache=cache)
    req = Request(list(range(1, 11)), SamplingParams(max_new_tokens=2))
    sched.add(req)
    plan = sched.schedule()  # 4 of 10 prompt tokens: pages 0 and 1 registered
    req.num_computed += plan.num_tokens
    assert len(cache) == 2
    sched.clear_prefix_cache()
    assert len(cache) == 0
    plan = sched.schedule()
    req.num_computed += plan.num_tokens
    assert len(cache) == 0, "a request running through a clear registered pages on a forgotten chain"
