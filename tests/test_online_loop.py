"""The online loop's bookkeeping: a failing step fails its own requests only, aborts cost what was
aborted (not a scan of the backlog), and shutdown() may be asked from the loop's own thread.

As in test_online.py, the stock oracle runs on the shared tiny model and each engine on a copy."""

import logging
import threading

import pytest
from models import random_prompts
from test_online import Gate, own_model, stock_rows
from transformers import LogitsProcessorList

from hf_async_cb import BatchingConfig, Engine, FinishReason


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_failing_step_fails_its_requests_and_the_queued_ones_are_served_after(mode):
    """A forward raising once fails the requests running at that moment (those with a token in
    flight are among them); the queued ones get stock's tokens afterwards and no page is held."""
    model = own_model()
    armed, forwards, running_at_fault = threading.Event(), [0], []

    def fail_fifth_forward(module, args):
        if armed.is_set():
            forwards[0] += 1
            if forwards[0] == 5:
                running_at_fault.extend(r.request_id for r in engine.scheduler.running)
                raise RuntimeError("step failed")

    model.model.layers[0].register_forward_pre_hook(fail_fifth_forward)
    engine = Engine(model, BatchingConfig(mode=mode, max_batch_tokens=48, max_running_requests=2))
    engine.start()
    prompts = random_prompts(10, 3, 12, seed=91)
    handles = [engine.add_request(p, max_new_tokens=6, eos_token_ids=(2,)) for p in prompts]
    armed.set()
    served, failed = {}, []
    for handle, prompt in zip(handles, prompts):
        try:
            served[handle.request_id] = (handle.result(timeout=60).output_token_ids, prompt)
        except RuntimeError as error:
            assert str(error.__cause__) == "step failed"
            failed.append(handle.request_id)
    engine.shutdown(timeout=30)
    assert 1 <= len(running_at_fault) <= 2 and sorted(failed) == sorted(running_at_fault)
    assert [tokens for tokens, _ in served.values()] == stock_rows([p for _, p in served.values()], 6)
    assert engine.allocator.num_free == engine.allocator.num_pages


class ScanCounting(dict):
    """The loop's handles, counting the entries that passes over all of them go through."""

    def __init__(self):
        super().__init__()
        self.scanned = 0

    def _counted(self, view):
        self.scanned += len(self)
        return view

    def items(self):
        return self._counted(super().items())

    def values(self):
        return self._counted(super().values())

    def keys(self):
        return self._counted(super().keys())

    def __iter__(self):
        return self._counted(super().__iter__())


def test_aborts_cost_what_was_aborted_not_a_scan_of_the_backlog():
    """200 queued requests, 10 of them aborted: the loop, between its ~50 steps, never walks the
    whole backlog (a scan per step is quadratic in it), and the aborts still land."""
    engine = Engine(own_model(), BatchingConfig(mode="async", max_running_requests=4))
    engine.start()
    engine._background._worker.active = handles_held = ScanCounting()  # (the loop holds none yet)
    prompts = random_prompts(200, 2, 6, seed=92)
    handles = [engine.add_request(p, max_new_tokens=2, eos_token_ids=(2,)) for p in prompts]
    for handle in handles[100:110]:
        engine.abort(handle)
    outs = [h.result(timeout=120) for h in handles]
    engine.shutdown(timeout=30)
    assert all(o.finish_reason is FinishReason.ABORTED and not o.output_token_ids for o in outs[100:110])
    kept = outs[:100] + outs[110:]
    assert [o.output_token_ids for o in kept] == stock_rows(prompts[:100] + prompts[110:], 2)
    assert handles_held.scanned <= len(prompts)
    assert engine.allocator.num_free == engine.allocator.num_pages


def test_an_abort_drained_before_its_request_was_taken_in_still_lands():
    """abort() right after add_request(), its notice taken by the loop before the request itself
    (they travel on two queues): the request ends ABORTED all the same, never run to its end."""
    engine = Engine(own_model(), BatchingConfig(mode="sync"))
    engine.start()
    worker, gate = engine._background._worker, Gate()
    held = engine.add_request([5, 6, 7], max_new_tokens=2, eos_token_ids=(),
                              logits_processor=LogitsProcessorList([gate]))
    assert gate.entered.wait(30)  # the loop is inside a step: it takes nothing in meanwhile
    late = engine.add_request([8, 9, 10], max_new_tokens=50)
    engine.abort(late)
    assert worker.aborts.get_nowait() is late  # as if drained by the pass before the request's intake
    gate.release.set()
    out = late.result(timeout=30)
    engine.shutdown(timeout=30)
    assert out.finish_reason is FinishReason.ABORTED and len(out.output_token_ids) < 50
    assert len(held.result(timeout=1).output_token_ids) == 2
    assert engine.allocator.num_free == engine.allocator.num_pages


@pytest.mark.parametrize("caller", ["on_token", "done_callback"])
def test_shutdown_asked_on_the_loop_thread_stops_it_without_failing_anyone(caller, caplog):
    """shutdown() from a callback on the loop's thread asks for the stop and returns (a thread cannot
    join itself): the loop finishes the accepted work, as any graceful shutdown, and ends; more
    requests are refused, and a shutdown() from another thread then joins it."""
    engine = Engine(own_model(), BatchingConfig(mode="async"))
    engine.start()
    gate = Gate()
    prompts = random_prompts(4, 5, 20, seed=93)
    held = engine.add_request(prompts[0], max_new_tokens=8, eos_token_ids=(2,),
                              logits_processor=LogitsProcessorList([gate]))
    assert gate.entered.wait(30)  # everything below is in place before the loop goes on

    def stop_at_third_token(request, token):
        if len(request.output_token_ids) == 3:
            engine.shutdown()

    others = [engine.add_request(p, max_new_tokens=8, eos_token_ids=(2,)) for p in prompts[1:3]]
    caller_handle = engine.add_request(prompts[3], max_new_tokens=8, eos_token_ids=(2,),
                                       on_token=stop_at_third_token if caller == "on_token" else None)
    if caller == "done_callback":
        caller_handle.add_done_callback(lambda handle: engine.shutdown())
    loop_thread = engine._background.thread
    with caplog.at_level(logging.ERROR):
        gate.release.set()
        outs = [h.result(timeout=30) for h in [held, *others, caller_handle]]
        loop_thread.join(30)
    assert not loop_thread.is_alive()
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert [o.output_token_ids for o in outs] == stock_rows(prompts, 8)
    with pytest.raises(RuntimeError, match="shutting down"):
        engine.add_request([5, 6], max_new_tokens=2)
    engine.shutdown(timeout=30)
    engine.start()
    assert len(engine.add_request([5, 6], max_new_tokens=2, eos_token_ids=()).result(timeout=30).output_token_ids) == 2
    engine.shutdown(timeout=30)
    assert engine.allocator.num_free == engine.allocator.num_pages
