"""Property tests of the Scheduler, driven by a simulated model (no torch, no device).

The simulation mirrors Pipeline.step (hf_async_cb/engine/pipeline.py) in both of its modes, with the model
replaced by a script of tokens:

- launch: schedule a plan; mark each chunk's tokens as computed; every request whose chunk samples
  gets one pending token; the step goes in flight;
- complete (right away when overlap=False; one step later when overlap=True): each pending token
  lands; a request already finished drops it, any other appends it and is finished when it ends.

Sampled tokens are drawn up front by hypothesis, one script per request, so the token a request
gets next is `script[len(output)]` whatever preemptions happen; the final outputs must be exactly
the script up to the first EOS or max_new_tokens.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_async_cb.engine.page_allocator import PageAllocator
from hf_async_cb.engine.requests import FinishReason, Request, RequestStatus, SamplingParams
from hf_async_cb.engine.scheduler import Scheduler

EOS = 0
VOCAB_MAX = 5  # sampled tokens are drawn from 0..VOCAB_MAX; 0 is EOS when the request has one


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class Spec:
    """One request of a scenario: its prompt, limits, sampled-token script and arrival step."""

    prompt_len: int
    max_new_tokens: int
    script: list[int]  # token sampled at output position i is script[i]
    use_eos: bool
    arrival: int  # the step before which it is added


@dataclass
class Config:
    num_pages: int
    page_size: int
    max_batch_tokens: int
    max_running_requests: int


class Sim:
    """Runs a scenario to completion, checking the scheduler's invariants at every step."""

    def __init__(self, cfg: Config, specs: list[Spec], overlap: bool = False) -> None:
        self.cfg = cfg
        self.specs = specs
        self.overlap = overlap
        self.allocator = PageAllocator(cfg.num_pages)
        self.scheduler = Scheduler(self.allocator, cfg.page_size, cfg.max_batch_tokens,
                                   cfg.max_running_requests)
        self.accepted: list[tuple[Request, Spec]] = []
        self.rejected: list[Request] = []
        self.spec_of: dict[int, Spec] = {}
        self.discarded: dict[int, int] = {}  # id(request) -> speculative tokens dropped
        self.in_flight: deque[list[Request]] = deque()  # sample_requests of each queued step
        self.steps = 0
        self.max_steps = sum(s.prompt_len + s.max_new_tokens for s in specs) * 4 + 100

    # -- driving -----------------------------------------------------------------------------
    def _add(self, spec: Spec) -> None:
        params = SamplingParams(max_new_tokens=spec.max_new_tokens,
                                eos_token_ids=(EOS,) if spec.use_eos else ())
        req = Request(list(range(1, spec.prompt_len + 1)), params)
        capacity = self.cfg.num_pages * self.cfg.page_size
        if spec.prompt_len + spec.max_new_tokens - 1 > capacity:
            with pytest.raises(ValueError):
                self.scheduler.check_fits(req)
            with pytest.raises(ValueError):
                self.scheduler.add(req)
            assert req not in self.scheduler.waiting
            self.rejected.append(req)
            return
        self.scheduler.check_fits(req)
        self.scheduler.add(req)
        assert req.status is RequestStatus.WAITING
        self.accepted.append((req, spec))
        self.spec_of[id(req)] = spec
        self.discarded[id(req)] = 0

    def run(self) -> None:
        pending = sorted(self.specs, key=lambda s: s.arrival)
        while pending or self.scheduler.has_work:
            # Add the requests that arrive before this step; if the engine is idle, jump ahead.
            if pending and not self.scheduler.has_work and pending[0].arrival > self.steps:
                self.steps = pending[0].arrival
            while pending and pending[0].arrival <= self.steps:
                self._add(pending.pop(0))
            if not self.scheduler.has_work:
                continue
            self.step()
            self.steps += 1
            assert self.steps <= self.max_steps, (
                f"no completion after {self.steps} steps: scheduler livelock "
                f"(running={len(self.scheduler.running)}, waiting={len(self.scheduler.waiting)})"
            )
        # Pipeline.drain
        while self.in_flight:
            self.complete(self.in_flight.popleft())
        self.check_final()

    def step(self) -> None:
        """Pipeline.step: launch the next step, then complete all in-flight steps but `keep`."""
        launched = self.launch()
        keep = 1 if (self.overlap and launched) else 0
        finished = []
        while len(self.in_flight) > keep:
            finished.extend(self.complete(self.in_flight.popleft()))
        assert launched or finished or not self.scheduler.has_work, (
            "no progress: nothing scheduled, nothing finished, work left"
        )
        self.check_state()
        max_pending = 1 if self.overlap else 0
        for req, _ in self.accepted:
            assert 0 <= req.num_pending <= max_pending
        for req in self.scheduler.running:
            assert len(req.pages) >= ceil_div(req.num_computed, self.cfg.page_size)
            assert req.num_computed <= req.num_tokens
        # The page table mirrors exactly the requests holding pages, page for page.
        table = self.scheduler.page_table
        holders = [r for r, _ in self.accepted if r.pages]
        assert set(table.rows) == set(holders)
        for req in holders:
            assert table.gather([req], len(req.pages))[0].tolist() == req.pages

    def launch(self) -> bool:
        sched = self.scheduler
        running_before = list(sched.running)
        plan = sched.schedule()
        if plan.is_empty:
            self.check_state()
            return False
        self.check_plan(plan, running_before)
        self.check_state()
        self.on_plan(plan)
        for c in plan.chunks:
            assert c.start == c.request.num_computed
            c.request.num_computed += c.num_tokens
        sample_requests = [c.request for c in plan.chunks if c.samples]
        for req in sample_requests:
            req.num_pending += 1
        self.in_flight.append(sample_requests)
        return True

    def on_plan(self, plan) -> None:
        """What BatchBuilder.build requires: a token not known yet must be the last of its chunk
        and come from the step in flight."""
        carried = {id(r) for r in self.in_flight[-1]} if self.in_flight else set()
        for c in plan.chunks:
            stop = c.start + c.num_tokens
            known = min(stop, c.request.num_known_tokens)
            if stop > known:
                assert stop - known == 1 and id(c.request) in carried, (
                    f"tokens [{known}, {stop}) are neither known nor in flight"
                )

    def complete(self, sample_requests: list[Request]) -> list[Request]:
        finished = []
        for req in sample_requests:
            req.num_pending -= 1
            if req.is_finished:
                self.discarded[id(req)] += 1  # sampled after its end: speculative, dropped
                continue
            tok = self.spec_of[id(req)].script[len(req.output_token_ids)]
            if req.append_token(tok):
                self.scheduler.finish(req)
                assert req.status is RequestStatus.FINISHED
                assert req.pages == []
                finished.append(req)
        return finished

    # -- invariants ----------------------------------------------------------------------------
    def check_plan(self, plan, running_before: list[Request]) -> None:
        sched, cfg = self.scheduler, self.cfg
        assert 0 < plan.num_tokens <= cfg.max_batch_tokens
        ids = [id(c.request) for c in plan.chunks]
        assert len(ids) == len(set(ids)), "a request appears twice in one plan"
        preempted_ids = {id(r) for r in plan.preempted}
        assert len(preempted_ids) == len(plan.preempted), "a request preempted twice in one plan"
        running_ids = {id(r) for r in sched.running}
        for c in plan.chunks:
            req = c.request
            assert id(req) not in preempted_ids, "a preempted request still has a chunk"
            assert id(req) in running_ids
            assert req.status is RequestStatus.RUNNING
            assert c.num_tokens >= 1
            assert c.start == req.num_computed
            assert c.start + c.num_tokens <= req.num_tokens
            assert c.samples == (c.start + c.num_tokens == req.num_tokens)
            if c.samples:
                assert req.wants_more_tokens, "samples past max_new_tokens"
            assert len(req.pages) >= ceil_div(c.start + c.num_tokens, cfg.page_size), (
                "chunk scheduled without pages for its tokens"
            )
        # Victims are taken newest first: the preempted list is a tail of the running list, reversed.
        newest_first = running_before[::-1][:len(plan.preempted)]
        assert [id(r) for r in plan.preempted] == [id(r) for r in newest_first], (
            "preempted a request other than the newest running one"
        )
        for r in plan.preempted:
            assert r.num_preemptions >= 1
            assert r.pages == []
            assert r.num_computed == 0
            assert r.status is RequestStatus.WAITING
            assert r in sched.waiting
            assert not r.is_finished

    def check_state(self) -> None:
        sched, alloc, cfg = self.scheduler, self.allocator, self.cfg
        # (a request whose last token is in flight has given its place to a waiting one already)
        leaving = sum(r.num_sampled >= r.params.max_new_tokens for r in sched.running)
        assert len(sched.running) - leaving <= cfg.max_running_requests
        held: list[int] = []
        for req in sched.running:
            assert req.status is RequestStatus.RUNNING
            held.extend(req.pages)
        assert len(held) == len(set(held)), "two running requests share a page"
        for p in held:
            assert alloc.ref_count(p) == 1
        assert len(held) + alloc.num_free == cfg.num_pages, "pages leaked or freed twice"
        for req in sched.waiting:
            assert req.status is RequestStatus.WAITING
            assert req.pages == [], "a waiting (or preempted) request holds pages"
            assert req.num_computed == 0
        running_ids = {id(r) for r in sched.running}
        waiting_ids = {id(r) for r in sched.waiting}
        assert not running_ids & waiting_ids
        assert len(waiting_ids) == len(sched.waiting)
        assert len(running_ids) == len(sched.running)
        for req, _ in self.accepted:
            if req.is_finished:
                assert id(req) not in running_ids and id(req) not in waiting_ids
                assert req.pages == []

    def check_final(self) -> None:
        assert not self.scheduler.has_work
        assert not self.in_flight
        assert self.allocator.num_free == self.cfg.num_pages
        assert all(self.allocator.ref_count(p) == 0 for p in range(self.cfg.num_pages))
        for req, spec in self.accepted:
            assert req.status is RequestStatus.FINISHED
            assert req.finish_reason is not None
            assert req.num_pending == 0
            out = req.output_token_ids
            assert 1 <= len(out) <= spec.max_new_tokens
            # The outputs are exactly the script up to the first EOS (or the length limit):
            # nothing lost or duplicated by preemption and recomputation.
            expected = spec.script[:spec.max_new_tokens]
            if spec.use_eos and EOS in expected:
                expected = expected[:expected.index(EOS) + 1]
            assert out == expected
            if out[-1] == EOS and spec.use_eos:
                assert req.finish_reason is FinishReason.EOS
            else:
                assert len(out) == spec.max_new_tokens
                assert req.finish_reason is FinishReason.LENGTH
            assert req.pages == []
            # Only an EOS nobody had seen yet can be run past, and only by the one step in flight.
            if self.overlap and req.finish_reason is FinishReason.EOS:
                assert self.discarded[id(req)] <= 1
            else:
                assert self.discarded[id(req)] == 0


# -- strategies -------------------------------------------------------------------------------


@st.composite
def specs(draw, max_prompt: int = 24, max_new: int = 12, max_arrival: int = 30, eos=None) -> Spec:
    prompt_len = draw(st.integers(1, max_prompt))
    max_new_tokens = draw(st.integers(1, max_new))
    use_eos = draw(st.booleans()) if eos is None else eos
    # Mostly non-EOS tokens, so that requests often run to their length limit.
    token = st.one_of(st.integers(1, VOCAB_MAX), st.integers(1, VOCAB_MAX), st.just(EOS))
    script = draw(st.lists(token, min_size=max_new_tokens, max_size=max_new_tokens))
    arrival = draw(st.one_of(st.just(0), st.integers(0, max_arrival)))
    return Spec(prompt_len, max_new_tokens, script, use_eos, arrival)


configs = st.builds(
    Config,
    num_pages=st.integers(1, 24),
    page_size=st.integers(1, 8),
    max_batch_tokens=st.integers(1, 48),
    max_running_requests=st.integers(1, 8),
)


# -- tests ---------------------------------------------------------------------------------

# overlap=False is batching="sync" (each step completes before the next is scheduled);
# overlap=True is batching="async" (the next step is scheduled while one is in flight).
modes = pytest.mark.parametrize("overlap", [False, True], ids=["sync", "async"])


@modes
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=configs, reqs=st.lists(specs(), min_size=1, max_size=10))
def test_random_workloads_keep_invariants_and_finish(overlap, cfg, reqs):
    """Any workload (requests arriving at random steps, EOS or not): every step respects the token
    budget, running cap and page accounting; every request that fits finishes with its expected
    outputs, and every page is returned."""
    sim = Sim(cfg, reqs, overlap)
    sim.run()


@modes
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    page_size=st.integers(1, 4),
    extra_pages=st.integers(0, 3),
    max_batch_tokens=st.integers(1, 32),
    max_running_requests=st.integers(1, 8),
    reqs=st.lists(specs(max_prompt=12, max_new=12, max_arrival=8), min_size=2, max_size=8),
)
def test_tight_pools_preempt_and_still_finish(overlap, page_size, extra_pages, max_batch_tokens,
                                              max_running_requests, reqs):
    """With a pool just big enough for the largest request, preemption is frequent; the invariants
    still hold and every request finishes with its expected outputs."""
    largest = max(s.prompt_len + s.max_new_tokens - 1 for s in reqs)
    num_pages = ceil_div(largest, page_size) + extra_pages
    sim = Sim(Config(num_pages, page_size, max_batch_tokens, max_running_requests), reqs, overlap)
    sim.run()
    assert not sim.rejected


@modes
@settings(max_examples=100, deadline=None)
@given(
    page_size=st.integers(1, 4),
    prompt_len=st.integers(1, 8),
    max_new_tokens=st.integers(2, 16),
    n=st.integers(2, 6),
    data=st.data(),
)
def test_lockstep_overcommit_forces_preemption(overlap, page_size, prompt_len, max_new_tokens, n, data):
    """n identical requests admitted together and decoding in lockstep need more pages at the end
    than the pool has: some request must be preempted, and all still produce max_new_tokens tokens."""
    pages_prompt = ceil_div(prompt_len, page_size)
    pages_full = ceil_div(prompt_len + max_new_tokens - 1, page_size)
    # The pool holds every prompt (so all are admitted at step 0) and the largest request alone,
    # but not every request at full length.
    low = max(n * pages_prompt, pages_full)
    high = n * pages_full - 1
    if low > high:
        return  # no such pool for these sizes
    num_pages = data.draw(st.integers(low, high), label="num_pages")
    cfg = Config(num_pages, page_size, max_batch_tokens=n * prompt_len, max_running_requests=n)
    reqs = [Spec(prompt_len, max_new_tokens, [1] * max_new_tokens, use_eos=False, arrival=0)
            for _ in range(n)]
    sim = Sim(cfg, reqs, overlap)
    sim.run()
    assert any(r.num_preemptions > 0 for r, _ in sim.accepted)
    for r, _ in sim.accepted:
        assert len(r.output_token_ids) == max_new_tokens
        assert r.finish_reason is FinishReason.LENGTH


@modes
def test_preemption_example(overlap):
    """A fixed small example: 6 requests of 4 + 10 tokens in 8 pages of 2 preempt, and finish."""
    cfg = Config(num_pages=8, page_size=2, max_batch_tokens=16, max_running_requests=8)
    reqs = [Spec(4, 10, [3] * 10, use_eos=False, arrival=0) for _ in range(6)]
    sim = Sim(cfg, reqs, overlap)
    sim.run()
    assert sum(r.num_preemptions for r, _ in sim.accepted) > 0
    for r, _ in sim.accepted:
        assert r.output_token_ids == [3] * 10
        assert r.finish_reason is FinishReason.LENGTH


@settings(max_examples=50, deadline=None)
@given(cfg=configs, spec=specs(max_prompt=200, max_new=200))
def test_check_fits_matches_capacity(cfg, spec):
    """check_fits (and add) raise ValueError exactly when prompt + max_new_tokens - 1 exceeds the pool."""
    alloc = PageAllocator(cfg.num_pages)
    sched = Scheduler(alloc, cfg.page_size, cfg.max_batch_tokens, cfg.max_running_requests)
    req = Request(list(range(spec.prompt_len)), SamplingParams(max_new_tokens=spec.max_new_tokens))
    fits = spec.prompt_len + spec.max_new_tokens - 1 <= cfg.num_pages * cfg.page_size
    if fits:
        sched.check_fits(req)
        sched.add(req)
        assert list(sched.waiting) == [req]
    else:
        with pytest.raises(ValueError):
            sched.check_fits(req)
        with pytest.raises(ValueError):
            sched.add(req)
        assert not sched.waiting


def _running(sched: Scheduler, prompt_len: int, num_output: int, num_computed: int,
             num_pages: int | None = None) -> Request:
    """Put a request straight into `sched.running`, holding `num_pages` pages (default: just enough
    for its computed tokens)."""
    req = Request(list(range(1, prompt_len + 1)), SamplingParams(max_new_tokens=50))
    req.output_token_ids = [1] * num_output
    req.num_computed = num_computed
    if num_pages is None:
        num_pages = ceil_div(num_computed, sched.page_size)
    req.pages = sched.allocator.allocate(num_pages)
    req.status = RequestStatus.RUNNING
    sched.running.append(req)
    return req


def test_victim_with_a_chunk_in_this_step_loses_it():
    """When an older prefilling request preempts a newer one that was already given a decode chunk
    in the same step, that chunk is dropped and its tokens go back to the step's budget (the
    simulated loops above do not reach this state, so it is built by hand)."""
    alloc = PageAllocator(4)
    sched = Scheduler(alloc, page_size=4, max_batch_tokens=8, max_running_requests=4)
    older = _running(sched, prompt_len=8, num_output=0, num_computed=4)  # 1 page, needs a 2nd
    middle = _running(sched, prompt_len=6, num_output=0, num_computed=2, num_pages=2)  # has its pages
    newer = _running(sched, prompt_len=3, num_output=1, num_computed=3)  # 1 page, decoding
    assert alloc.num_free == 0
    plan = sched.schedule()
    # newer's decode is scheduled first, then older's prefill needs a page and preempts newer;
    # newer's token returns to the budget, so middle gets all of its 4 remaining tokens.
    assert plan.preempted == [newer]
    assert [(c.request, c.start, c.num_tokens, c.samples) for c in plan.chunks] == [
        (older, 4, 4, True), (middle, 2, 4, True)]
    assert plan.num_tokens == 8
    assert newer.pages == [] and newer.num_computed == 0 and newer.num_preemptions == 1
    assert list(sched.waiting) == [newer]
    assert sched.running == [older, middle]
    assert len(older.pages) == 2 and len(middle.pages) == 2
    assert alloc.num_free == 0


def test_newest_request_preempts_itself():
    """A request that needs a page when it is the newest running one is itself preempted; the older
    request keeps running."""
    alloc = PageAllocator(3)
    sched = Scheduler(alloc, page_size=2, max_batch_tokens=8, max_running_requests=4)
    older = _running(sched, prompt_len=3, num_output=1, num_computed=3)  # 2 pages, decodes in place
    newer = _running(sched, prompt_len=2, num_output=1, num_computed=2)  # 1 page, needs a 2nd
    assert alloc.num_free == 0
    plan = sched.schedule()
    assert plan.preempted == [newer]
    assert [(c.request, c.start, c.num_tokens) for c in plan.chunks] == [(older, 3, 1)]
    assert alloc.num_free == 1
    assert sched.running == [older] and list(sched.waiting) == [newer]


def test_waiting_request_with_its_last_token_in_flight_is_not_admitted():
    """A preempted request whose last token (max_new_tokens) is still in flight is not re-admitted,
    and it holds back the queue behind it: it finishes when that token lands."""
    alloc = PageAllocator(8)
    sched = Scheduler(alloc, page_size=2, max_batch_tokens=16, max_running_requests=4)
    last = Request([1, 2, 3], SamplingParams(max_new_tokens=2))
    last.output_token_ids = [5]
    last.num_pending = 1  # its 2nd and last token was sampled by the step in flight
    other = Request([1, 2], SamplingParams(max_new_tokens=2))
    sched.add(last)
    sched.add(other)
    assert not last.wants_more_tokens
    plan = sched.schedule()
    assert plan.is_empty and not plan.preempted
    assert list(sched.waiting) == [last, other] and alloc.num_free == 8
    # The token lands and ends the request; the queue moves again.
    last.num_pending = 0
    assert last.append_token(7)
    sched.finish(last)
    plan = sched.schedule()
    assert [(c.request, c.start, c.num_tokens) for c in plan.chunks] == [(other, 0, 2)]


def test_finish_of_waiting_request_removes_it():
    """finish() on a request still waiting (an abort) takes it off the queue and frees nothing."""
    alloc = PageAllocator(4)
    sched = Scheduler(alloc, page_size=2, max_batch_tokens=8, max_running_requests=4)
    req = Request([1, 2, 3], SamplingParams(max_new_tokens=2))
    sched.add(req)
    sched.finish(req, RequestStatus.ABORTED)
    assert not sched.has_work
    assert req.status is RequestStatus.ABORTED
    assert alloc.num_free == 4


def test_mixed_prefill_tokens_caps_prompts_only_in_steps_that_decode():
    """With mixed_prefill_tokens, a step that decodes takes at most that many prompt tokens; a step
    with nothing to decode still fills its whole budget; no request loses a token."""
    sched = Scheduler(PageAllocator(64), 4, max_batch_tokens=32, max_running_requests=8, mixed_prefill_tokens=5)
    first = Request(list(range(3, 23)), SamplingParams(max_new_tokens=4))
    sched.add(first)
    plan = sched.schedule()  # nothing decodes yet: the whole prompt in one step
    assert sum(c.num_tokens for c in plan.chunks) == 20
    first.num_computed = 20
    first.output_token_ids.append(7)
    sched.add(Request(list(range(3, 43)), SamplingParams(max_new_tokens=4)))
    seen = []
    for _ in range(3):
        plan = sched.schedule()
        decodes = [c for c in plan.chunks if c.num_tokens == 1 and c.request is first]
        prompt_tokens = sum(c.num_tokens for c in plan.chunks if c.request is not first)
        assert decodes and prompt_tokens <= 5
        seen.append(prompt_tokens)
        for c in plan.chunks:
            c.request.num_computed = c.start + c.num_tokens
        if len(first.output_token_ids) < 3:
            first.output_token_ids.append(7)
    assert seen == [5, 5, 5]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_generate_with_a_prefill_cap_equals_stock(mode):
    from models import random_prompts, stock_generate, tiny_model

    from hf_async_cb import BatchingConfig, Engine

    model = tiny_model("llama")
    prompts = random_prompts(6, 3, 60, seed=13)
    engine = Engine(model, BatchingConfig(mode=mode, max_batch_tokens=64, mixed_prefill_tokens=8, page_size=4))
    outs = engine.generate(prompts, max_new_tokens=6, eos_token_ids=())
    expected = stock_generate(model, prompts, max_new_tokens=6, eos_token_id=None, pad_token_id=0)
    assert [o.output_token_ids for o in outs] == expected[:, max(map(len, prompts)):].tolist()
