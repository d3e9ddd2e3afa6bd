"""Stateful fuzzing of the async pipeline: hypothesis interleaves adding requests, aborting them and
running steps, in any order, against a small pool (preemption), a small token budget (chunked
prefill) and CUDA-graph padding (its CPU stand-in). After every rule the page accounting must hold;
at the end every request that was not aborted has exactly stock's greedy tokens (EOS at a random
position of them), every aborted one a prefix of them, and no page is left allocated.
"""

import collections
import copy
import functools

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from models import stock_generate, tiny_model

from hf_async_cb import BatchingConfig, Engine, FinishReason, SamplingParams
from hf_async_cb.engine.requests import RequestStatus

MAX_NEW = 10


@functools.lru_cache(maxsize=None)
def oracle_model():
    """A copy of the engine's model: stock generate runs while the engine has the original prepared."""
    return copy.deepcopy(tiny_model("llama"))


@functools.lru_cache(maxsize=None)
def oracle(prompt: tuple[int, ...]) -> list[int]:
    """Stock greedy tokens of a prompt alone, no EOS."""
    out = stock_generate(oracle_model(), [list(prompt)], max_new_tokens=MAX_NEW, eos_token_id=None,
                         pad_token_id=0)
    return out[0, len(prompt):].tolist()


class PipelineMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        oracle_model()  # copied before the engine reroutes the original's attention
        self.engine = Engine(tiny_model("llama"), BatchingConfig(
            mode="async", page_size=4, num_pages=24, max_batch_tokens=20, max_running_requests=5, cuda_graphs=True))
        self.pipeline = self.engine.pipeline("async")
        self.prepared = self.engine.runner.prepared()
        self.prepared.__enter__()
        self.requests = []  # (request, expected tokens)

    @rule(prompt=st.lists(st.integers(3, 255), min_size=1, max_size=24), new=st.integers(1, MAX_NEW),
          eos_at=st.one_of(st.none(), st.integers(0, MAX_NEW - 1)))
    def add(self, prompt, new, eos_at):
        full = oracle(tuple(prompt))[:new]
        eos = ()
        expected = full
        if eos_at is not None and eos_at < len(full):
            eos = (full[eos_at],)
            expected = full[: full.index(eos[0]) + 1]
        req = self.engine.make_request(prompt, SamplingParams(max_new_tokens=new, eos_token_ids=eos))
        self.engine.scheduler.add(req)
        self.requests.append((req, expected))

    @precondition(lambda self: any(not r.is_finished for r, _ in self.requests))
    @rule(data=st.data())
    def abort(self, data):
        live = [r for r, _ in self.requests if not r.is_finished]
        req = data.draw(st.sampled_from(live))
        self.engine.scheduler.finish(req, RequestStatus.ABORTED)  # what the online loop does
        req.finish_reason = FinishReason.ABORTED

    @rule(n=st.integers(1, 4))
    def step(self, n):
        for _ in range(n):
            if self.engine.scheduler.has_work:
                self.pipeline.step()

    @invariant()
    def pages_are_accounted_for(self):
        """Each held page counts exactly its holders (requests whose prompts start alike share the
        prefix cache's pages, and a cached last page is held for its copy until the step that
        copies it is queued), and every page is either held or free (cached pages no request holds
        count as free: they are handed out last)."""
        allocator = self.engine.allocator
        holders = collections.Counter(p for r in self.engine.scheduler.running for p in r.pages)
        holders.update(self.engine.scheduler.held_for_copies())
        for page, n in holders.items():
            assert allocator.ref_count(page) == n, f"page {page}: {allocator.ref_count(page)} references, {n} holders"
        assert allocator.num_free + len(holders) == allocator.num_pages
        for r in self.engine.scheduler.running:
            assert r.num_computed <= len(r.pages) * self.engine.scheduler.page_size
        for r in self.engine.scheduler.waiting:
            assert not r.pages

    def teardown(self):
        try:
            while self.engine.scheduler.has_work:
                self.pipeline.step()
            self.pipeline.drain()
            for req, expected in self.requests:
                if req.finish_reason is FinishReason.ABORTED:
                    assert req.output_token_ids == expected[: len(req.output_token_ids)]
                else:
                    assert req.output_token_ids == expected, req.request_id
                assert req.num_pending == 0
            assert self.engine.allocator.num_free == self.engine.allocator.num_pages
        finally:
            self.prepared.__exit__(None, None, None)


PipelineMachine.TestCase.settings = settings(max_examples=30, stateful_step_count=25, deadline=None,
                                             suppress_health_check=[HealthCheck.too_slow])
test_pipeline_state_machine = PipelineMachine.TestCase


def test_oracle_is_deterministic():
    assert oracle((5, 6, 7)) == oracle((5, 6, 7)) and len(oracle((5, 6, 7))) == MAX_NEW
    assert torch.is_grad_enabled()  # the engine's no_grad does not leak


def test_requests_sharing_a_cached_page_are_accounted_for():
    """The sequence hypothesis found: a second prompt that starts with the first one's full page
    takes that page from the prefix cache while the first still runs (two holders, one page)."""
    machine = PipelineMachine()
    try:
        machine.add(prompt=[3, 3, 3, 3], new=2, eos_at=None)
        machine.step(n=1)
        machine.add(prompt=[3, 3, 3, 3, 3], new=1, eos_at=None)
        machine.step(n=1)
        machine.pages_are_accounted_for()
        running = machine.engine.scheduler.running
        assert len(running) == 2 and running[0].pages[0] == running[1].pages[0]  # shared, not copied
    finally:
        machine.teardown()
