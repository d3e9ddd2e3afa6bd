"""The online API: concurrent producers, streaming (iterator and asyncio), aborts, faults, shutdown.

While its loop runs, an engine owns its model's attention routing, so the stock oracle runs on
the shared tiny model and each engine on a copy of it."""

import asyncio
import copy
import gc
import threading
import time

import pytest
import torch
from models import generated_rows, random_prompts, started_thread, stock_generate, tiny_model
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

from hf_async_cb import BatchingConfig, Engine, FinishReason, SamplingParams


def stock_rows(prompts, new):
    return generated_rows(stock_generate(tiny_model("llama"), prompts, max_new_tokens=new, eos_token_id=[2],
                                         pad_token_id=0), max(map(len, prompts)), pad=0, eos=(2,))


def own_model(family="llama"):
    return copy.deepcopy(tiny_model(family))


@pytest.fixture(params=["sync", "async"])
def engine(request):
    engine = Engine(own_model(), BatchingConfig(mode=request.param, max_batch_tokens=48))
    engine.start()
    yield engine
    engine.shutdown(cancel=True, timeout=30)
    assert engine.allocator.num_free == engine.allocator.num_pages


def test_concurrent_producers_get_stock_tokens(engine):
    prompts = random_prompts(24, 1, 40, seed=71)
    expected = stock_rows(prompts, 10)
    handles = [None] * len(prompts)

    def produce(indices):
        for i in indices:
            handles[i] = engine.add_request(prompts[i], max_new_tokens=10, eos_token_ids=(2,))

    threads = [threading.Thread(target=produce, args=(range(k, len(prompts), 4),)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    results = [h.result(timeout=60).output_token_ids for h in handles]
    assert results == expected


def test_streams_match_results(engine):
    prompts = random_prompts(3, 5, 20, seed=72)
    handles = [engine.add_request(p, max_new_tokens=12) for p in prompts]
    streamed = [list(h) for h in handles[:2]]

    async def consume(handle):
        return [tok async for tok in handle.astream()]

    streamed.append(asyncio.run(consume(handles[2])))
    assert streamed == [h.result(timeout=30).output_token_ids for h in handles]


def test_abort_mid_flight_keeps_the_others(engine):
    long = engine.add_request(random_prompts(1, 10, 10, seed=73)[0], max_new_tokens=400, eos_token_ids=())
    short_prompts = random_prompts(4, 3, 12, seed=74)
    shorts = [engine.add_request(p, max_new_tokens=8, eos_token_ids=(2,)) for p in short_prompts]
    seen = []
    for token in long:
        seen.append(token)
        if len(seen) == 3:
            engine.abort(long)
    out = long.result(timeout=30)
    assert out.finish_reason is FinishReason.ABORTED
    assert 3 <= len(out.output_token_ids) < 400 and out.output_token_ids == seen
    assert [h.result(timeout=30).output_token_ids for h in shorts] == stock_rows(short_prompts, 8)


class Explodes(LogitsProcessor):
    def __call__(self, input_ids, scores):
        if input_ids.shape[1] > 9:
            raise ValueError("processor exploded")
        return scores


def test_a_fault_reaches_its_caller_and_the_loop_keeps_serving(engine):
    prompt = random_prompts(1, 6, 6, seed=75)[0]
    bad = engine.add_request(prompt, max_new_tokens=20, logits_processor=LogitsProcessorList([Explodes()]))
    with pytest.raises(RuntimeError, match="processor exploded"):
        bad.result(timeout=30)
    good = engine.add_request(prompt, max_new_tokens=5, eos_token_ids=(2,))
    assert good.result(timeout=30).output_token_ids == stock_rows([prompt], 5)[0]


def test_shutdown_with_queued_requests_loses_none():
    engine = Engine(own_model(), BatchingConfig(mode="async", max_running_requests=2))
    engine.start()
    handles = [engine.add_request(p, max_new_tokens=50) for p in random_prompts(10, 5, 30, seed=76)]
    engine.shutdown(cancel=True, timeout=30)
    outs = [h.result(timeout=1) for h in handles]
    assert all(o.finish_reason in (FinishReason.ABORTED, FinishReason.LENGTH, FinishReason.EOS) for o in outs)
    assert any(o.finish_reason is FinishReason.ABORTED for o in outs)
    assert engine.allocator.num_free == engine.allocator.num_pages
    with pytest.raises(RuntimeError, match="start"):
        engine.add_request([5, 6], max_new_tokens=2)
    # A graceful shutdown finishes what was accepted.
    engine.start()
    handles = [engine.add_request(p, max_new_tokens=6, eos_token_ids=()) for p in random_prompts(5, 5, 30, seed=77)]
    engine.shutdown(timeout=30)
    assert all(len(h.result(timeout=1).output_token_ids) == 6 for h in handles)


def test_misuse_is_refused():
    model = own_model()
    engine = Engine(model, BatchingConfig(mode="sync"))
    with pytest.raises(RuntimeError, match="start"):
        engine.add_request([5, 6])
    engine.start()
    try:
        with pytest.raises(RuntimeError, match="background loop"):
            engine.generate([[5, 6]], max_new_tokens=2)
        with pytest.raises(ValueError, match="tokenizer"):
            engine.add_request("hello")
        with pytest.raises(ValueError, match="vocabulary"):
            engine.add_request([5, 100_000])
    finally:
        engine.shutdown(timeout=10)
    assert model.config._attn_implementation != "hf_async_cb_paged"


def test_text_prompts_with_a_tokenizer():
    class Tok:
        def __call__(self, text):
            return {"input_ids": [3 + (ord(c) % 200) for c in text]}

    engine = Engine(own_model("gpt2"), BatchingConfig(mode="async"), tokenizer=Tok())
    engine.start()
    try:
        out = engine.add_request("hello world", SamplingParams(max_new_tokens=4, eos_token_ids=())).result(timeout=30)
    finally:
        engine.shutdown(timeout=10)
    assert out.prompt_token_ids == Tok()("hello world")["input_ids"] and len(out.output_token_ids) == 4
    assert torch.is_tensor(torch.tensor(out.output_token_ids))


def test_asyncio_producers_and_consumers(engine):
    prompts = random_prompts(12, 2, 30, seed=78)
    expected = stock_rows(prompts, 9)

    async def client(prompt):
        await asyncio.sleep(0.001 * (len(prompt) % 5))  # arrive at different times
        handle = engine.add_request(prompt, max_new_tokens=9, eos_token_ids=(2,))
        return [tok async for tok in handle.astream()]

    async def main():
        return await asyncio.gather(*(client(p) for p in prompts))

    assert asyncio.run(main()) == expected


def _in_thread(fn, timeout=30.0):
    """fn() on a daemon thread: its result, or a failure instead of a hang if it blocks."""
    thread, box = started_thread(fn)
    thread.join(timeout)
    assert not thread.is_alive(), "the reader blocked"
    if "error" in box:
        raise box["error"]
    return box["value"]


def _read_async(handle, timeout=30.0):
    async def read():
        return [tok async for tok in handle.astream()]

    return _in_thread(lambda: asyncio.run(asyncio.wait_for(read(), timeout)), timeout + 5)


def test_every_reader_sees_the_whole_stream(engine):
    """Concurrent readers, and readers that come after the end, each get every token from the first."""
    prompt = random_prompts(1, 5, 20, seed=79)[0]
    handle = engine.add_request(prompt, max_new_tokens=16, eos_token_ids=(2,))
    concurrent = [[] for _ in range(3)]
    readers = [threading.Thread(target=out.extend, args=(handle,), daemon=True) for out in concurrent]
    for r in readers:
        r.start()
    early_async = _read_async(handle)
    for r in readers:
        r.join(30)
    assert not any(r.is_alive() for r in readers), "a concurrent reader blocked"
    expected = handle.result(timeout=30).output_token_ids
    assert expected == stock_rows([prompt], 16)[0]
    again = [_in_thread(lambda: list(handle)) for _ in range(2)]
    late_async = [_read_async(handle) for _ in range(2)]
    assert concurrent + [early_async] + again + late_async == [expected] * 8


def test_a_failure_reaches_every_reader(engine):
    bad = engine.add_request(random_prompts(1, 6, 6, seed=80)[0], max_new_tokens=20,
                             logits_processor=LogitsProcessorList([Explodes()]))
    with pytest.raises(RuntimeError, match="processor exploded"):
        bad.result(timeout=30)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="processor exploded"):
            _in_thread(lambda: list(bad))
        with pytest.raises(RuntimeError, match="processor exploded"):
            _read_async(bad)


class Slow(LogitsProcessor):
    """Leaves the scores alone; makes each step take a while, so that waits time out mid-stream."""

    def __call__(self, input_ids, scores):
        time.sleep(0.02)
        return scores


def test_a_cancelled_wait_loses_no_token(engine):
    """wait_for() timing out on astream()'s next token, again and again: the same iterator then
    goes on, and no token is lost."""
    prompt = random_prompts(1, 5, 20, seed=81)[0]
    handle = engine.add_request(prompt, max_new_tokens=10, eos_token_ids=(2,),
                                logits_processor=LogitsProcessorList([Slow()]))

    async def read():
        stream = handle.astream().__aiter__()
        tokens, timeouts = [], 0
        while True:
            try:
                tokens.append(await asyncio.wait_for(stream.__anext__(), 0.004))
            except asyncio.TimeoutError:
                timeouts += 1
            except StopAsyncIteration:
                return tokens, timeouts

    tokens, timeouts = _in_thread(lambda: asyncio.run(asyncio.wait_for(read(), 30)), 35)
    assert timeouts >= 3
    assert tokens == handle.result(timeout=30).output_token_ids == stock_rows([prompt], 10)[0]


class Gate(LogitsProcessor):
    """Holds the loop inside a step until released, so that requests added meanwhile join the same step."""

    def __init__(self):
        self.entered, self.release = threading.Event(), threading.Event()

    def __call__(self, input_ids, scores):
        self.entered.set()
        assert self.release.wait(30)
        return scores


class CriterionFails(StoppingCriteria):
    def __init__(self, error=ValueError):
        self.error = error

    def __call__(self, input_ids, scores, **kwargs):
        raise self.error("criterion failed")


class ProcessorFails(LogitsProcessor):
    def __init__(self, error=ValueError):
        self.error = error

    def __call__(self, input_ids, scores):
        raise self.error("processor failed")


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt, SystemExit])
@pytest.mark.parametrize("fault", ["criterion", "processor"])
def test_a_fault_fails_only_its_request(engine, fault, error):
    """B's criterion (or processor) raises in the step where A ends: only B fails, its error the
    cause of what its handle raises, whatever it is (one request's SystemExit or KeyboardInterrupt
    included: it must not fail the loop's other requests)."""
    gate = Gate()
    held_prompt, a_prompt, b_prompt = random_prompts(3, 5, 12, seed=82)
    held = engine.add_request(held_prompt, max_new_tokens=4, eos_token_ids=(2,),
                              logits_processor=LogitsProcessorList([gate]))
    assert gate.entered.wait(30)
    a = engine.add_request(a_prompt, max_new_tokens=1, eos_token_ids=())
    b = engine.add_request(b_prompt, max_new_tokens=8, **(
        dict(stopping_criteria=StoppingCriteriaList([CriterionFails(error)])) if fault == "criterion"
        else dict(logits_processor=LogitsProcessorList([ProcessorFails(error)]))))
    gate.release.set()
    with pytest.raises(RuntimeError, match=f"{error.__name__}.*{fault} failed") as failed:
        b.result(timeout=30)
    assert type(failed.value.__cause__) is error
    out = a.result(timeout=30)
    assert out.finish_reason is FinishReason.LENGTH and out.output_token_ids == stock_rows([a_prompt], 1)[0]
    assert held.result(timeout=30).output_token_ids == stock_rows([held_prompt], 4)[0]
    assert list(a) == out.output_token_ids


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_dropped_engine_stops_its_loop_and_gives_the_model_back(mode):
    """An engine dropped without shutdown(): its loop aborts what it held and ends, and the model
    gets its own attention back."""
    model = own_model()
    implementation = model.config._attn_implementation
    prompts = random_prompts(2, 5, 12, seed=83)
    engine = Engine(model, BatchingConfig(mode=mode))
    engine.start()
    handle = engine.add_request(prompts[0], max_new_tokens=400, eos_token_ids=())
    next(iter(handle))  # running
    thread = engine._background.thread
    del engine
    gc.collect()
    thread.join(10)
    assert not thread.is_alive()
    assert model.config._attn_implementation == implementation != "hf_async_cb_paged"
    assert handle.result(timeout=1).finish_reason is FinishReason.ABORTED
    assert torch.equal(stock_generate(model, prompts, max_new_tokens=6),
                       stock_generate(tiny_model("llama"), prompts, max_new_tokens=6))


def test_done_callbacks_run_once_each_as_requests_end(engine):
    """add_done_callback: called once with the handle when the request ends (on the loop's thread),
    or at once when it already has; a callback that raises reaches neither the loop nor the others."""
    prompts = random_prompts(4, 5, 12, seed=80)
    seen: list = []
    handles = [engine.add_request(p, max_new_tokens=4 + i, eos_token_ids=(2,)) for i, p in enumerate(prompts)]
    def interrupts(handle):
        raise KeyboardInterrupt  # (raised by the callback on the loop's thread: the user's Ctrl-C never is)

    for i, h in enumerate(handles):
        if i == 1:
            h.add_done_callback(lambda h: 1 / 0)
        if i == 2:
            h.add_done_callback(interrupts)
        h.add_done_callback(seen.append)
    outs = [h.result(timeout=30) for h in handles]
    deadline = time.monotonic() + 10
    while len(seen) < len(handles) and time.monotonic() < deadline:
        time.sleep(0.01)  # (result() may return before the loop thread has run the callbacks)
    assert sorted(map(id, seen)) == sorted(map(id, handles))
    late: list = []
    handles[0].add_done_callback(late.append)  # already done: called here, now
    assert late == [handles[0]]
    assert [o.output_token_ids for o in outs] == [stock_rows([p], 4 + i)[0] for i, p in enumerate(prompts)]
    again = engine.add_request(prompts[0], max_new_tokens=4, eos_token_ids=(2,)).result(timeout=30)
    assert again.output_token_ids == outs[0].output_token_ids  # the loop still serves


def test_a_loop_that_stops_outside_a_step_fails_every_waiting_caller(monkeypatch):
    """An error the loop cannot pin on a step (here its set-up) fails every request it holds or has
    queued, and later submissions are refused: nobody waits on a loop that is gone."""
    engine = Engine(own_model(), BatchingConfig(mode="async"))
    entered = threading.Event()
    release = threading.Event()

    class Broken:
        def __enter__(self):
            entered.set()
            release.wait(10)  # requests queue up meanwhile
            raise RuntimeError("loop set-up broke")

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(engine.runner, "prepared", lambda *a, **k: Broken())
    engine.start()
    assert entered.wait(10)
    handles = [engine.add_request(p, max_new_tokens=3) for p in random_prompts(3, 4, 8, seed=81)]
    release.set()
    for h in handles:
        with pytest.raises(RuntimeError, match="set-up broke"):
            h.result(timeout=10)
    with pytest.raises(RuntimeError, match=r"loop stopped on an error \(RuntimeError: loop set-up broke\)"):
        engine.add_request([5, 6], max_new_tokens=2)
    engine.shutdown(timeout=10)


def test_a_new_engine_on_a_model_whose_last_one_was_dropped_serves_at_once():
    """A started Engine dropped without shutdown() is collected at once (no cycle through its loop),
    and its loop, stopping, is waited for: the next Engine's loop serves right away. A second
    Engine started while the first serves is refused in start(), where the caller sees why."""
    model = own_model()
    prompts = random_prompts(2, 4, 9, seed=84)
    expected = stock_rows(prompts, 5)
    for _ in range(3):
        engine = Engine(model, BatchingConfig(mode="async"))
        engine.start()
        assert [engine.add_request(p, max_new_tokens=5).result(timeout=30).output_token_ids
                for p in prompts] == expected
        del engine  # no shutdown(), no gc.collect()
    first, second = Engine(model, BatchingConfig(mode="sync")), Engine(model, BatchingConfig(mode="sync"))
    first.start()
    with pytest.raises(RuntimeError, match="serving another Engine's background loop"):
        second.start()
    first.shutdown()
    second.start()
    assert second.add_request(prompts[0], max_new_tokens=5).result(timeout=30).output_token_ids == expected[0]
    second.shutdown()


@pytest.mark.parametrize("ending", ["return", "raise"])
def test_a_script_that_ends_while_the_loop_serves_exits_cleanly(ending, tmp_path):
    """The interpreter exiting in the middle of the loop's work (the script returns, or dies of an
    error) cancels and joins the loop first: exit code 0 (1 with the script's traceback), never a
    process abort from torch's threads torn down mid-step."""
    import os
    import subprocess
    import sys

    script = tmp_path / "serve_and_leave.py"
    script.write_text(
        "import sys, time\n"
        "from models import random_prompts, tiny_model\n"
        "from hf_async_cb import BatchingConfig, Engine\n"
        "engine = Engine(tiny_model('llama'), BatchingConfig(mode='async'))\n"
        "engine.start()\n"
        "handles = [engine.add_request(p, max_new_tokens=400) for p in random_prompts(8, 50, 50, seed=1)]\n"
        "time.sleep(0.3)\n"
        + ("raise RuntimeError('the script failed')\n" if ending == "raise" else "print('done')\n"))
    tests = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([tests, os.path.dirname(tests), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == (1 if ending == "raise" else 0), result.stderr[-2000:]
    assert "terminate called" not in result.stderr


def test_params_given_twice_or_of_the_wrong_type_are_refused():
    """add_request and generate refuse params beside keyword options (nothing silently dropped),
    and params that are not SamplingParams, naming what is expected."""
    engine = Engine(own_model(), BatchingConfig(mode="sync"))
    with pytest.raises(TypeError, match="SamplingParams"):
        engine.generate([[5, 6]], {"max_new_tokens": 3})
    with pytest.raises(TypeError, match="SamplingParams"):
        engine.generate([[5, 6]], 3)
    with pytest.raises(TypeError, match=r"params\[1\] is a dict"):
        engine.generate([[5, 6], [7]], [SamplingParams(), {"max_new_tokens": 3}])
    engine.start()
    try:
        with pytest.raises(ValueError, match="not both"):
            engine.add_request([5, 6], SamplingParams(max_new_tokens=2), max_new_tokens=3, do_sample=True)
        with pytest.raises(TypeError, match="SamplingParams"):
            engine.add_request([5, 6], {"max_new_tokens": 3})
    finally:
        engine.shutdown(timeout=10)


def test_a_handle_is_aborted_only_by_its_engine_and_off_is_not_an_engine_mode():
    first, second = Engine(own_model(), BatchingConfig(mode="async")), Engine(own_model(), BatchingConfig(mode="async"))
    with pytest.raises(ValueError, match="'sync' or 'async'"):
        first.generate([[5, 6]], max_new_tokens=2, mode="off")
    first.start()
    second.start()
    try:
        handle = first.add_request([5, 6, 7], max_new_tokens=8, eos_token_ids=())
        with pytest.raises(ValueError, match="not added to this engine"):
            second.abort(handle)
        assert len(handle.result(timeout=30).output_token_ids) == 8  # untouched
    finally:
        first.shutdown(timeout=30)
        second.shutdown(timeout=30)


def test_a_callback_raising_on_the_last_token_aborts_the_request_all_the_same():
    engine = Engine(own_model(), BatchingConfig(mode="sync"))
    engine.start()
    try:
        def on_token(request, token):
            if len(request.output_token_ids) == 3:
                raise ValueError("callback failed")

        handle = engine.add_request([5, 6, 7], max_new_tokens=3, eos_token_ids=(), on_token=on_token)
        with pytest.raises(RuntimeError, match="callback failed"):
            handle.result(timeout=30)
        assert handle.request.finish_reason is FinishReason.ABORTED
    finally:
        engine.shutdown(timeout=30)


def test_after_a_shutdown_that_timed_out_the_messages_agree_on_what_to_do():
    engine = Engine(own_model(), BatchingConfig(mode="async"))
    engine.start()
    handles = [engine.add_request(p, max_new_tokens=200, eos_token_ids=()) for p in random_prompts(4, 20, 30, seed=90)]
    with pytest.raises(TimeoutError):
        engine.shutdown(timeout=0.0001)
    with pytest.raises(RuntimeError, match="shutting down.*shutdown\\(\\), then start\\(\\)"):
        engine.add_request([5, 6], max_new_tokens=2)
    with pytest.raises(RuntimeError, match="still stopping.*shutdown\\(\\) again"):
        engine.start()
    engine.shutdown(timeout=60)  # waits for what was accepted
    assert all(len(h.result(timeout=1).output_token_ids) == 200 for h in handles)
    engine.start()
    assert len(engine.add_request([5, 6], max_new_tokens=2, eos_token_ids=()).result(timeout=30).output_token_ids) == 2
    engine.shutdown(timeout=30)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_clear_prefix_cache_while_serving_runs_on_the_loop_between_steps(mode, monkeypatch):
    """The scheduler's tables belong to the loop's thread while it serves: clear_prefix_cache() from
    another thread has the loop empty them between steps and waits for it (run from the caller's
    thread, it raced the loop: 'dictionary changed size during iteration'); from the loop's own
    thread (a callback) it clears at once. Tokens stay stock's."""
    import threading

    model = tiny_model("llama")
    prompts = random_prompts(6, 20, 30, seed=5)
    engine = Engine(model, BatchingConfig(mode=mode, page_size=4))
    cleared_on = []
    clear = engine.scheduler.clear_prefix_cache

    def recording_clear():
        cleared_on.append(threading.current_thread())
        return clear()

    monkeypatch.setattr(engine.scheduler, "clear_prefix_cache", recording_clear)
    engine.start()
    try:
        handles = [engine.add_request(p, max_new_tokens=8) for p in prompts]
        engine.clear_prefix_cache()
        assert cleared_on and cleared_on[-1] is engine._background.thread
        inside = engine.add_request(prompts[0], max_new_tokens=2,
                                    on_token=lambda request, token: engine.clear_prefix_cache())
        outs = [h.result(timeout=120).output_token_ids for h in handles]
        inside.result(timeout=120)
        assert all(t is engine._background.thread for t in cleared_on)
    finally:
        engine.shutdown()
        engine.close()
    with Engine(model, BatchingConfig(mode="sync")) as reference:
        assert outs == [o.output_token_ids for o in reference.generate(prompts, max_new_tokens=8)]
